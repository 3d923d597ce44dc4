"""`nmt average`: the float64 mean of every weight, a normal checkpoint out, and one-line
errors for checkpoints that cannot be averaged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clirun import nmt, tiny_config, write_config

from nmt import checkpoint


@pytest.fixture(scope="module")
def kept(corpus: Path) -> Path:
    """A tiny run that kept three step-N.pt checkpoints (validation every 2 of 6 steps)."""
    config = tiny_config(corpus)
    config["training"].update({"max_steps": 6, "validate_every": 2, "keep_last": 3})
    config["run"] = {"dir": str(corpus / "kept"), "device": "cpu", "tensorboard": False}
    path = write_config(corpus / "kept.yaml", config)
    result = nmt("train", str(path), "--quiet")
    assert result.code == 0, result.err
    return corpus / "kept"


def test_the_average_is_the_float64_mean_of_every_weight(kept: Path, tmp_path: Path) -> None:
    """Each weight of the output equals the mean over the three checkpoints in float64."""
    steps = sorted(kept.glob("step-*.pt"))
    assert len(steps) == 3
    out = tmp_path / "avg.pt"
    result = nmt("average", "--run", str(kept), "--last", "3", "-o", str(out))
    assert result.code == 0, result.err
    averaged = checkpoint.load(out)
    states = [checkpoint.load(p) for p in steps]
    assert states[0]["model"].keys() == averaged["model"].keys()
    differs = 0
    for name, weight in averaged["model"].items():
        mean = sum(s["model"][name].double() for s in states) / 3
        assert weight.dtype == states[0]["model"][name].dtype
        torch.testing.assert_close(weight.double(), mean, rtol=0, atol=1e-7)
        differs += not torch.equal(states[0]["model"][name], states[2]["model"][name])
    assert differs > 0  # the checkpoints do differ: the mean is not any one of them
    assert averaged["config"] == states[2]["config"]  # the newest's config and tokenizer
    for key in ("frequent", "table"):  # and its decoding shortlist
        assert torch.equal(averaged["shortlist"][key], states[2]["shortlist"][key])
    assert [entry["step"] for entry in averaged["averaged_from"]] == [2, 4, 6]


def test_the_average_translates_like_any_checkpoint(kept: Path, tmp_path: Path) -> None:
    """translate and score read the averaged checkpoint; files given directly work too."""
    out = tmp_path / "avg.pt"
    files = [str(p) for p in sorted(kept.glob("step-*.pt"))[:2]]
    assert nmt("average", *files, "-o", str(out)).code == 0
    translated = nmt("translate", "-m", str(out), "--beam", "2", stdin=b"sol luna\n")
    assert translated.code == 0, translated.err
    assert len(translated.out.splitlines()) == 1
    scored = nmt("score", "-m", str(out), stdin=b"sol luna\tLUNA SOL\n")
    assert scored.code == 0, scored.err
    assert float(scored.out.split("\t")[0]) < 0


def test_a_checkpoint_of_another_architecture_is_refused(
    kept: Path, corpus: Path, tmp_path: Path
) -> None:
    """A model config that differs is one line naming both files and the key."""
    config = tiny_config(corpus)
    config["model"]["decoder"] = {**config["model"]["decoder"], "hidden_size": 12}
    config["run"] = {"dir": str(tmp_path / "other"), "device": "cpu", "tensorboard": False}
    path = write_config(tmp_path / "other.yaml", config)
    assert nmt("train", str(path), "--quiet").code == 0
    out = tmp_path / "avg.pt"
    result = nmt("average", str(kept / "last.pt"), str(tmp_path / "other"), "-o", str(out))
    assert "model.decoder" in result.error and str(kept / "last.pt") in result.error
    assert not out.exists()


def test_too_few_checkpoints_and_writing_onto_one(kept: Path, tmp_path: Path) -> None:
    """--last beyond what the run kept, one checkpoint, and an output onto an input: one
    line each, nothing written."""
    assert "kept 3" in nmt("average", "--run", str(kept), "--last", "4", "-o", "x.pt").error
    assert "at least two" in nmt("average", str(kept / "last.pt"), "-o", "x.pt").error
    alone = nmt("average", "--run", str(kept), "-o", "x.pt").error
    assert alone == "error: --run needs --last N: --run RUN --last N averages a run's newest N"
    assert "--last needs --run RUN" in nmt("average", "--last", "2", "-o", "x.pt").error
    both = nmt("average", str(kept / "last.pt"), "--run", str(kept), "--last", "2", "-o", "x.pt")
    assert "not both" in both.error
    missing = nmt("average", "no/such.pt", str(kept / "last.pt"), "-o", "x.pt").error
    assert "no/such.pt" in missing and "nmt average" in missing
    step = sorted(kept.glob("step-*.pt"))[0]
    before = step.read_bytes()
    result = nmt("average", str(step), str(kept / "last.pt"), "-o", str(step))
    assert "--output" in result.error and step.read_bytes() == before
    assert not Path("x.pt").exists()


def test_a_save_interval_keeps_checkpoints_between_validations(
    corpus: Path, tmp_path: Path
) -> None:
    """save_every 2 with validations every 4: step-N.pt at 2, 4 and 6, the last three."""
    config = tiny_config(corpus)
    config["training"].update(
        {"max_steps": 6, "validate_every": 4, "save_every": 2, "keep_last": 3}
    )
    config["run"] = {"dir": str(tmp_path / "run"), "device": "cpu", "tensorboard": False}
    assert nmt("train", str(write_config(tmp_path / "c.yaml", config)), "--quiet").code == 0
    names = sorted(p.name for p in (tmp_path / "run").glob("step-*.pt"))
    assert names == ["step-00000002.pt", "step-00000004.pt", "step-00000006.pt"]
    out = tmp_path / "avg.pt"
    assert nmt("average", "--run", str(tmp_path / "run"), "--last", "3", "-o", str(out)).code == 0
    steps = [entry["step"] for entry in checkpoint.load(out)["averaged_from"]]
    assert steps == [2, 4, 6]
