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


def _config(corpus: Path, run_dir: Path, model: dict, **training: object) -> dict:
    return {
        "data": data_section(corpus, test=True),
        "tokenizer": {"vocab_size": 60, "type": "bpe"},
        "model": model,
        "training": {"epochs": 1, "batch_tokens": 1000, "validate_every": 20, **training},
        "run": {"dir": str(run_dir), "device": "cuda"},
    }


BAHDANAU = {
    "embedding_size": 32,
    "encoder": {"hidden_size": 32},
    "decoder": {"style": "bahdanau", "hidden_size": 32},
    "attention": {"score": "additive"},
}
LSTM = {
    "embedding_size": 32,
    "encoder": {"rnn": "lstm", "hidden_size": 16, "layers": 2},
    "decoder": {"style": "luong", "rnn": "lstm", "hidden_size": 32, "layers": 2},
    "attention": {"score": "dot"},
}


@pytest.mark.parametrize("model", [BAHDANAU, LSTM], ids=["bahdanau", "lstm"])
def test_auto_precision_trains_the_default_decoder_and_an_lstm(
    corpus: Path, tmp_path: Path, model: dict
) -> None:
    """precision: auto is bf16 on a GPU that supports it: the RNNs then run outside autocast
    (nmt.fast.recurrence.RNN_OUTSIDE_AUTOCAST) and the loss stays finite and falls."""
    run_dir = tmp_path / "run"
    train(from_dict(_config(corpus, run_dir, model, precision="auto", log_every=5)), quiet=True)
    losses = [r["loss"] for r in read_metrics(run_dir) if r["split"] == "train"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_beam_translate_with_attention_on_the_gpu(corpus: Path, tmp_path: Path) -> None:
    """Beam search keeps each hypothesis's attention on the GPU; the command writes it."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    train(from_dict(_config(corpus, run_dir, BAHDANAU)), quiet=True)
    out, plots = tmp_path / "out.txt", tmp_path / "plots"
    command = [sys.executable, "-m", "nmt", "translate", "--model", str(run_dir), "--beam", "3"]
    command += ["-i", str(corpus / "dev.src"), "-o", str(out), "--attention-dir", str(plots)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = (corpus / "dev.src").read_text(encoding="utf-8").splitlines()
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(lines)
    assert len(list(plots.glob("*.npy"))) == len(lines)


def test_resume_on_the_gpu_is_exact(corpus: Path, tmp_path: Path) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(from_dict(_config(corpus, whole, BAHDANAU, max_steps=40)), quiet=True)
    train(from_dict(_config(corpus, parts, BAHDANAU, max_steps=20)), quiet=True)
    train(from_dict(_config(corpus, parts, BAHDANAU, max_steps=40)), quiet=True, resume=True)
    first, second = read_metrics(whole), read_metrics(parts)
    assert [r["loss"] for r in first if "loss" in r] == [r["loss"] for r in second if "loss" in r]


@pytest.mark.slow
def test_bf16_reaches_fp32s_dev_loss_where_fp16s_range_matters(
    corpus: Path, tmp_path: Path
) -> None:
    """A model and batches large enough that gradients scaled by 1 / target tokens fall
    near fp16's smallest normal numbers: bf16 autocast (RNNs outside it) keeps fp32's loss."""
    model = {
        "embedding_size": 256,
        "encoder": {"hidden_size": 512, "layers": 2},
        "decoder": {"style": "bahdanau", "hidden_size": 512},
        "attention": {"score": "additive"},
    }
    losses = {}
    for precision in ("fp32", "bf16"):
        run_dir = tmp_path / precision
        raw = _config(corpus, run_dir, model, precision=precision, epochs=2, batch_tokens=8000)
        train(from_dict(raw), quiet=True)
        losses[precision] = [r for r in read_metrics(run_dir) if r["split"] == "dev"][-1]["loss"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_process_nccl_run(corpus: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    run_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(corpus, run_dir, BAHDANAU, max_steps=20)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, "-m", "nmt", "train", str(config), "-q"], text=True)
    assert done.returncode == 0
    assert (run_dir / "last.pt").is_file()
