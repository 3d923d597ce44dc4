"""The training engine: exact resume, fp16 loss scaling, non-finite losses, schedules,
checkpoints, run info and out-of-memory handling, on a tiny word-reversal corpus on CPU."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from clirun import nmt
from faultinject import nan_losses
from runs import read_metrics
from synthetic import data_section, luong_model_section, write_corpus

import nmt.training.loop as train_module
import nmt.training.step as step_module
from nmt import __version__, checkpoint
from nmt.config import from_dict, to_yaml
from nmt.data.batching import bucket_batches, make_batch
from nmt.data.prepare import load_corpora
from nmt.errors import ConfigError, NMTError
from nmt.model import Seq2Seq, build_model
from nmt.training import train
from nmt.training.loop import MAX_BAD_STEPS
from nmt.training.rundir import project_commit
from nmt.training.schedule import Progress, Schedule, record_validation
from nmt.training.step import TrainingLoss, apply_update, forward_backward

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 training pairs (33 batches of at most 200 padded tokens), 8 dev pairs."""
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, {"train": 300, "dev": 8})
    return root


def raw_config(
    corpus: Path, run_dir: Path, tensorboard: bool = False, **training: Any
) -> dict[str, Any]:
    """A 9k-parameter Luong model with dropout, so that resume must restore the RNG, without
    input feeding (faster); without tensorboard (its heatmaps are most of a validation's time
    here) unless asked."""
    return {
        "data": data_section(corpus),
        "tokenizer": {"vocab_size": 40, "type": "bpe"},
        "model": luong_model_section(input_feeding=False),
        "training": {
            "epochs": 3,
            "batch_tokens": 200,
            "validate_every": 5,
            "log_every": 5,
            **training,
        },
        "decoding": {"max_len_offset": 3, "max_len_ratio": 1.0},
        "run": {"dir": str(run_dir), "device": "cpu", "tensorboard": tensorboard},
    }


def run_training(
    corpus: Path, run_dir: Path, resume: bool = False, tensorboard: bool = False, **training: Any
) -> Path:
    config = from_dict(raw_config(corpus, run_dir, tensorboard, **training))
    return train(config, resume=resume, quiet=True)


def saved(path: Path) -> dict[str, Any]:
    return checkpoint.load(path)


def dev_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r["split"] == "dev"]


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r["split"] == "train"]


