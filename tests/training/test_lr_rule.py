"""training.lr_reference_tokens: the square-root rule for Adam's rate when an update holds
more (or fewer) tokens than the rate was chosen for, lr * sqrt(N / R), N = batch_tokens x
accumulate x processes; and a run that logs and trains at the scaled rate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from synthetic import data_section, luong_model_section, write_corpus

from nmt.config import from_dict
from nmt.training import train
from nmt.training.schedule import Schedule, peak_rate


def _training(**keys: object):
    return from_dict({"training": keys}).training


@pytest.mark.parametrize(
    ("tokens", "accumulate", "processes", "reference"),
    [(4000, 1, 1, 4000), (16000, 1, 1, 4000), (4000, 2, 4, 2000), (1000, 1, 1, 4000)],
)
def test_the_rate_scales_with_the_square_root_of_the_tokens(
    tokens: int, accumulate: int, processes: int, reference: int
) -> None:
    cfg = _training(
        learning_rate=3e-4,
        batch_tokens=tokens,
        accumulate=accumulate,
        lr_reference_tokens=reference,
    )
    want = 3e-4 * math.sqrt(tokens * accumulate * processes / reference)
    assert peak_rate(cfg, processes) == pytest.approx(want, rel=1e-15)
    schedule = Schedule.from_config(cfg, processes)
    assert schedule.base_lr == pytest.approx(want, rel=1e-15)


def test_without_a_reference_the_rate_is_as_given() -> None:
    cfg = _training(learning_rate=3e-4, batch_tokens=16000, accumulate=4)
    assert peak_rate(cfg, 8) == 3e-4 and Schedule.from_config(cfg, 8).base_lr == 3e-4


def test_a_run_trains_at_the_scaled_rate(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus, {"train": 200, "dev": 8})
    config = from_dict(
        {
            "data": data_section(corpus),
            "tokenizer": {"vocab_size": 40, "type": "bpe"},
            "model": luong_model_section(),
            "training": {
                "batch_tokens": 400,
                "lr_reference_tokens": 100,
                "learning_rate": 1e-3,
                "schedule": "constant",
                "warmup_steps": 0,
                "max_steps": 4,
                "log_every": 1,
                "validate_every": 100,
            },
            "run": {"dir": str(tmp_path / "run"), "device": "cpu", "tensorboard": False},
        }
    )
    run_dir = train(config, quiet=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["lr"] for row in rows if row.get("split") == "train"]
    assert rates and all(rate == pytest.approx(2e-3, rel=1e-12) for rate in rates)
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "learning rate 0.001 at 100 tokens an update" in log
    assert "0.002 at this run's 400: x sqrt(400 / 100)" in log
