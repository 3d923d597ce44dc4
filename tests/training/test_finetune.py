"""Fine-tuning (training.init_from, training.freeze): the weights and tokenizer of another run,
a fresh optimiser and schedule, frozen parts that stay exactly as they were, exact resume,
and one-line errors for a model that does not fit the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clirun import nmt, tiny_config, write_config

from nmt import checkpoint
from nmt.training.finetune import PARTS, part_of


@pytest.fixture(scope="module")
def source(corpus: Path) -> Path:
    """The run fine-tuning starts from (a few steps on the reversal task)."""
    config = tiny_config(corpus)
    config["training"].update({"max_steps": 4})
    config["run"] = {"dir": str(corpus / "source"), "device": "cpu", "tensorboard": False}
    result = nmt("train", str(write_config(corpus / "source.yaml", config)), "--quiet")
    assert result.code == 0, result.err
    return corpus / "source"


def _finetune_config(corpus: Path, root: Path, source: Path, **training: object) -> Path:
    config = tiny_config(corpus)
    config["tokenizer"] = {"vocab_size": 60, "type": "unigram"}  # not used: init_from's is
    config["training"].update({"init_from": str(source), "seed": 7, **training})
    config["run"] = {"dir": str(root / "run"), "device": "cpu", "tensorboard": False}
    return write_config(root / "finetune.yaml", config)


def test_frozen_parts_stay_and_the_rest_trains(corpus: Path, source: Path, tmp_path: Path) -> None:
    """Encoder and embeddings frozen: bit for bit the source's; the decoder moved; the
    tokenizer is the source's; step, optimiser and schedule start afresh."""
    path = _finetune_config(corpus, tmp_path, source, max_steps=3, freeze=["encoder", "embeddings"])
    assert nmt("train", str(path), "--quiet").code == 0
    start = checkpoint.load(source / "best.pt")
    tuned = checkpoint.load(tmp_path / "run" / "last.pt")
    moved = set()
    for name, weight in start["model"].items():
        if part_of(name) in ("encoder", "embeddings"):
            assert torch.equal(tuned["model"][name], weight), name
        elif not torch.equal(tuned["model"][name], weight):
            moved.add(part_of(name))
    assert moved == {"decoder", "attention"}
    assert tuned["tokenizer"] == start["tokenizer"]
    assert (tmp_path / "run" / "spm.model").read_bytes() == (source / "spm.model").read_bytes()
    assert tuned["progress"]["step"] == 3  # counted from 0, not from the source's 4
    adam = tuned["optimizer"]["state"]
    assert adam and all(float(s["step"]) == 3 for s in adam.values())  # fresh moments
    trainable = sum(1 for n in start["model"] if part_of(n) in ("decoder", "attention"))
    assert len(adam) == trainable  # frozen parameters are not in the optimiser
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert f"fine-tuning from {source / 'best.pt'} (step 4)" in log


def test_every_parameter_has_a_part() -> None:
    """Every parameter name of the shipped decoders, with and without an alignment head,
    maps to one part (the head's is never frozen: it is not a training.freeze choice)."""
    from nmt.config import from_dict
    from nmt.model import build_model

    for style in ("bahdanau", "luong"):
        for head in (False, True):
            raw = {
                "model": {"decoder": {"style": style}, "alignment_head": head},
                "training": {"guided_alignment": "train.align" if head else None},
            }
            model = build_model(from_dict(raw).model, 9, 9)
            parts = {part_of(name) for name, _ in model.named_parameters()}
            expected = {name for name, _ in PARTS}
            assert parts == (expected if head else expected - {"alignment_head"})


def test_resuming_a_finetuning_run_is_exact(corpus: Path, source: Path, tmp_path: Path) -> None:
    """Stopped at step 2 and resumed to 4 equals 4 steps in one go (same config otherwise)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    config = _finetune_config(corpus, whole, source, max_steps=4, validate_every=2)
    assert nmt("train", str(config), "--quiet").code == 0
    halfway = _finetune_config(corpus, parts, source, max_steps=2, validate_every=2)
    assert nmt("train", str(halfway), "--quiet").code == 0
    resumed = nmt("train", str(halfway), "--quiet", "--resume", "-O", "training.max_steps=4")
    assert resumed.code == 0, resumed.err
    a = checkpoint.load(whole / "run" / "last.pt")
    b = checkpoint.load(parts / "run" / "last.pt")
    assert a["progress"]["step"] == b["progress"]["step"] == 4
    for name, weight in a["model"].items():
        assert torch.equal(b["model"][name], weight), name


def test_a_parameter_of_another_shape_is_one_line(
    corpus: Path, source: Path, tmp_path: Path
) -> None:
    """A decoder size that differs names the parameter; nothing is written."""
    path = _finetune_config(corpus, tmp_path, source, max_steps=1)
    result = nmt("train", str(path), "-O", "model.decoder.hidden_size=12")
    assert "training.init_from" in result.error and "has shape" in result.error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({"init_from": "no/such/run"}, "training.init_from: no/such/run"),
        ({"freeze": ["encoder", "decoder", "attention", "embeddings"]}, "nothing would train"),
        ({"freeze": ["encoders"]}, "training.freeze"),
        ({"accumulate": 0}, "training.accumulate: got 0"),
    ],
)
def test_bad_finetuning_settings(
    corpus: Path, tmp_path: Path, training: dict, expected: str
) -> None:
    """A missing checkpoint, everything frozen, an unknown part: one line, nothing written."""
    config = tiny_config(corpus)
    config["training"].update(training)
    config["run"] = {"dir": str(tmp_path / "run"), "tensorboard": False}
    result = nmt("train", str(write_config(tmp_path / "c.yaml", config)))
    assert expected in result.error
    assert not (tmp_path / "run").exists()


def test_a_run_directory_without_checkpoints_names_the_key(corpus: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    config = tiny_config(corpus)
    config["training"]["init_from"] = str(empty)
    config["run"] = {"dir": str(tmp_path / "run"), "tensorboard": False}
    result = nmt("train", str(write_config(tmp_path / "c.yaml", config)))
    assert result.error.endswith(
        f"{empty}: no best.pt or last.pt in this run directory; train it first or give a "
        f"checkpoint file to training.init_from"
    )
    assert not (tmp_path / "run").exists()
