"""Gradient accumulation (training.accumulate): the gradient of several batches equals the
gradient of one batch holding all their sentences (float64), through fp16's loss scaler
too; under DDP only the last batch's backward all-reduces; a run resumes exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import nmt, tiny_config, write_config
from test_distributed import free_port, join_group, spawn, tiny_model

from nmt import checkpoint
from nmt.config import from_dict
from nmt.data.batching import Batch, make_batch
from nmt.fast import FastPaths
from nmt.model import build_model
from nmt.training.distributed import shutdown_distributed
from nmt.training.step import TrainingLoss, forward_backward, loss_for_training

CPU = torch.device("cpu")


def _pairs(count: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Reversal pairs of varied lengths (ids 4..13, source ending in EOS)."""
    rng = np.random.default_rng(seed)
    src, trg = [], []
    for _ in range(count):
        seq = rng.integers(4, 14, size=int(rng.integers(2, 9))).tolist()
        src.append([*seq, 3])
        trg.append(seq[::-1])
    return src, trg


def _batches(sizes: list[int], seed: int) -> tuple[list[Batch], Batch]:
    """Batches of ``sizes`` sentences, and one batch of all of them (the union)."""
    src, trg = _pairs(sum(sizes), seed)
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        out.append(make_batch(src[rows], trg[rows], np.arange(size)))
        start += size
    return out, make_batch(src, trg, np.arange(len(src)))


def _model(fast: FastPaths) -> torch.nn.Module:
    """tiny_model's architecture with the given speed paths."""
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
    return build_model(cfg.model, 14, 14, fast)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fast", [True, False])
def test_accumulated_batches_give_the_union_gradient_in_float64(fast: bool) -> None:
    """Three batches of 4, 2 and 5 sentences, one after another, equal the 11-sentence batch
    (label smoothing on, padding in every batch)."""
    batches, union = _batches([4, 2, 5], seed=1)
    tokens = union.n_target_tokens
    assert sum(b.n_target_tokens for b in batches) == tokens
    model = _model(FastPaths() if fast else FastPaths().plain()).double()
    loss_module = TrainingLoss(model, 0.1)
    accumulated = forward_backward(loss_module, batches, 1 / tokens, CPU, "fp32").tolist()
    separate = _grads(model)
    model.zero_grad(set_to_none=True)
    whole = forward_backward(loss_module, union, 1 / tokens, CPU, "fp32").tolist()
    together = _grads(model)
    assert separate.keys() == together.keys() and separate
    for name, grad in together.items():
        assert grad.dtype == torch.float64
        torch.testing.assert_close(separate[name], grad, rtol=1e-10, atol=1e-12)
    assert accumulated[0] == pytest.approx(whole[0], rel=1e-12)


def test_the_loss_scaler_scales_every_batch_and_unscales_once() -> None:
    """With a GradScaler (scale 2^10, exact in binary) the unscaled accumulated gradients are
    bit for bit those without a scaler."""
    batches, union = _batches([3, 4], seed=2)
    model = tiny_model()
    loss_module = TrainingLoss(model, 0.1)
    forward_backward(loss_module, batches, 1 / union.n_target_tokens, CPU, "fp32")
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    forward_backward(loss_module, batches, 1 / union.n_target_tokens, CPU, "fp32", scaler)
    scaled = _grads(model)
    for name, grad in plain.items():
        assert torch.equal(scaled[name], grad * 2.0**10), name
    scaler.unscale_(optimizer)
    for name, grad in _grads(model).items():
        assert torch.equal(grad, plain[name]), name


def _accumulating_rank(rank: int, world: int, port: int, out: Path) -> None:
    """One rank: one update of two batches; a comm hook counts the gradient all-reduces."""
    place, device = join_group(rank, world, port)
    done = False
    try:
        model = tiny_model()
        loss_module = loss_for_training(model, 0.1, place)
        calls = []

        def counting_hook(state, bucket):  # type: ignore[no-untyped-def] # DDP reads no string annotations
            calls.append(bucket.index())
            bucket.buffer().div_(world)  # as the default hook: the mean over ranks
            reduced = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
            return reduced.get_future().then(lambda fut: fut.value()[0])

        loss_module.register_comm_hook(None, counting_hook)
        batches, union = _batches([3, 2, 4, 5], seed=3)
        mine = batches[rank::world]  # as the training loop deals them out
        forward_backward(loss_module, mine[0], 1.0, device, "fp32")  # one batch: the buckets
        single = len(calls)
        model.zero_grad(set_to_none=True)
        calls.clear()
        forward_backward(loss_module, mine, world / union.n_target_tokens, device, "fp32")
        torch.save(
            {"grads": _grads(model), "single": single, "accumulated": len(calls)},
            out / f"{rank}.pt",
        )
        done = True
    finally:  # after a normal end, wait for the other rank before leaving (gloo aborts a
        # process whose threads are torn down while the other still talks to it)
        shutdown_distributed(place, wait_for_all=done)


