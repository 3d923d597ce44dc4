"""Learning is tested by learning: tiny models learn to reverse sequences on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode import run_beam, run_greedy

from nmt.config import from_dict
from nmt.data.batching import make_batch
from nmt.data.tokenizer import EOS_ID
from nmt.fast import FastPaths
from nmt.model import build_model

VOCAB = 14  # 4 specials + 10 symbols


def reverse_batch(rng: np.random.Generator, size: int, lo: int = 3, hi: int = 8):
    src, trg = [], []
    for _ in range(size):
        seq = rng.integers(4, VOCAB, size=rng.integers(lo, hi + 1)).tolist()
        src.append([*seq, EOS_ID])
        trg.append(seq[::-1])
    return make_batch(src, trg, np.arange(size))


def train_reverse(
    model_cfg: dict,
    steps: int,
    seed: int = 0,
    fast: FastPaths | None = None,
    autocast: torch.dtype | None = None,
    static: bool = False,
):
    """A model trained to reverse; ``fast``: its speed paths; ``autocast``: the dtype its
    forward passes run under CPU autocast; ``static``: each batch padded to one static shape
    and its loss taken by ``Seq2Seq.static_loss``, as a CUDA graph of the whole loss holds
    it."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = from_dict({"model": model_cfg})
    model = build_model(cfg.model, VOCAB, VOCAB, fast)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        batch = reverse_batch(rng, 64)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            if static:  # 64 rows of 10 positions: the longest source is 8 pieces and EOS
                padded = batch.padded(64, 10)
                loss, _ = model.static_loss(padded.src, padded.trg_in, padded.trg_out)
            else:
                loss, _ = model.loss(*batch.tensors())
        optimizer.zero_grad()
        (loss / batch.n_target_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    return model


def exact_match(model, batch, beam: int) -> float:
    src_lengths = batch.src_lengths
    if beam == 1:
        hyps = [h.tokens for h in run_greedy(model, batch.src, src_lengths)]
    else:
        hyps = [h[0].tokens for h in run_beam(model, batch.src, src_lengths, beam_size=beam)]
    gold = [[t for t in row.tolist() if t > EOS_ID] for row in batch.trg_out]
    return float(np.mean([h == g for h, g in zip(hyps, gold, strict=True)]))


SMALL = {"embedding_size": 16, "embedding_dropout": 0.0}
RECURRENT = {"hidden_size": 32, "dropout": 0.0}


@pytest.mark.parametrize(
    ("name", "model_cfg"),
    [
        (
            "bahdanau-additive-gru",
            {
                **SMALL,
                "encoder": {**RECURRENT, "hidden_size": 24},
                "decoder": {**RECURRENT, "style": "bahdanau"},
                "attention": {"score": "additive"},
            },
        ),
        (
            "luong-general-lstm-no-feeding",
            {
                **SMALL,
                "encoder": {**RECURRENT, "rnn": "lstm", "hidden_size": 24},
                "decoder": {**RECURRENT, "style": "luong", "rnn": "lstm", "input_feeding": False},
                "attention": {"score": "general"},
            },
        ),
    ],
)
def test_learns_to_reverse(name: str, model_cfg: dict) -> None:
    model = train_reverse(model_cfg, steps=400)
    test = reverse_batch(np.random.default_rng(123), 200)
    greedy = exact_match(model, test, beam=1)
    beam = exact_match(model, test, beam=4)
    assert greedy >= 0.95, f"{name}: greedy exact match {greedy:.2f}"
    assert beam >= 0.95, f"{name}: beam exact match {beam:.2f}"


@pytest.mark.parametrize(
    ("name", "decoder", "score"),
    [
        ("bahdanau-additive-gru", {"style": "bahdanau"}, "additive"),
        pytest.param(
            "luong-feeding-general-lstm",
            {"style": "luong", "rnn": "lstm"},
            "general",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_graph_ready_unroll_learns_under_bf16_autocast(name, decoder, score) -> None:
    """The unroll a GPU captures (FastPaths(graphs="loss"): the RNN through matmuls, the
    embedding's input gates in one product, the step's weights behind sinks, each added in
    float32 to its bf16 product) learns to reverse under bf16 autocast, run on the CPU."""
    model_cfg = {
        **SMALL,
        "encoder": {**RECURRENT, "hidden_size": 24},
        "decoder": {**RECURRENT, **decoder},
        "attention": {"score": score},
    }
    fast = FastPaths(graphs="loss")
    model = train_reverse(model_cfg, steps=180, fast=fast, autocast=torch.bfloat16)
    test = reverse_batch(np.random.default_rng(7), 100)
    greedy = exact_match(model, test, beam=1)
    assert greedy >= 0.9, f"{name}: greedy exact match {greedy:.2f}"


@pytest.mark.parametrize(
    ("name", "decoder", "score"),
    [
        ("luong-nofeed-general-gru", {"style": "luong", "input_feeding": False}, "general"),
        pytest.param(
            "bahdanau-additive-gru", {"style": "bahdanau"}, "additive", marks=pytest.mark.slow
        ),
    ],
)
def test_the_whole_loss_a_gpu_captures_learns_under_bf16_autocast(name, decoder, score) -> None:
    """The whole training loss a GPU captures (``Seq2Seq.static_loss`` on static batches:
    the source lengths counted from the batch, the GRU encoder unpacked, padding's output
    rows weighted 0; the plain RNN path, as a GPU takes it) learns to reverse under bf16
    autocast, run on the CPU."""
    model_cfg = {
        **SMALL,
        "encoder": {**RECURRENT, "hidden_size": 24},
        "decoder": {**RECURRENT, **decoder},
        "attention": {"score": score},
    }
    fast = FastPaths(cpu_kernels=False, graphs="loss")
    model = train_reverse(model_cfg, steps=180, fast=fast, autocast=torch.bfloat16, static=True)
    test = reverse_batch(np.random.default_rng(7), 100)
    greedy = exact_match(model, test, beam=1)
    assert greedy >= 0.9, f"{name}: greedy exact match {greedy:.2f}"
