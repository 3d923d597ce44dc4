"""nmt.fast.compiled's decoding kernel: the masked log-softmax against float64, on random rows
with -inf and widths that are not whole blocks; FastPaths.log_softmax's two paths against each
other, and search's translations with the kernels and search's tables and without."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from searchref import model, options, source

from nmt.decoding.ensemble import Ensemble, StepTables
from nmt.decoding.search import beam_search
from nmt.fast import FastPaths
from nmt.fast import compiled as native

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
@pytest.mark.parametrize("width", [7, 64, 100, 3368])
def test_a_disallowed_column_never_sets_the_maximum(width: int) -> None:
    """The log-softmax shifts each row by its largest allowed logit: a disallowed one far
    above the rest (1e4, wherever it stands in a vector block or the row's tail) would
    underflow every exponential to 0 and make the allowed columns +inf."""
    logits, allowed = _rows(width, 7 * width)
    logits[~allowed] = 1e4
    expected = torch.log_softmax(logits.double().masked_fill(~allowed, -math.inf), dim=-1)
    got = logits.clone()
    assert native.log_softmax_(got, allowed)
    assert torch.equal(got == -math.inf, ~allowed)
    assert torch.allclose(got[allowed].double(), expected[allowed], rtol=1e-6, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("width", [*WIDTHS, 8, 255, 256, 257, 519])
def test_log_softmax_kernel_with_every_column_allowed_is_the_unmasked_one_to_the_bit(
    width: int,
) -> None:
    """The masked and unmasked rows sum their exponentials in one order (kernels.c's lanes),
    whatever the compiler vectorises each loop with: a shortlist that allows every column
    scores as the whole vocabulary does. Widths across the lanes (8) and chunks (256)."""
    logits, _ = _rows(width, 3 * width)
    logits[5, : width // 3] = -60.0  # a spread of exponentials, some near zero
    plain, masked = logits.clone(), logits.clone()
    assert native.log_softmax_(plain, None)
    assert native.log_softmax_(masked, torch.ones(9, width, dtype=torch.bool))
    assert torch.equal(plain.view(torch.int32), masked.view(torch.int32))


@needs_kernels
def test_log_softmax_kernel_declines_what_it_cannot_take() -> None:
    logits = torch.randn(4, 10)
    assert not native.log_softmax_(logits.double(), None)
    assert not native.log_softmax_(logits.t(), None)  # not contiguous
    assert not native.log_softmax_(logits, torch.ones(10, 4, dtype=torch.bool).t())
    before = logits.clone()
    assert not native.log_softmax_(logits.view(2, 2, 10), None)
    assert torch.equal(logits, before)


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
@pytest.mark.parametrize(("rnn", "tabled"), [("gru", False), ("gru", True), ("lstm", True)])
def test_search_gives_the_same_translations_with_the_kernels_and_without(
    restricted: bool, rnn: str, tabled: bool
) -> None:
    """Beam search (3 best of beam 4) and greedy search of a float32 model, with a shortlist's
    columns and without: the compiled log-softmax, and with tables the looked-up gates and the
    prepared products (W_o, W_hh, W_c), against torch's ops without search's
    tables (``native_kernels=False, search_tables=False``, the same weights) give the same
    tokens, and the scores to float32's round-off."""
    vocab = 30
    fast = model(vocab, seed=11, style="luong", feeding=False, rnn=rnn)
    slow = model(vocab, seed=11, style="luong", feeding=False, rnn=rnn)
    slow.fast = replace(slow.fast, native_kernels=False, search_tables=False)
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
        # the decoder's table of input gates, as a Translator makes it (search's RNN steps
        # through fast.cells), and the step's products, from oneDNN's layouts for the fast
        # model
        output = m.fast.product(m.generator.weight)
        products = m.decoder.search_products()
        encoder = m.encoder.gate_table() if m is fast else None  # the slow one: the module
        tables = [StepTables(m.decoder.gate_table(), output, products, encoder)] if tabled else None
        whole = Ensemble([m], tables=tables)
        stepper = whole.restricted(columns, allowed) if restricted else whole
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