def test_ddp_all_reduces_once_per_update(tmp_path: Path) -> None:
    """Two ranks with two batches each: the buckets are all-reduced in the last backward
    only, and both ranks hold the gradient of the 14-sentence union."""
    spawn(_accumulating_rank, 2, free_port(), tmp_path)
    model = tiny_model()
    batches, union = _batches([3, 2, 4, 5], seed=3)
    forward_backward(TrainingLoss(model, 0.1), union, 1 / union.n_target_tokens, CPU, "fp32")
    reference = _grads(model)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    for saved in ranks:  # two batches' backward all-reduce as many buckets as one batch's
        assert saved["accumulated"] == saved["single"] >= 1
    for name, grad in reference.items():
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
        torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-5, atol=1e-7)


def _config(corpus: Path, root: Path, **training: object) -> Path:
    config = tiny_config(corpus)
    config["training"].update({"accumulate": 3, "validate_every": 2, **training})
    config["run"] = {"dir": str(root / "run"), "device": "cpu", "tensorboard": False}
    return write_config(root / "c.yaml", config)


def test_an_accumulating_run_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    """accumulate 3: stopped after 2 updates and resumed to 4 equals 4 updates in one go."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    assert nmt("train", str(_config(corpus, whole, max_steps=4)), "--quiet").code == 0
    half = _config(corpus, parts, max_steps=2)
    assert nmt("train", str(half), "--quiet").code == 0
    assert nmt("train", str(half), "--quiet", "--resume", "-O", "training.max_steps=4").code == 0
    a, b = (checkpoint.load(root / "run" / "last.pt") for root in (whole, parts))
    assert a["progress"]["step"] == b["progress"]["step"] == 4
    assert a["progress"]["batch_in_epoch"] == b["progress"]["batch_in_epoch"] == 12
    for name, weight in a["model"].items():
        assert torch.equal(b["model"][name], weight), name


def test_a_run_with_accumulation_and_subword_sampling_resumes_exactly(
    corpus: Path, tmp_path: Path
) -> None:
    """accumulate 3 and sampled segmentations (re-sampled every epoch): stopped after 2
    updates and resumed across an epoch boundary equals the run in one go."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    sampling = ("-O", "tokenizer.type=unigram", "-O", "tokenizer.sampling_alpha=0.2")
    options = ("-O", "training.epochs=3", *sampling, "--quiet")
    assert nmt("train", str(_config(corpus, whole, max_steps=8)), *options).code == 0
    half = _config(corpus, parts, max_steps=2)
    assert nmt("train", str(half), *options).code == 0
    resumed = nmt("train", str(half), *options, "--resume", "-O", "training.max_steps=8")
    assert resumed.code == 0
    a, b = (checkpoint.load(root / "run" / "last.pt") for root in (whole, parts))
    assert a["progress"]["step"] == b["progress"]["step"] == 8
    assert a["progress"]["epoch"] == b["progress"]["epoch"] >= 1, "the resume crossed an epoch"
    for name, weight in a["model"].items():
        assert torch.equal(b["model"][name], weight), name
    log = (whole / "run" / "train.log").read_text(encoding="utf-8")
    assert log.count("subword segmentations sampled") >= 2


def test_a_model_with_graphs_keeps_its_gradients_and_steps_the_same() -> None:
    """With CUDA graphs the step keeps every gradient allocated (zeroed, then each batch's
    added in place: a captured backward returns gradients in the graph's own memory, which
    the next replay overwrites). The same model and accumulated batches, its gradients
    cleared to None instead, reach the same weights to the bit."""
    from nmt.training.distributed import Distributed
    from nmt.training.step import Updater, train_step

    config = from_dict({"training": {"accumulate": 2, "learning_rate": 0.01}})
    weights = []
    for keep in (True, False):
        model = _model(FastPaths(graphs="loss")).double().train()
        assert model.graphs is not None  # on a CPU nothing is captured: the unroll is eager
        if not keep:
            model.graphs = None
        updater = Updater.build(config, model, "fp32", CPU, Distributed())
        for seed in range(3):
            batches, union = _batches([3, 4], seed=seed)
            train_step(updater, batches, union.n_target_tokens)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads) if keep else True
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
