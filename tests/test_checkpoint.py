"""The checkpoint loader's checks of what a checkpoint holds, through every command that loads
one: a checkpoint is untrusted input, and what does not hold is one line naming the file and
the entry, exit status 2."""

from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from clirun import nmt, nmt_process, tiny_config, write_config

import nmt as api
from nmt import checkpoint
from nmt.errors import CheckpointError


def _edited(run: Path, path: Path, model: Any) -> Path:
    """The run's best.pt with its ``model`` entry replaced."""
    state = checkpoint.load(run / "best.pt")
    state["model"] = model
    torch.save(state, path)
    return path


def _one_weight(run: Path, value: Any) -> dict[str, Any]:
    """The run's weights with the first replaced by ``value``."""
    weights = dict(checkpoint.load(run / "best.pt")["model"])
    weights[next(iter(weights))] = value
    return weights


def _commands(path: Path, out: Path) -> dict[str, tuple[list[str], bytes]]:
    """Every command that loads a checkpoint, as a user types it, and its stdin."""
    model, pair = str(path), b"sol luna\tLUNA SOL\n"
    return {
        "translate": (["translate", "-m", model], b"sol luna\n"),
        "score": (["score", "-m", model], pair),
        "align": (["align", "-m", model], pair),
        "eval": (["eval", "--model", model, "--split", "test"], b""),
        "average": (["average", model, model, "-o", str(out)], b""),
        "export": (["export", model, "-o", str(out)], b""),
        "shortlist": (["shortlist", model], b""),
        "serve": (["serve", "-m", model, "--port", "0"], b""),
    }


@pytest.mark.parametrize("model", [[1, 2], None, torch.zeros(3)], ids=["list", "none", "tensor"])
def test_a_model_entry_that_is_not_weights_is_one_line(
    tmp_path: Path, run: Path, model: Any
) -> None:
    edited = _edited(run, tmp_path / "edited.pt", model)
    error = nmt("translate", "-m", str(edited), stdin=b"sol luna\n").error
    assert error.startswith(f"error: {edited}: its model entry is a {type(model).__name__}, not")


def test_a_weight_that_is_not_a_tensor_is_named(tmp_path: Path, run: Path) -> None:
    weights = _one_weight(run, "not a tensor")
    edited = _edited(run, tmp_path / "edited.pt", weights)
    error = nmt("translate", "-m", str(edited), stdin=b"sol luna\n").error
    assert error.startswith(f"error: {edited}: its model entry {next(iter(weights))!r} is a str")


@pytest.mark.parametrize("command", list(_commands(Path(), Path())))
def test_every_command_that_loads_a_checkpoint_checks_its_weights(
    tmp_path: Path, run: Path, command: str
) -> None:
    edited = _edited(run, tmp_path / "edited.pt", [1, 2])
    args, stdin = _commands(edited, tmp_path / "out")[command]
    assert nmt(*args, stdin=stdin).error.startswith(f"error: {edited}: its model entry is a list")
    assert not (tmp_path / "out").exists()


def test_the_python_api_checks_the_weights(tmp_path: Path, run: Path) -> None:
    edited = _edited(run, tmp_path / "edited.pt", None)
    with pytest.raises(CheckpointError, match="its model entry is a NoneType"):
        api.load(edited)


def _non_finite(run: Path, path: Path, value: float) -> tuple[Path, str]:
    """The run's last.pt with one element of one weight set to ``value``; returns the file
    and the weight's name."""
    state = checkpoint.load(run / "last.pt")
    name = sorted(state["model"])[2]
    state["model"][name] = state["model"][name].clone()
    state["model"][name].view(-1)[1] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path, name


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_is_refused_naming_it(tmp_path: Path, run: Path, value: float) -> None:
    """It used to translate every line to an empty line, exit status 0."""
    damaged, name = _non_finite(run, tmp_path / "damaged.pt", value)
    error = nmt("translate", "-m", str(damaged), stdin=b"sol luna\n").error
    assert error.startswith(f"error: {damaged}: its weight {name} holds NaN or infinite values")
    assert "(damaged or diverged training)" in error


def test_a_non_finite_weight_is_not_averaged(tmp_path: Path, run: Path) -> None:
    damaged, name = _non_finite(run, tmp_path / "damaged.pt", math.nan)
    out = tmp_path / "averaged.pt"
    error = nmt("average", str(run / "best.pt"), str(damaged), "-o", str(out)).error
    assert error.startswith(f"error: {damaged}: its weight {name} holds NaN")
    assert not out.exists()


def test_training_does_not_resume_from_non_finite_weights(tmp_path: Path, run: Path) -> None:
    shutil.copytree(run, tmp_path / "run")
    damaged, name = _non_finite(run, tmp_path / "run" / "last.pt", math.nan)
    config = write_config(tmp_path / "c.yaml", tiny_config(run.parent))
    result = nmt("train", str(config), "--run-dir", str(tmp_path / "run"), "--resume", "-q")
    assert result.error.startswith(f"error: {damaged}: its weight {name} holds NaN")


def test_finite_half_precision_weights_whose_sum_overflows_load(tmp_path: Path) -> None:
    """A sum is the fast check; a float16 sum of finite weights overflows to inf."""
    weights = {"big": torch.full((100,), 60000.0, dtype=torch.float16)}
    checkpoint.save(tmp_path / "half.pt", {"model": weights, "config": {}, "tokenizer": {}})
    assert checkpoint.load(tmp_path / "half.pt")["model"]["big"].sum().isinf()


def test_a_plain_pickle_is_one_line_without_torchs_warning(tmp_path: Path) -> None:
    """In a fresh interpreter, as a user runs it: torch warned of the pickle protocol first."""
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"model": [1, 2]}, protocol=4))
    result = nmt_process("translate", "-m", str(plain), input="sol luna\n")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {plain}: not a checkpoint (not the archive torch.save writes); give a run "
        f"directory or one of its best.pt, last.pt, step-*.pt"
    ]


def test_a_file_that_is_no_archive_is_not_a_checkpoint(tmp_path: Path, run: Path) -> None:
    """A text file is not a checkpoint; a checkpoint cut short still starts as one (the zip
    archive torch.save writes), so it is a damaged one."""
    text = tmp_path / "notes.pt"
    text.write_text("a checkpoint, honest\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"notes.pt: not a checkpoint \(not the archive"):
        checkpoint.load(text)
    cut = tmp_path / "cut.pt"
    cut.write_bytes((run / "last.pt").read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=r"cut.pt: cannot read checkpoint .* truncated"):
        checkpoint.load(cut)
