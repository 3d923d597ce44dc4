"""DistributedDataParallel on CPU: two gloo processes make the update one process makes on
the union of their batches, and `torchrun -m nmt train` writes one run directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from runs import read_metrics
from synthetic import data_section, luong_model_section, write_corpus

from nmt import checkpoint
from nmt.config import from_dict
from nmt.data.batching import Batch, make_batch
from nmt.model import Seq2Seq, build_model
from nmt.training.distributed import init_distributed, shutdown_distributed
from nmt.training.step import TrainingLoss, apply_update, forward_backward, loss_for_training

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="this torch build has no gloo backend for torch.distributed",
)

CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny_model() -> Seq2Seq:
    torch.manual_seed(0)
    cfg = from_dict(
        {
            "model": {
                "embedding_size": 8,
                "embedding_dropout": 0.0,
                "encoder": {"hidden_size": 8, "dropout": 0.0},
                "decoder": {"style": "bahdanau", "hidden_size": 8, "dropout": 0.0},
            }
        }
    )
    return build_model(cfg.model, 14, 14)


def step_batches(step: int) -> list[Batch]:
    """The global batch of a step: two batches of different sizes and lengths."""
    out = []
    for rank, sentences in enumerate((5, 3)):
        rng = np.random.default_rng([step, rank])
        src, trg = [], []
        for _ in range(sentences):
            seq = rng.integers(4, 14, size=int(rng.integers(2, 8))).tolist()
            src.append([*seq, 3])
            trg.append(seq[::-1])
        out.append(make_batch(src, trg, np.arange(sentences)))
    return out


def split_above(sentences: int) -> None:
    """Make the loss run out of memory on batches of more than ``sentences``."""
    real_loss = Seq2Seq.loss

    def loss(self: Seq2Seq, src: torch.Tensor, *tensors: Any, **options: Any) -> Any:
        if src.size(0) > sentences:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_loss(self, src, *tensors, **options)

    Seq2Seq.loss = loss  # type: ignore[method-assign]  # in a spawned worker only


def join_group(rank: int, world: int, port: int) -> tuple[Any, torch.device]:
    """In a spawned worker: one thread, the torchrun variables, the gloo group joined."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    return init_distributed("cpu")


def _two_steps(rank: int, world: int, port: int, out: Path) -> None:
    """One rank: two DDP updates; the second with rank 0's batch split for out-of-memory."""
    place, device = join_group(rank, world, port)
    done = False
    try:
        model = tiny_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss_module = loss_for_training(model, 0.1, place)
        for step in (1, 2):
            if step == 2 and rank == 0:
                split_above(3)  # 5 sentences: retried as 3 + 2 under no_sync, then synced
            batches = step_batches(step)
            tokens = sum(b.n_target_tokens for b in batches)
            optimizer.zero_grad()
            forward_backward(loss_module, batches[rank], world / tokens, device, "fp32", None, True)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            apply_update(model, optimizer, None, 1.0)
            torch.save({"grads": grads, "model": model.state_dict()}, out / f"{rank}-{step}.pt")
        done = True
    finally:  # after a normal end, wait for the other rank before leaving (gloo aborts a
        # process whose threads are torn down while the other still talks to it)
        shutdown_distributed(place, wait_for_all=done)


def spawn(fn: Any, world: int, *args: Any, timeout: float = 120) -> None:
    context = mp.start_processes(
        fn, args=(world, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.time() + timeout
    while not context.join(timeout=1):
        if time.time() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers still running after {timeout}s")


def test_two_ranks_make_the_single_process_update_on_the_union(tmp_path: Path) -> None:
    spawn(_two_steps, 2, free_port(), tmp_path)
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_module = TrainingLoss(model, 0.1)
    for step in (1, 2):
        batches = step_batches(step)
        tokens = sum(b.n_target_tokens for b in batches)
        optimizer.zero_grad()
        for batch in batches:  # the loss sum of both batches over all their tokens
            forward_backward(loss_module, batch, 1 / tokens, CPU, "fp32")
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        apply_update(model, optimizer, None, 1.0)
        ranks = [torch.load(tmp_path / f"{rank}-{step}.pt") for rank in (0, 1)]
        for name, grad in grads.items():
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
            torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-5, atol=1e-7)
        for name, weight in model.state_dict().items():
            assert torch.equal(ranks[0]["model"][name], ranks[1]["model"][name]), name
            torch.testing.assert_close(ranks[0]["model"][name], weight, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- torchrun


def write_run(root: Path, **training: Any) -> Path:
    write_corpus(root, {"train": 300, "dev": 8})
    config = {
        "data": data_section(root),
        "tokenizer": {"vocab_size": 40, "type": "bpe"},
        "model": luong_model_section(score="additive"),
        "training": {"batch_tokens": 200, "validate_every": 5, "log_every": 5, **training},
        "decoding": {"max_len_offset": 3, "max_len_ratio": 1.0},
        "run": {"dir": str(root / "run"), "device": "cpu"},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def torchrun(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "nmt", "train", str(config), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_torchrun_trains_with_one_run_directory(tmp_path: Path) -> None:
    config = write_run(tmp_path, max_steps=10)
    result = torchrun(config)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    lines = (run / "train.log").read_text(encoding="utf-8").splitlines()
    messages = [line.split(" ", 1)[1] for line in lines]  # without the time stamp
    assert len(messages) == len(set(messages)), "duplicated log lines"
    assert sum("data: 300 training pairs" in m for m in messages) == 1
    assert "epoch 1: 33 batches, 2.3% padding; 16 steps of 2 batches" in messages
    assert not any("disagree" in m for m in messages)
    assert messages[-1].startswith("done: 10 steps (training.max_steps reached)")
    assert len(list((run / "tensorboard").iterdir())) == 1
    records = read_metrics(run)
    assert [r["step"] for r in records if r["split"] == "dev"] == [5, 10]
    assert [r["step"] for r in records if r["split"] == "train"] == [5, 10]
    assert sorted(p.name for p in run.glob("*.pt")) == ["best.pt", "last.pt"]

    state = checkpoint.load(run / "last.pt")
    assert state["progress"]["step"] == 10 and state["progress"]["batch_in_epoch"] == 20
    assert len(state["rng_by_rank"]) == 2
    assert not torch.equal(state["rng_by_rank"][0]["torch"], state["rng_by_rank"][1]["torch"])
    from nmt.decoding.translator import Translator

    translator = Translator.from_checkpoint(run, "cpu")
    assert translator.translate(["sol luna"], translator.config.decoding)


@pytest.mark.slow
def test_torchrun_resume_is_exact(tmp_path: Path) -> None:
    """Two ranks with dropout: 10 steps, then resumed to 20, equal 20 steps in one go."""
    straight = tmp_path / "straight"
    straight.mkdir()
    result = torchrun(write_run(straight, max_steps=20))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    config = write_run(resumed, max_steps=10)
    assert torchrun(config).returncode == 0
    result = torchrun(config, "--resume", "--override", "training.max_steps=20")
    assert result.returncode == 0, result.stderr[-3000:]
    a = checkpoint.load(straight / "run" / "last.pt")
    b = checkpoint.load(resumed / "run" / "last.pt")
    assert a["progress"]["step"] == b["progress"]["step"] == 20
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_a_single_process_has_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    place, device = init_distributed("cpu")
    assert (place.world_size, place.rank, place.enabled, device.type) == (1, 0, False, "cpu")
    assert not dist.is_initialized()
    shutdown_distributed(place)
