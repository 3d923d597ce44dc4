"""The synthetic corpus generator and the data-path benchmark behind docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def generate(out: Path, *args: str) -> None:
    script = ROOT / "scripts/synthetic_corpus.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), *args], check=True)


def words_per_line(path: Path) -> np.ndarray:
    return np.array([len(line.split()) for line in path.read_text().splitlines()])


def test_synthetic_corpus_has_wmt_like_lengths_and_is_reproducible(tmp_path: Path) -> None:
    generate(tmp_path / "a", "--pairs", "20000", "--dev", "300", "--vocab", "3000")
    generate(tmp_path / "b", "--pairs", "20000", "--dev", "300", "--vocab", "3000")
    for name in ("train.en", "train.de", "dev.en", "dev.de"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    src, trg = (words_per_line(tmp_path / "a" / f"train.{side}") for side in ("en", "de"))
    assert len(src) == len(trg) == 20000 and src.min() >= 1 and trg.min() >= 1
    assert 19 <= np.median(src) <= 21 and 21 <= src.mean() <= 25, "WMT14 en-de's lengths"
    assert 0.9 <= trg.sum() / src.sum() <= 1.0
    assert src.max() > 80 and src.max() <= 250, "a long tail, cut at --max-words"
    train_words = set((tmp_path / "a/train.en").read_text().split())
    dev_words = set((tmp_path / "a/dev.en").read_text().split())
    assert len(dev_words - train_words) < 0.2 * len(dev_words), "dev shares the vocabulary"


def test_synthetic_corpus_refuses_bad_sizes(tmp_path: Path) -> None:
    script = ROOT / "scripts/synthetic_corpus.py"
    result = subprocess.run(
        [sys.executable, str(script), "--pairs", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--pairs" in result.stderr


@pytest.mark.slow
def test_data_benchmark_measures_a_cold_and_a_warm_start(tmp_path: Path) -> None:
    script = ROOT / "scripts/bench_data.py"
    subprocess.run(
        [sys.executable, str(script), "--pairs", "3000", "--work-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (result,) = json.loads((tmp_path / "bench-data.json").read_text())["results"]
    cold, warm = result["cold"], result["warm"]
    assert "tokenizer" in cold["stages"] and "tokenise" in cold["stages"]
    assert warm["stages"] == "", "the warm run prepares nothing"
    assert cold["verify_s"] is None and warm["verify_s"] >= 0, "the warm run verifies the store"
    assert 0 < warm["first_step_s"] < cold["first_step_s"]
    assert cold["peak_rss_gib"] > 0 and warm["peak_pss_gib"] > 0
