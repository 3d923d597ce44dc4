#!/usr/bin/env python3
"""A screenshot of the documentation site's front page (docs/site.png): builds the site with
MkDocs into a temporary folder (or takes one built already) and opens its index.html in
headless Chromium, as scripts/screenshot.py does for the page of `nmt serve`.

    .venv/bin/python scripts/site_screenshot.py
    .venv/bin/python scripts/site_screenshot.py --site site --out shot.png

Needs the dev extra (mkdocs, selenium) and Debian's chromium and chromium-driver.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from screenshot import ROOT, chromium


def build(site: Path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)]
    subprocess.run(command, cwd=ROOT, check=True)


def shoot(site: Path, out: Path, width: int, height: int) -> None:
    with chromium(width, height) as driver:
        driver.get((site / "index.html").resolve().as_uri())
        time.sleep(1.0)  # the theme's script lays out the navigation
        driver.save_screenshot(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a site built already (default: build one)")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=860)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "site.png")
    args = parser.parse_args()
    if args.site is not None:
        shoot(args.site, args.out, args.width, args.height)
        return
    with tempfile.TemporaryDirectory(prefix="nmt-site-") as folder:
        build(Path(folder))
        shoot(Path(folder), args.out, args.width, args.height)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