def history(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without what depends on the clock."""
    drop = ("time", "target_tokens_per_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run_dir)]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """The same last and best checkpoints, and the same logged history."""
    for name in ("last.pt", "best.pt"):
        assert_same_weights(saved(run_dir / name)["model"], saved(reference / name)["model"])
    assert history(run_dir) == history(reference)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ: {different}"


# ----------------------------------------------------------------------------- exact resume


def start(config_path: Path, *args: str, log: Path) -> subprocess.Popen:
    with log.open("a") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "nmt", "train", str(config_path), "--quiet", *args],
            stdout=handle,
            stderr=handle,
        )


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, f"training ended first:\n{log.read_text()}"
        assert time.time() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.01)


# 66 steps, a checkpoint every 20, log lines every 7: windows that straddle the checkpoints
RESUME = {"epochs": 2, "validate_every": 20, "log_every": 7}


def write_config(corpus: Path, root: Path) -> Path:
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(raw_config(corpus, root / "run", **RESUME)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same config trained in one go (in this process, also one thread)."""
    return run_training(corpus, tmp_path_factory.mktemp("uninterrupted") / "run", **RESUME)


def test_resume_after_sigkill_equals_an_uninterrupted_run(
    corpus: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    config, log = write_config(corpus, tmp_path), tmp_path / "out.log"
    run_dir = tmp_path / "run"
    process = start(config, log=log)
    wait_for(run_dir / "last.pt", process, log)
    assert process.poll() is None, "the run finished before it could be killed"
    process.kill()  # SIGKILL: no chance to save; resume from the last validation's checkpoint
    process.wait()
    killed_at = saved(run_dir / "last.pt")["progress"]["step"]
    final = saved(uninterrupted / "last.pt")
    assert 0 < killed_at < final["progress"]["step"]

    resumed = nmt("train", str(config), "--quiet", "--resume")  # in this process
    assert resumed.code == 0, resumed.err
    result = saved(run_dir / "last.pt")
    assert result["progress"]["step"] == final["progress"]["step"] == 66
    assert_same_weights(result["model"], final["model"])
    assert (run_dir / "spm.model").read_bytes() == (uninterrupted / "spm.model").read_bytes()
    for key in ("frequent", "table"):  # the decoding shortlist, as the checkpoint carried it
        assert torch.equal(result["shortlist"][key], final["shortlist"][key])
    assert f"resuming from {run_dir / 'last.pt'} (step {killed_at})" in (
        run_dir / "train.log"
    ).read_text(encoding="utf-8")
    assert_same_run(run_dir, uninterrupted)  # the killed run's later records are gone


def test_resume_after_sigterm_equals_an_uninterrupted_run(
    corpus: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    config, log = write_config(corpus, tmp_path), tmp_path / "out.log"
    run_dir = tmp_path / "run"
    process = start(config, log=log)
    wait_for(run_dir / "last.pt", process, log)
    process.send_signal(signal.SIGTERM)  # saves at the next step boundary, exits 130
    assert process.wait(timeout=120) == 130, log.read_text()
    stopped_at = saved(run_dir / "last.pt")["progress"]["step"]
    assert 20 < stopped_at < 66  # saved at the signal, between validations
    train_log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"stopped by signal {int(signal.SIGTERM)} at step {stopped_at}" in train_log

    run_training(corpus, run_dir, resume=True, **RESUME)  # the same as --resume, in-process
    final = saved(uninterrupted / "last.pt")
    result = saved(run_dir / "last.pt")
    assert result["progress"]["step"] == final["progress"]["step"]
    assert_same_weights(result["model"], final["model"])
    assert_same_weights(result["optimizer"]["state"][0], final["optimizer"]["state"][0])
    assert_same_run(run_dir, uninterrupted)


def test_a_crash_between_best_and_last_leaves_no_stale_best(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed right after best.pt is written at an improving validation (dev loss, which
    improves at every validation here): the resumed run makes that validation again, so
    best.pt ends as the uninterrupted run's."""
    import nmt.training.resume as resume_module

    options = {**RESUME, "best_metric": "loss"}
    reference = run_training(corpus, tmp_path / "uninterrupted", **options)
    real_save, written = resume_module.checkpoint.save, []

    class Killed(BaseException):
        pass

    def save(path: Path, state: dict[str, Any]) -> None:
        written.append(path.name)
        if written[-2:] == ["best.pt", "last.pt"] and state["progress"]["step"] >= 40:
            raise Killed  # an improving validation's best.pt is written, its last.pt is not
        real_save(path, state)

    run_dir = tmp_path / "run"
    monkeypatch.setattr(resume_module.checkpoint, "save", save)
    with pytest.raises(Killed):
        run_training(corpus, run_dir, **options)
    monkeypatch.setattr(resume_module.checkpoint, "save", real_save)
    behind = saved(run_dir / "last.pt")["progress"]["step"]
    assert saved(run_dir / "best.pt")["progress"]["step"] > behind  # best went first
    run_training(corpus, run_dir, resume=True, **options)
    assert_same_run(run_dir, reference)


def test_a_signal_on_a_validation_step_still_resumes_exactly(
    corpus: Path, uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal arrives during step 40, which is also due for validation: the run validates
    (as the uninterrupted run did), then saves and stops."""
    flags: list[Any] = []
    enter = step_module.StopFlag.__enter__

    def remember(self: Any) -> Any:
        flags.append(self)
        return enter(self)

    monkeypatch.setattr(step_module.StopFlag, "__enter__", remember)
    real_loss, calls = Seq2Seq.loss, [0]

    def loss(self: Seq2Seq, *tensors: Any, **options: Any) -> Any:
        calls[0] += self.training
        if calls[0] == 40 and self.training:
            flags[-1].signal = signal.SIGTERM  # what the handler does
        return real_loss(self, *tensors, **options)

    monkeypatch.setattr(Seq2Seq, "loss", loss)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_training(corpus, run_dir, **RESUME)
    state = saved(run_dir / "last.pt")
    assert state["progress"]["step"] == 40
    assert [h["step"] for h in state["progress"]["history"]] == [20, 40]
    monkeypatch.undo()
    run_training(corpus, run_dir, resume=True, **RESUME)
    final = saved(uninterrupted / "last.pt")
    assert_same_weights(saved(run_dir / "last.pt")["model"], final["model"])
    assert saved(run_dir / "last.pt")["progress"]["history"] == final["progress"]["history"]


# ----------------------------------------------------------------------------- fp16


def tiny_model(dropout: float = 0.0) -> Seq2Seq:
    torch.manual_seed(0)
    cfg = from_dict(
        {
            "model": {
                "embedding_size": 8,
                "embedding_dropout": dropout,
                "encoder": {"hidden_size": 8, "dropout": dropout},
                "decoder": {"style": "luong", "hidden_size": 8, "dropout": dropout},
                "attention": {"score": "general"},
            }
        }
    )
    return build_model(cfg.model, 14, 14)


def reverse_batch(sentences: int, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    src, trg = [], []
    for _ in range(sentences):
        seq = rng.integers(4, 14, size=int(rng.integers(2, 7))).tolist()
        src.append([*seq, 3])
        trg.append(seq[::-1])
    return make_batch(src, trg, np.arange(sentences))


def test_fp16_overflow_skips_the_update_and_lowers_the_scale() -> None:
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batch = reverse_batch(4)
    loss = TrainingLoss(model, 0.1)
    forward_backward(loss, batch, 1 / batch.n_target_tokens, CPU, "fp16", scaler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.generator.weight.grad[0, 0] = math.inf  # a gradient that overflowed fp16

    _, applied = apply_update(model, optimizer, scaler, 1.0)
    assert not applied
    assert_same_weights(model.state_dict(), before)
    assert optimizer.state_dict()["state"] == {}  # Adam took no step
    assert scaler.get_scale() == 512.0

    optimizer.zero_grad()
    forward_backward(loss, batch, 1 / batch.n_target_tokens, CPU, "fp16", scaler)
    _, applied = apply_update(model, optimizer, scaler, 1.0)
    assert applied
    assert not torch.equal(model.generator.weight, before["generator.weight"])
    assert int(optimizer.state_dict()["state"][0]["step"]) == 1
    assert scaler.get_scale() == 512.0


def test_fp16_overflows_are_counted_and_do_not_stop_training(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a loss scale of 2^40 the fp16 gradients overflow for many steps in a row (more
    than the divergence limit), each halving the scale, before training proceeds."""
    monkeypatch.setattr(step_module, "INITIAL_LOSS_SCALE", 2.0**40)
    run_dir = run_training(corpus, tmp_path / "run", precision="fp16", max_steps=10)
    state = saved(run_dir / "last.pt")
    progress = state["progress"]
    assert progress["step"] == 10
    assert progress["overflow_steps"] == progress["skipped_steps"] > MAX_BAD_STEPS
    assert state["scaler"]["scale"] == 2.0 ** (40 - progress["overflow_steps"])
    assert all(torch.isfinite(w).all() for w in state["model"].values())
    records = train_records(run_dir)
    assert records[-1]["skipped_steps"] == progress["skipped_steps"]
    assert records[-1]["loss_scale"] == state["scaler"]["scale"]
    text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "fp16 gradients overflowed, update skipped" in text
    assert f"skipped {progress['skipped_steps']} ({progress['skipped_steps']} fp16 overflow)" in (
        text
    )
    info = json.loads((run_dir / "environment.json").read_text())
    assert info["precision"] == "fp16" and info["device"] == "cpu"


# ----------------------------------------------------------------------------- non-finite losses


def test_a_single_nan_loss_is_skipped(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_losses(monkeypatch, {3})
    run_dir = run_training(corpus, tmp_path / "run", max_steps=12)
    progress = saved(run_dir / "last.pt")["progress"]
    assert progress["step"] == 12
    assert progress["skipped_steps"] == 1 and progress["overflow_steps"] == 0
    assert progress["bad_steps_in_a_row"] == 0
    assert progress["batch_in_epoch"] == 13  # the bad batch was used up, not retried
    text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "step 3: non-finite loss or gradient, update skipped" in text


def test_nan_losses_in_a_row_stop_training_and_keep_the_last_good_checkpoint(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_losses(monkeypatch, range(13, 1000))
    with pytest.raises(NMTError, match=f"training diverged: {MAX_BAD_STEPS} non-finite steps"):
        run_training(corpus, tmp_path / "run", max_steps=30)
    state = saved(tmp_path / "run" / "last.pt")
    assert state["progress"]["step"] == 10  # the validation before the NaNs; not overwritten
    assert all(torch.isfinite(w).all() for w in state["model"].values())


# ----------------------------------------------------------------------------- schedules


def test_warmup_and_inverse_sqrt_follow_their_formulas() -> None:
    progress = Progress()
    warmup = Schedule("warmup", 2e-3, 100, 2)
    for step in (1, 50, 99):
        assert warmup.lr(step, progress) == pytest.approx(2e-3 * step / 100)
    for step in (100, 101, 5000):
        assert warmup.lr(step, progress) == pytest.approx(2e-3)
    inverse = Schedule("inverse_sqrt", 2e-3, 100, 2)
    assert inverse.lr(10, progress) == pytest.approx(2e-3 * 10 / 100)
    for step in (100, 400, 10_000):
        assert inverse.lr(step, progress) == pytest.approx(2e-3 * math.sqrt(100 / step))
    assert Schedule("inverse_sqrt", 1.0, 0, 2).lr(16, progress) == pytest.approx(0.25)
    assert Schedule("constant", 2e-3, 0, 2).lr(1, progress) == 2e-3
    progress.lr_scale = 0.5
    assert Schedule("plateau", 2e-3, 10, 2).lr(5, progress) == pytest.approx(0.5e-3)


def test_linear_and_cosine_decay_to_zero_at_max_steps() -> None:
    progress = Progress()
    linear = Schedule("linear", 2e-3, 10, 2, total=110)
    cosine = Schedule("cosine", 2e-3, 10, 2, total=110)
    for schedule in (linear, cosine):
        assert schedule.lr(5, progress) == pytest.approx(2e-3 * 5 / 10)  # the warmup
        assert schedule.lr(11, progress) == pytest.approx(2e-3)  # the first decaying update
    for step in (11, 35, 60, 85, 110):
        done = (step - 11) / 100
        assert linear.lr(step, progress) == pytest.approx(2e-3 * (1 - done))
        assert cosine.lr(step, progress) == pytest.approx(2e-3 * (1 + math.cos(math.pi * done)) / 2)
    assert 0 < linear.lr(110, progress) < linear.lr(109, progress)  # the last update still moves
    assert linear.lr(111, progress) == cosine.lr(500, progress) == 0.0
    assert cosine.lr(61, progress) == pytest.approx(1e-3)  # half-way: half the rate
    with pytest.raises(ValueError):
        Schedule("cosine", 1e-3, 10, 2, total=10)


def test_decay_over_minutes_follows_the_clock_and_the_nearer_budget() -> None:
    progress = Progress()
    cosine = Schedule("cosine", 2e-3, 0, 2, minutes=10.0)
    linear = Schedule("linear", 2e-3, 0, 2, minutes=10.0)
    for minutes in (0.0, 2.5, 5.0, 9.0):
        progress.minutes = minutes
        for step in (1, 100, 10_000):  # the step does not count without max_steps
            assert cosine.lr(step, progress) == pytest.approx(
                2e-3 * (1 + math.cos(math.pi * minutes / 10)) / 2
            )
            assert linear.lr(step, progress) == pytest.approx(2e-3 * (1 - minutes / 10))
    progress.minutes = 12.0
    assert cosine.lr(5, progress) == linear.lr(5, progress) == 0.0
    both = Schedule("linear", 2e-3, 0, 2, total=100, minutes=10.0)
    progress.minutes = 2.0  # 20% of the clock, 50% of the updates at step 51
    assert both.lr(51, progress) == pytest.approx(1e-3)
    progress.minutes = 8.0  # 80% of the clock
    assert both.lr(51, progress) == pytest.approx(2e-3 * 0.2)
    progress.minutes = 0.0
    warm = Schedule("linear", 2e-3, 10, 2, minutes=10.0)  # the warmup is still in updates
    assert warm.lr(5, progress) == pytest.approx(1e-3)


def test_a_held_decay_keeps_the_full_rate_then_decays_over_the_rest() -> None:
    progress = Progress()
    held = Schedule("linear", 2e-3, 0, 2, total=100, hold=0.8)
    for step in (1, 41, 81):  # p = 0, 0.4, 0.8: held
        assert held.lr(step, progress) == 2e-3
    for step in (86, 91, 96):  # p = 0.85, 0.9, 0.95: a quarter, half, three quarters decayed
        done = ((step - 1) / 100 - 0.8) / 0.2
        assert held.lr(step, progress) == pytest.approx(2e-3 * (1 - done))
    timed = Schedule("cosine", 2e-3, 0, 2, minutes=10.0, hold=0.5)
    progress.minutes = 4.0
    assert timed.lr(1, progress) == 2e-3
    progress.minutes = 7.5  # half-way through the decay: half the rate
    assert timed.lr(1, progress) == pytest.approx(1e-3)
    progress.minutes = 10.0
    assert timed.lr(1, progress) == 0.0


def test_decay_hold_needs_a_decaying_schedule() -> None:
    with pytest.raises(ConfigError) as info:
        from_dict({"training": {"schedule": "plateau", "decay_hold": 0.8}})
    assert str(info.value) == (
        "config: training.decay_hold: only the linear and cosine schedules decay; schedule is "
        "plateau"
    )
    with pytest.raises(ConfigError):
        from_dict({"training": {"schedule": "cosine", "max_steps": 10, "decay_hold": 1.0}})
    held = from_dict({"training": {"schedule": "cosine", "max_minutes": 5, "decay_hold": 0.8}})
    assert held.training.decay_hold == 0.8


def test_decay_over_epochs_ends_with_the_last_epoch_or_max_steps() -> None:
    """Without max_steps the updates' budget is epochs times the epoch's updates; with both,
    the nearer end; the clock still counts when it runs out first."""
    progress = Progress()
    epochs = Schedule("linear", 2e-3, 10, 2, epochs=4)
    assert epochs.lr(50, progress) == 2e-3  # no epoch under way yet: nothing to decay over
    epochs.epoch_updates = 25  # 100 updates in all
    for step in (11, 35, 60, 100):
        assert epochs.lr(step, progress) == pytest.approx(2e-3 * (1 - (step - 11) / 90))
    both = Schedule("cosine", 2e-3, 0, 2, total=60, epochs=4)
    both.epoch_updates = 25
    assert both.updates() == 60
    both.epoch_updates = 10  # a shorter epoch (another segmentation, say): 40 updates
    assert both.updates() == 40
    assert both.lr(21, progress) == pytest.approx(1e-3)  # half-way through 40
    timed = Schedule("linear", 2e-3, 0, 2, minutes=10.0, epochs=4)
    timed.epoch_updates = 100
    progress.minutes = 5.0  # half the clock, a tenth of the updates
    assert timed.lr(41, progress) == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        Schedule("cosine", 1e-3, 10, 2, total=10)


def test_decay_schedules_take_any_budget() -> None:
    """linear and cosine decay over epochs when neither max_steps nor max_minutes is set."""
    plain = from_dict({"training": {"schedule": "cosine", "warmup_steps": 100, "epochs": 3}})
    assert plain.training.max_steps is None and plain.training.max_minutes is None
    assert from_dict({"training": {"schedule": "linear", "max_steps": 51}}).training.max_steps
    timed = from_dict({"training": {"schedule": "cosine", "max_minutes": 0.5}})
    assert timed.training.max_minutes == 0.5


def test_a_decay_over_epochs_reaches_zero_at_the_last_epoch(corpus: Path, tmp_path: Path) -> None:
    """schedule linear with only epochs: the logged rate falls by the same step every update
    and the last update of the last epoch has the smallest positive rate."""
    run_dir = tmp_path / "run"
    run_training(
        corpus,
        run_dir,
        schedule="linear",
        epochs=2,
        log_every=1,
        max_steps=None,
        validate_every=100,
    )
    records = train_records(run_dir)
    steps, rates = [r["step"] for r in records], [r["lr"] for r in records]
    total = steps[-1]
    assert total > 10
    for step, rate in zip(steps, rates, strict=True):
        assert rate == pytest.approx(1e-3 * (1 - (step - 1) / total))
    assert 0 < rates[-1] < rates[-2]


def test_a_time_budget_decays_the_rate_and_counts_over_resume(corpus: Path, tmp_path: Path) -> None:
    """With schedule cosine and max_minutes, the logged rate falls with the clock or the
    epoch, whichever is further on, the checkpoint records the minutes used, and --resume
    counts them against the budget."""
    run_dir = tmp_path / "run"
    budget = 30.0
    run_training(corpus, run_dir, schedule="cosine", max_minutes=budget, log_every=1, epochs=1)
    rates = [r["lr"] for r in train_records(run_dir)]
    assert len(rates) > 10
    assert rates[0] == 1e-3  # no update made yet: no time counted
    assert all(0 < later < earlier for earlier, later in zip(rates, rates[1:], strict=False))
    used = saved(run_dir / "last.pt")["progress"]["minutes"]
    assert 0 < used < budget
    steps = [r["step"] for r in train_records(run_dir)]  # one epoch: steps[-1] updates
    done = max(used / budget, (steps[-1] - 1) / steps[-1])
    expected = 1e-3 * (1 + math.cos(math.pi * done)) / 2
    assert rates[-1] == pytest.approx(expected, rel=1e-3)  # the last update's
    # a budget the run has already used up: the resumed run stops after its first update
    before = saved(run_dir / "last.pt")["progress"]["step"]
    run_training(corpus, run_dir, resume=True, schedule="cosine", max_minutes=used, log_every=1)
    assert saved(run_dir / "last.pt")["progress"]["step"] == before + 1
    log_text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "training.max_minutes reached" in log_text.split("resuming from")[-1]


def test_plateau_halves_after_patience_validations_without_improvement() -> None:
    schedule = Schedule("plateau", 1e-3, 0, 2)
    progress = Progress()
    scales = []
    for step, loss in enumerate([3.0, 3.1, 3.2, 2.9, 3.0, 3.0, 3.0, 3.0], start=1):
        progress.step = step
        record_validation(progress, {"loss": loss}, "loss", schedule)
        scales.append(progress.lr_scale)
    assert scales == [1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125]
    assert progress.best_score == 2.9 and progress.bad_validations == 4
    assert [h["step"] for h in progress.history] == list(range(1, 9))


def test_plateau_halving_and_early_stopping_in_a_run(corpus: Path, tmp_path: Path) -> None:
    """Dev BLEU stays 0 in the first steps: the first validation is the best, every later one
    is not better, so the rate halves after validations 3 and 5 and the run stops at the fifth
    (patience 4)."""
    run_dir = run_training(
        corpus,
        tmp_path / "run",
        schedule="plateau",
        plateau_patience=2,
        patience=4,
        max_steps=100,
        best_metric="bleu",
    )
    dev = dev_records(run_dir)
    assert [r["step"] for r in dev] == [5, 10, 15, 20, 25]
    assert all(r["bleu"] == 0.0 for r in dev)
    lrs = {r["step"]: r["lr"] for r in train_records(run_dir)}
    assert lrs == {5: 1e-3, 10: 1e-3, 15: 1e-3, 20: 5e-4, 25: 5e-4}
    progress = saved(run_dir / "last.pt")["progress"]
    assert progress["step"] == 25 and progress["lr_scale"] == 0.25
    assert "done: 25 steps (early stopping" in (run_dir / "train.log").read_text()


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def short_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("short") / "run"
    return run_training(
        corpus, run_dir, max_steps=30, keep_last=3, best_metric="loss", tensorboard=True
    )


def test_keep_last_keeps_the_newest_step_checkpoints(short_run: Path) -> None:
    steps = sorted(p.name for p in short_run.glob("step-*.pt"))
    assert steps == ["step-00000020.pt", "step-00000025.pt", "step-00000030.pt"]
    last, newest = saved(short_run / "last.pt"), saved(short_run / "step-00000030.pt")
    assert last["progress"]["step"] == 30
    assert_same_weights(last["model"], newest["model"])
    assert not list(short_run.glob(".*.tmp"))  # no leftovers of the atomic writes


def test_best_follows_the_lowest_dev_loss(short_run: Path) -> None:
    dev = dev_records(short_run)
    best = min(dev, key=lambda r: r["loss"])
    state = saved(short_run / "best.pt")
    assert state["progress"]["step"] == best["step"]
    assert state["progress"]["best_score"] == best["loss"]


def test_best_follows_the_highest_dev_bleu(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BLEU made to rise and fall (validation is patched): best.pt is the highest, first."""
    bleus = iter([1.0, 5.0, 3.0, 5.0, 2.0, 4.0])
    real = train_module.validate

    def validate(*args: Any) -> dict[str, float]:
        return {**real(*args), "bleu": next(bleus)}

    monkeypatch.setattr(train_module, "validate", validate)
    run_dir = run_training(corpus, tmp_path / "run", max_steps=30, best_metric="bleu")
    state = saved(run_dir / "best.pt")
    assert state["progress"]["step"] == 10 and state["progress"]["best_score"] == 5.0
    assert saved(run_dir / "last.pt")["progress"]["step"] == 30


def test_run_info_describes_the_run(short_run: Path) -> None:
    info = json.loads((short_run / "environment.json").read_text())
    assert info["nmt_version"] == __version__
    assert info["git_commit"] == project_commit()
    assert info["torch_version"] == torch.__version__
    assert info["device"] == "cpu" and info["precision"] == "fp32"
    # precision auto (the default) on a model this small: fp32, whatever the CPU
    assert info["precision_reason"] in (
        "auto: this CPU has no native bf16",
        "auto: the model's matmuls are too small for bf16 to pay",
    )
    log = (short_run / "train.log").read_text(encoding="utf-8")
    assert f"precision: fp32 ({info['precision_reason']})" in log
    assert info["world_size"] == 1
    config = from_dict(saved(short_run / "last.pt")["config"])
    assert (short_run / "config.yaml").read_text(encoding="utf-8") == to_yaml(config)
    assert config.training.max_steps == 30 and config.training.keep_last == 3


def test_without_tensorboard_the_run_is_the_same_and_writes_no_events(
    corpus: Path, short_run: Path, tmp_path: Path
) -> None:
    """run.tensorboard false: the same updates, checkpoints and metrics.jsonl, and no
    tensorboard folder (so no heatmap is drawn)."""
    run_dir = run_training(corpus, tmp_path / "run", max_steps=30, keep_last=3, best_metric="loss")
    assert_same_run(run_dir, short_run)
    assert not (run_dir / "tensorboard").exists()
    assert (short_run / "tensorboard").is_dir()


def test_a_restart_without_a_checkpoint_starts_the_history_afresh(
    corpus: Path, short_run: Path, tmp_path: Path
) -> None:
    """A run killed before its first checkpoint leaves metrics.jsonl and tensorboard events
    behind; --resume (or a plain start) in that directory logs one history, not two."""
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    for stale in run_dir.glob("*.pt"):  # as if killed before the first checkpoint
        stale.unlink()
    assert read_metrics(run_dir)  # the dead run's records are there
    run_training(corpus, run_dir, True, True, max_steps=30, keep_last=3, best_metric="loss")
    assert history(run_dir) == history(short_run)
    steps = [(r["split"], r["step"]) for r in read_metrics(run_dir)]
    assert len(steps) == len(set(steps))  # no step logged twice
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # the dead run's event file is gone
    accumulated = EventAccumulator(str(events[0]), size_guidance={"images": 0}).Reload()
    scalars = accumulated.Scalars("train/loss")
    assert [s.step for s in scalars] == [r["step"] for r in train_records(run_dir)]
    heatmaps = accumulated.Images("dev/attention")  # the dev heatmap of every validation
    assert [h.step for h in heatmaps] == [r["step"] for r in dev_records(run_dir)]


def test_the_commit_recorded_is_nmt_s_own_or_none(tmp_path: Path) -> None:
    """A copy of the tree inside another git repository records no commit (not that
    repository's); a checkout of nmt records its HEAD."""
    root = Path(train_module.__file__).resolve().parents[2]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    in_checkout = head.returncode == 0 and (root / ".git").exists()
    assert project_commit() == (head.stdout.strip() if in_checkout else None)

    outer = tmp_path / "outer"
    (outer / "vendor").mkdir(parents=True)
    shutil.copytree(root / "nmt", outer / "vendor" / "nmt")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(outer)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "vendored"], check=True)
    probe = "from nmt.training.rundir import project_commit; print(project_commit())"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=outer / "vendor",
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(outer / "vendor")},
    )
    assert done.stdout.strip() == "None"


def test_resume_refuses_a_model_change_in_one_line(
    corpus: Path, short_run: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw_config(corpus, short_run, True)), encoding="utf-8")
    before = (short_run / "last.pt").read_bytes()
    result = nmt("train", str(config), "--resume", "-q", "--override", "model.embedding_size=24")
    assert result.error.startswith("error: model.embedding_size: changed since")
    assert (short_run / "last.pt").read_bytes() == before


def test_resume_applies_and_reports_an_allowed_change(corpus: Path, tmp_path: Path) -> None:
    run_dir = run_training(corpus, tmp_path / "run", epochs=1, validate_every=50)
    assert saved(run_dir / "last.pt")["progress"]["step"] == 33  # one epoch of 33 batches
    run_training(corpus, run_dir, resume=True, epochs=2, validate_every=50)
    progress = saved(run_dir / "last.pt")["progress"]
    assert progress["step"] == 66 and progress["epoch"] == 2
    text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "config changed since the checkpoint: training.epochs 1 -> 2" in text
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["epochs"] == 2


def test_resuming_a_finished_run_takes_no_step(short_run: Path, corpus: Path) -> None:
    before = saved(short_run / "last.pt")
    run_training(corpus, short_run, True, True, max_steps=30, keep_last=3, best_metric="loss")
    after = saved(short_run / "last.pt")
    assert after["progress"]["step"] == 30
    assert_same_weights(after["model"], before["model"])


def test_step_token_counts_from_lengths_match_the_batches(corpus: Path, tmp_path: Path) -> None:
    """The loop normalises by target tokens counted from the corpus lengths (so that every rank
    knows the count of the whole step); they must be the batches' real counts."""
    config = from_dict(raw_config(corpus, tmp_path))
    corpora, _ = load_corpora(config, tmp_path, None)
    train_ids = corpora.train
    batches = bucket_batches(train_ids.src_lengths, train_ids.trg_lengths, 200, 1, 0)
    for indices in batches:
        assert int(train_ids.trg_lengths[indices].sum()) == train_ids.batch(indices).n_target_tokens


# ----------------------------------------------------------------------------- out of memory


def oom_above(monkeypatch: pytest.MonkeyPatch, sentences: int) -> list[int]:
    """The model's loss runs out of memory on batches of more than ``sentences``."""
    real_loss = Seq2Seq.loss
    seen: list[int] = []

    def loss(self: Seq2Seq, src: Any, *tensors: Any, **options: Any) -> Any:
        seen.append(src.size(0))
        if self.training and src.size(0) > sentences:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(self, src, *tensors, **options)

    monkeypatch.setattr(Seq2Seq, "loss", loss)
    return seen


def test_oom_split_gives_the_same_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = reverse_batch(8)
    scale = 1 / batch.n_target_tokens
    model = tiny_model()
    model.train()
    expected = forward_backward(TrainingLoss(model, 0.1), batch, scale, CPU, "fp32").tolist()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    seen = oom_above(monkeypatch, 2)
    loss = TrainingLoss(model, 0.1)
    sums = forward_backward(loss, batch, scale, CPU, "fp32", oom_split=True).tolist()
    assert seen == [8, 4, 2, 2, 2, 2]  # whole, first half, then four quarters
    assert sums == pytest.approx(expected, rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=1e-5, atol=1e-7)


def test_oom_without_split_is_an_error_naming_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = reverse_batch(8)
    model = tiny_model()
    model.train()
    oom_above(monkeypatch, 2)
    with pytest.raises(NMTError) as info:
        forward_backward(TrainingLoss(model, 0.1), batch, 1.0, CPU, "fp32", batch_tokens=4000)
    message = str(info.value)
    assert message.startswith("out of memory on a training batch of 8 sentences, ")
    assert f"{8 * batch.src.size(1)} padded source" in message
    assert "lower training.batch_tokens (now 4000) or set training.oom_split: true" in message
    assert all(p.grad is None for p in model.parameters())


def test_oom_split_in_a_run(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = oom_above(monkeypatch, 6)
    run_dir = run_training(corpus, tmp_path / "run", max_steps=10, oom_split=True)
    assert max(seen) > 6  # some batches were too big and were split
    assert saved(run_dir / "last.pt")["progress"]["step"] == 10
    text = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "out of memory on a batch of" in text and "retrying it in 2 pieces" in text


def test_an_epoch_resumed_on_another_kind_of_device_keeps_its_batches(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch begun with the static shapes of CUDA graphs (here forced on a CPU) and resumed
    where the model wants bucketed batches (a CPU, torchrun) finishes with the batches it
    began with: the same run as one that never stopped."""
    options = {"max_steps": 15, "log_every": 1}
    monkeypatch.setattr(train_module, "_shaped", lambda run: True)
    whole = run_training(corpus, tmp_path / "whole", **options)
    parts = tmp_path / "parts"
    run_training(corpus, parts, **{**options, "max_steps": 10})
    assert saved(parts / "last.pt")["progress"]["shaped_epoch"] is True
    monkeypatch.setattr(train_module, "_shaped", lambda run: False)
    run_training(corpus, parts, resume=True, **options)
    result = saved(parts / "last.pt")["progress"]
    assert result["epoch"] == 0 and result["shaped_epoch"] is True  # still the first epoch
    assert "epoch 1 resumes with the static-shape batches it began with" in (
        parts / "train.log"
    ).read_text(encoding="utf-8")
    assert_same_run(parts, whole)
