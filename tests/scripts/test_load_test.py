"""scripts/load_test.py runs end to end on the tiny run (a few requests): `nmt serve` started
and stopped with and without --no-batching, a row of figures per mode and concurrency in its
table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="nmt serve's extra is not installed")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_load_test_measures_both_modes(run: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "load"
    command = [
        sys.executable, str(ROOT / "scripts" / "load_test.py"), "--model", str(run),
        "--source", str(corpus / "test.src"), "--requests", "6", "--concurrency", "1", "3",
        "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()
    assert table[0].startswith("| batching | concurrency | requests | requests/s | p50 ms")
    assert len(table) == 2 + 4 and (out / "load_test.md").read_text() == result.stdout
    report = json.loads((out / "load_test.json").read_text())
    rows = report["rows"]
    assert [(r["batching"], r["concurrency"]) for r in rows] == [
        (True, 1), (True, 3), (False, 1), (False, 3)
    ]  # fmt: skip
    for row in rows:
        assert row["requests"] == 6 and row["requests_per_s"] > 0
        assert 0 < row["p50_ms"] <= row["p95_ms"]
        assert 1.0 <= row["mean_batched_with"] <= row["concurrency"]
        if not row["batching"] or row["concurrency"] == 1:
            assert row["mean_batched_with"] == 1.0
    assert report["machine"]["cores"] >= 1
    assert (out / "serve-batching.log").is_file() and (out / "serve-no-batching.log").is_file()
