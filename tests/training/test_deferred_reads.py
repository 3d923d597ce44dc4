"""training.deferred_reads: an update is queued and read once the next update's forward and
backward are queued; a non-finite update is skipped on the device (fused Adam's found_inf).
A run with it trains as a run without, bit for bit: the weights, the logged losses and
norms, the skipped updates and their steps, the checkpoints at validations and saves, and
a resumed run; an update after which the loop validates, saves or stops is read at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from faultinject import nan_losses
from synthetic import data_section, luong_model_section, write_corpus

import nmt.training.loop as loop_module
from nmt import checkpoint
from nmt.config import from_dict
from nmt.data.batching import make_batch
from nmt.errors import NMTError
from nmt.model import build_model
from nmt.training import train
from nmt.training.batches import to_device
from nmt.training.distributed import Distributed
from nmt.training.loop import MAX_BAD_STEPS
from nmt.training.resume import rng_state
from nmt.training.run import Run
from nmt.training.step import PendingStep, Updater, backward, queue_update


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, {"train": 300, "dev": 8})
    return root


def _config(corpus: Path, run_dir: Path, deferred: bool, device: str = "cpu", **training: Any):
    return from_dict(
        {
            "data": data_section(corpus),
            "tokenizer": {"vocab_size": 40, "type": "bpe"},
            "model": luong_model_section(
                input_feeding=False
            ),  # dropout: the random state must follow
            "training": {
                "epochs": 2,
                "batch_tokens": 200,
                "validate_every": 7,
                "save_every": 5,
                "log_every": 1,
                "deferred_reads": deferred,
                **training,
            },
            "decoding": {"max_len_offset": 3, "max_len_ratio": 1.0},
            "run": {"dir": str(run_dir), "device": device, "tensorboard": False},
        }
    )


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "target_tokens_per_s")} for r in rows]


def _same_run(a: Path, b: Path) -> None:
    first, second = checkpoint.load(a / "last.pt"), checkpoint.load(b / "last.pt")
    clockless = [
        {k: v for k, v in c["progress"].items() if k != "minutes"} for c in (first, second)
    ]
    assert clockless[0] == clockless[1]
    for name, weight in first["model"].items():
        assert torch.equal(second["model"][name], weight), name
    for key, state in first["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(second["optimizer"]["state"][key][name], value), (key, name)
    assert _metrics(a) == _metrics(b)
    assert sorted(p.name for p in a.glob("*.pt")) == sorted(p.name for p in b.glob("*.pt"))


def test_a_run_with_deferred_reads_trains_as_one_without(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two NaN updates (one right before a save step), validations every 7 steps, saves
    every 5, an epoch boundary: the same run to the bit, and most updates read late."""
    order: list[str] = []
    read, step_backward = PendingStep.read, loop_module.backward

    def noted_read(self: PendingStep) -> Any:
        order.append("read")
        return read(self)

    def noted_backward(*args: Any) -> Any:
        order.append("backward")
        return step_backward(*args)

    saves: dict[bool, list[tuple[int, str]]] = {False: [], True: []}
    save = Run.save

    def noted_save(self: Run, is_best: bool) -> None:  # the random state each save keeps
        saves[self.updater.defers].append((self.progress.step, repr(rng_state())))
        save(self, is_best)

    monkeypatch.setattr(PendingStep, "read", noted_read)
    monkeypatch.setattr(loop_module, "backward", noted_backward)
    monkeypatch.setattr(Run, "save", noted_save)
    runs = {}
    for deferred in (False, True):
        nan_losses(monkeypatch, {3, 9})
        order.clear()
        run_dir = tmp_path / str(deferred)
        runs[deferred] = train(_config(corpus, run_dir, deferred, max_steps=40), quiet=True)
    _same_run(runs[False], runs[True])
    assert len(saves[True]) >= 10 and saves[True] == saves[False]
    progress = checkpoint.load(runs[True] / "last.pt")["progress"]
    assert progress["step"] == 40 and progress["skipped_steps"] == 2 and progress["epoch"] >= 1
    # an update read late: its read comes after the next update's backward; read at once:
    # the updates of steps 5, 7, 10, 14, 15, 20, 21, 25, 28, 30, 35 and 40, and the epoch's end
    assert order.count("read") == order.count("backward") == 42
    late, begun, done = 0, 0, 0
    for event in order:
        begun += event == "backward"
        if event == "read":
            late += begun - done == 2
            done += 1
    assert 42 - 13 - 2 <= late <= 42 - 12
    text = (runs[True] / "train.log").read_text(encoding="utf-8")
    assert "step 3: non-finite loss or gradient, update skipped" in text


