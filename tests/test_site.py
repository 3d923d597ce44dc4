"""The documentation site builds offline and strictly (a warning or a broken link fails it),
as `make docs` builds it, and fetches nothing from elsewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly_and_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "cli.html", "config.html", "benchmarks.html", "guide/data.html"):
        assert (site / page).is_file(), page
    api = (site / "reference" / "api.html").read_text(encoding="utf-8")
    assert "nmt.load" in api and "translate" in api and "ConfigError" in api
    # no page loads a font, a script or a stylesheet from another host
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*(?:src|href)=["']https?://""")
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text(encoding="utf-8")), page
