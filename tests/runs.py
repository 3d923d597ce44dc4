"""What the tests read back from a run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a last line cut off by a crash mid-append is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
