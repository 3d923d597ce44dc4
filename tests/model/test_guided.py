"""Guided alignment's loss (Chen et al. 2016): the equation in float64, the term every
decoder and score adds from its own attention, and attention that learns to align by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_learning import VOCAB, reverse_batch

from nmt.config import from_dict
from nmt.data.batching import Batch
from nmt.data.guidance import guide_matrix
from nmt.model import build_model
from nmt.model.seq2seq import Guide, guided_alignment_loss


def reference_loss(alphas: np.ndarray, guide: np.ndarray) -> float:
    """-sum_b sum_t sum_s G[b,t,s] log alpha[b,t,s], loop by loop in float64; a zero weight
    where G is not counts as float32's smallest normal number."""
    tiny = float(np.finfo(np.float32).tiny)
    total = 0.0
    for b in range(guide.shape[0]):
        for t in range(guide.shape[1]):
            for s in range(guide.shape[2]):
                if guide[b, t, s] > 0:
                    total -= guide[b, t, s] * np.log(max(float(alphas[b, t, s]), tiny))
    return total


def test_the_loss_is_the_cross_entropy_of_the_equation() -> None:
    """Random attention rows over 5 source pieces, the last two padding (weight 0) in pair
    1; targets with a 2-way split, a one-hot row, empty rows and one on an exact zero."""
    rng = np.random.default_rng(0)
    alphas = rng.random((2, 4, 5))
    alphas[1, :, 3:] = 0.0
    alphas /= alphas.sum(axis=-1, keepdims=True)
    cells = [[0, 1, 0, 4, 2, 2], [1, 0, 3, 1, 3, 2, 2, 3]]  # the last one is on a padding zero
    guide = guide_matrix(cells, 4, 5)
    got = guided_alignment_loss(torch.tensor(alphas, dtype=torch.float32), guide)
    assert float(got) == pytest.approx(reference_loss(alphas, guide.double().numpy()), rel=1e-6)


SIZES = {"embedding_size": 12, "embedding_dropout": 0.0}
RNN = {"hidden_size": 16, "dropout": 0.0}
VARIANTS = {
    "bahdanau-additive": ("bahdanau", {"score": "additive"}, {}),
    "luong-general-feed": ("luong", {"score": "general"}, {}),
    "luong-dot-nofeed": ("luong", {"score": "dot"}, {"input_feeding": False, "hidden_size": 32}),
    "luong-multihead": ("luong", {"score": "multihead", "heads": 2}, {}),
    "luong-local-p": ("luong", {"score": "local-p", "window": 1}, {}),
}


def _model(name: str) -> torch.nn.Module:
    style, attention, decoder = VARIANTS[name]
    torch.manual_seed(0)
    cfg = {
        **SIZES,
        "encoder": RNN,
        "decoder": {**RNN, "style": style, **decoder},
        "attention": attention,
    }
    return build_model(from_dict({"model": cfg}).model, VOCAB, VOCAB)


def _guided_batch(seed: int) -> Batch:
    """Reversal pairs of lengths 3-8 (padding present), each target piece t guided to the
    source piece n-1-t (the true alignment of the task); EOS rows unguided."""
    batch = reverse_batch(np.random.default_rng(seed), 8)
    cells = []
    for length in batch.src_lengths.tolist():
        n = length - 1  # without EOS
        cells.append([x for t in range(n) for x in (t, n - 1 - t)])
    batch.guide = guide_matrix(cells, batch.trg_out.size(1), batch.src.size(1))
    return batch


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_decoder_adds_the_term_of_its_own_attention(name: str) -> None:
    """loss(guide, w) - loss() == w x the float64 cross-entropy of the attention the same
    forward returns; the NLL is untouched; the term's gradient reaches the attention's
    inputs (and its parameters, for a score that has some), never the output layer."""
    model = _model(name)
    model.eval()  # no dropout: the two losses see the same forward
    batch = _guided_batch(1)
    plain, nll = model.loss(*batch.tensors())
    guided, guided_nll = model.loss(*batch.tensors(), guide=Guide(batch.guide, 0.7))
    _, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
    expected = 0.7 * reference_loss(alphas.double().detach().numpy(), batch.guide.double().numpy())
    assert float((guided - plain).detach()) == pytest.approx(expected, rel=1e-4)
    assert float(guided_nll) == float(nll)
    model.zero_grad()
    guided_alignment_loss(alphas, batch.guide).backward()
    reached = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()]
    assert any(n.startswith(("decoder", "encoder")) for n in reached), name
    assert not any(n.startswith("generator") for n in reached), "the term is the attention's"


def _alignment_accuracy(model: torch.nn.Module, batch: Batch) -> float:
    """Share of target words whose attention argmax is their true source word (n-1-t)."""
    with torch.no_grad():
        _, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
    hits = total = 0
    for b, length in enumerate(batch.src_lengths.tolist()):
        n = length - 1
        for t in range(n):
            hits += int(alphas[b, t].argmax()) == n - 1 - t
            total += 1
    return hits / total


def _train(weight: float, steps: int) -> torch.nn.Module:
    model = _model("luong-general-feed")
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    rng_seed = 100
    for step in range(steps):
        batch = _guided_batch(rng_seed + step)
        loss, _ = model.loss(*batch.tensors(), guide=Guide(batch.guide, weight))
        optimizer.zero_grad()
        (loss / batch.n_target_tokens).backward()
        optimizer.step()
    return model.eval()


def test_guided_attention_learns_the_alignment() -> None:
    """60 updates on the reversal task: with guidance the attention's argmax finds the true
    source word of nearly every target word; without, it has not learnt to yet."""
    held_out = _guided_batch(9999)
    guided = _alignment_accuracy(_train(1.0, 60), held_out)
    unguided = _alignment_accuracy(_train(0.0, 60), held_out)
    assert guided > 0.9 and guided > unguided + 0.2, (guided, unguided)