def test_a_resumed_run_with_deferred_reads_equals_an_uninterrupted_one(
    corpus: Path, tmp_path: Path
) -> None:
    whole = train(_config(corpus, tmp_path / "whole", True, max_steps=24), quiet=True)
    parts = tmp_path / "parts"
    train(_config(corpus, parts, True, max_steps=13), quiet=True)
    train(_config(corpus, parts, True, max_steps=24), resume=True, quiet=True)
    first, second = checkpoint.load(whole / "last.pt"), checkpoint.load(parts / "last.pt")
    assert first["progress"]["step"] == second["progress"]["step"] == 24
    for name, weight in first["model"].items():
        assert torch.equal(second["model"][name], weight), name


def test_non_finite_updates_in_a_row_still_stop_the_run(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_losses(monkeypatch, range(13, 1000))
    run_dir = tmp_path / "run"
    with pytest.raises(NMTError, match=f"training diverged: {MAX_BAD_STEPS} non-finite steps"):
        train(_config(corpus, run_dir, True, max_steps=40, save_every=None), quiet=True)
    state = checkpoint.load(run_dir / "last.pt")
    assert state["progress"]["step"] == 7  # the validation before the NaNs
    assert all(torch.isfinite(w).all() for w in state["model"].values())


# fp16's scaler asked for on a CUDA device this machine may lack: torch warns and disables it
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled:UserWarning")
def test_when_updates_are_deferred(corpus: Path, tmp_path: Path) -> None:
    """null: on a GPU; never with fp16's scaler or several ranks."""
    config = _config(corpus, tmp_path, None)  # type: ignore[arg-type]
    model = build_model(config.model, 40, 40)
    cpu, cuda, alone = torch.device("cpu"), torch.device("cuda"), Distributed()

    def defers(config, precision: str, device: torch.device) -> bool:
        return Updater.build(config, model, precision, device, alone).defers

    assert not defers(config, "fp32", cpu)
    assert defers(config, "bf16", cuda)
    assert not defers(config, "fp16", cuda)
    on = _config(corpus, tmp_path, True)
    assert defers(on, "fp32", cpu) and not defers(on, "fp16", cpu)
    assert not defers(_config(corpus, tmp_path, False), "bf16", cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_deferred_reads_train_as_reads_at_once(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (the default there), a NaN update among them: the same steps, skips and,
    to float tolerance (cuDNN's backward adds in its own order), the same losses."""
    logged = {}
    for deferred in (False, True):
        nan_losses(monkeypatch, {4})
        config = _config(corpus, tmp_path / str(deferred), deferred, "cuda", max_steps=30)
        run_dir = train(config, quiet=True)
        logged[deferred] = [r for r in _metrics(run_dir) if r.get("split") == "train"]
        assert checkpoint.load(run_dir / "last.pt")["progress"]["skipped_steps"] == 1
    assert [r["step"] for r in logged[True]] == [r["step"] for r in logged[False]]
    for ours, theirs in zip(logged[True], logged[False], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_a_deferred_update_never_waits(
    corpus: Path, tmp_path: Path, precision: str
) -> None:
    """torch's sync debug mode raises on any operation that waits for the GPU: a deferred
    update (backward, clip, the step skipped or not on the device) raises nothing."""
    config = _config(corpus, tmp_path, True, "cuda")
    cuda = torch.device("cuda")
    model = build_model(config.model, 40, 40).to(cuda).train()
    updater = Updater.build(config, model, precision, cuda, Distributed())
    assert updater.defers
    rng = np.random.default_rng(0)
    src = [rng.integers(4, 40, size=int(n)).tolist() for n in rng.integers(2, 12, size=16)]
    trg = [rng.integers(4, 40, size=int(n)).tolist() for n in rng.integers(2, 12, size=16)]
    batch = to_device(make_batch(src, trg, np.arange(16)).with_target_rows(), cuda)  # as loaded
    tokens = int((batch.trg_out != 0).sum())
    for _ in range(2):  # the first steps make the optimiser's state and cuBLAS's handles
        queue_update(updater, backward(updater, [batch], tokens), None, None).read()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = queue_update(updater, backward(updater, [batch], tokens), None, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert queued.read().status == "applied"
