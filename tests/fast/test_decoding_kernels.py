"""nmt.fast.compiled's decoding kernels: the masked log-softmax against float64 and the
top-k against torch.topk and Tensor.max, on random rows with ties, -inf and widths that are
not whole blocks; FastPaths.log_softmax's two paths against each other, and search's
translations with the kernels and without."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from searchref import model, options, source

from nmt.decoding.ensemble import Ensemble
from nmt.decoding.search import beam_search
from nmt.fast import FastPaths, topk
from nmt.fast import compiled as native
from nmt.fast.topk import row_max, top_k

needs_kernels = pytest.mark.skipif(
    native.library() is None, reason=f"no compiled kernels: {native.status()}"
)
WIDTHS = [1, 7, 64, 100, 3368]


def _rows(width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits (9, width) float32 and an allowed mask with each row's first column
    allowed (a row's specials), row 2 allowed everywhere and row 4 only at its first."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(9, width, generator=generator) * 4
    allowed = torch.rand(9, width, generator=generator) > 0.4
    allowed[:, 0] = True
    allowed[2] = True
    allowed[4, 1:] = False
    return logits, allowed


@needs_kernels
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("masked", [False, True])
def test_log_softmax_kernel_matches_float64(width: int, masked: bool) -> None:
    logits, allowed = _rows(width, width)
    logits[6, : width // 2] = 80.0  # large logits: exp must not overflow
    expected = logits.double()
    if masked:
        expected = expected.masked_fill(~allowed, -math.inf)
    expected = torch.log_softmax(expected, dim=-1)
    got = logits.clone()
    assert native.log_softmax_(got, allowed if masked else None)
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite)  # -inf exactly where masked
    assert (got[~finite] == -math.inf).all()
    assert torch.allclose(got[finite].double(), expected[finite], rtol=1e-6, atol=2e-5)
    if masked:
        assert got[4, 0] == 0.0  # a row with one column left: log 1


@needs_kernels
def test_log_softmax_kernel_declines_what_it_cannot_take() -> None:
    logits = torch.randn(4, 10)
    assert not native.log_softmax_(logits.double(), None)
    assert not native.log_softmax_(logits.t(), None)  # not contiguous
    assert not native.log_softmax_(logits, torch.ones(10, 4, dtype=torch.bool).t())
    before = logits.clone()
    assert not native.log_softmax_(logits.view(2, 2, 10), None)
    assert torch.equal(logits, before)


@needs_kernels
@pytest.mark.parametrize(("width", "k"), [(w, k) for w in WIDTHS for k in (1, 2, 10, 64) if k <= w])
def test_top_k_kernel_matches_torch(width: int, k: int) -> None:
    values, allowed = _rows(width, 100 + width)
    values = values.masked_fill(~allowed, -math.inf)
    values[5] = 0.5  # a row of ties: the first k places
    values[7, -1] = 9.0  # the maximum in the tail
    got = native.top_k(values, k)
    assert got is not None
    want = values.double().topk(k, dim=-1)
    assert torch.equal(got[0].double(), want.values)  # the values, bit for bit, best first
    assert torch.equal(values.gather(1, got[1]), got[0])  # the indices point at them
    assert got[1][5].tolist() == list(range(k))
    # among equal values the lower index first: a stable sort of -values gives the order
    order = torch.sort(-values, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(got[1], order)


@needs_kernels
def test_row_max_and_top_k_take_the_kernel_when_native() -> None:
    values = torch.zeros(40, 200)
    values[0, [130, 67, 5]] = 1.0
    values[1, [199, 198]] = 2.0
    best, where = row_max(values, native=True)
    expected = values.max(dim=-1)
    assert torch.equal(best, expected.values) and torch.equal(where, expected.indices)
    assert where[:3].tolist() == [5, 198, 0]
    assert native.top_k(values, native.TOP_K_MAX + 1) is None  # too large a k: torch's
    large = top_k(values, native.TOP_K_MAX + 1, native=True)
    assert torch.equal(large[0], values.topk(native.TOP_K_MAX + 1, dim=-1).values)


@pytest.mark.parametrize("masked", [False, True])
def test_fast_paths_log_softmax_agrees_with_the_plain_path(masked: bool) -> None:
    logits, allowed = _rows(300, 3)
    mask = allowed if masked else None
    plain = FastPaths.plain().log_softmax(logits.clone(), mask, training=False)
    fast = FastPaths().log_softmax(logits.clone(), mask, training=False)
    assert torch.equal(torch.isinf(plain), torch.isinf(fast))
    assert torch.allclose(plain, fast, rtol=1e-6, atol=2e-5)
    bf16 = FastPaths().log_softmax(logits.bfloat16(), mask, training=False)
    assert bf16.dtype == torch.float32
    original = logits.clone()
    with torch.no_grad():  # in training the plain path runs, out of place
        training = FastPaths().log_softmax(logits, mask, training=True)
    assert torch.equal(logits, original)
    assert torch.allclose(training, plain, rtol=1e-6, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("restricted", [False, True])
def test_search_gives_the_same_translations_with_the_kernels_and_without(
    restricted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam search (3 best of beam 4) and greedy search of a float32 model, with a shortlist's
    columns and without: the compiled log-softmax and top-k against torch's ops
    (``FastPaths(native_kernels=False)``, the same weights) give the same tokens, and the
    scores to float32's round-off."""
    monkeypatch.setattr(topk, "NATIVE_MIN", 0)  # the kernel for this tiny model's rows too
    vocab = 30
    fast = model(vocab, seed=11, style="luong", feeding=False)
    slow = model(vocab, seed=11, style="luong", feeding=False)
    slow.fast = replace(slow.fast, native_kernels=False)
    for module in slow.modules():
        if hasattr(module, "fast"):
            module.fast = slow.fast
    slow.load_state_dict(fast.state_dict())
    src, lengths = source([7, 3, 5, 6], vocab, seed=12)
    columns = torch.tensor([0, 1, 2, 3, *range(6, 30, 2)])
    allowed = torch.rand(4, len(columns), generator=torch.Generator().manual_seed(13)) > 0.3
    allowed[:, :4] = True
    results = []
    for m in (fast, slow):
        m.eval()
        stepper = Ensemble([m]).restricted(columns, allowed) if restricted else Ensemble([m])
        assert stepper.native_kernels is (m is fast)
        results.append(
            [
                beam_search(stepper, src, lengths, options(beam_size=4), n_best=3),
                beam_search(stepper, src, lengths, options(beam_size=1)),
            ]
        )
    lengths_seen = {len(h.tokens) for hyps in results[0][0] for h in hyps}
    assert len(lengths_seen) > 2  # outputs of several lengths, not one forced answer
    for got, want in zip(*results, strict=True):
        for hyps, expected in zip(got, want, strict=True):
            assert [h.tokens for h in hyps] == [h.tokens for h in expected]
            for h, e in zip(hyps, expected, strict=True):
                assert h.score == pytest.approx(e.score, rel=1e-5, abs=1e-5)
