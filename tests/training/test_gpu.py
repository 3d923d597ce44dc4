"""Mixed precision on CUDA: bf16 autocast and fp16 with a grad scaler train as well as fp32.

Run with `pytest -m gpu tests/training/test_gpu.py` on a machine with a GPU; skipped without one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runs import read_metrics
from synthetic import data_section, luong_model_section, write_corpus

from nmt.config import from_dict
from nmt.training import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, {"train": 2000, "dev": 100})
    return root


def final_dev_loss(corpus: Path, run_dir: Path, precision: str) -> float:
    config = from_dict(
        {
            "data": data_section(corpus),
            "tokenizer": {"vocab_size": 60, "type": "bpe"},
            "model": luong_model_section(64, dropout=0.0),
            "training": {
                "epochs": 4,
                "batch_tokens": 1000,
                "learning_rate": 0.003,
                "validate_every": 100,
                "precision": precision,
            },
            "run": {"dir": str(run_dir), "device": "cuda"},
        }
    )
    train(config, quiet=True)
    return [r for r in read_metrics(run_dir) if r["split"] == "dev"][-1]["loss"]


@pytest.fixture(scope="module")
def fp32_loss(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> float:
    return final_dev_loss(corpus, tmp_path_factory.mktemp("fp32") / "run", "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_reaches_the_fp32_dev_loss(
    corpus: Path, fp32_loss: float, tmp_path: Path, precision: str
) -> None:
    loss = final_dev_loss(corpus, tmp_path / "run", precision)
    assert fp32_loss < 1.5  # the task was learnt, so the comparison means something
    assert loss == pytest.approx(fp32_loss, rel=0.1, abs=0.05)
