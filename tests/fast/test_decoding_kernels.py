"""nmt.fast.compiled's decoding kernels: the masked log-softmax against float64 and the
top-k against torch.topk and Tensor.max, on random rows with ties, -inf and widths that are
not whole blocks; a search step's GRU and LSTM cell against its equations in float64, and
taken only without gradients; FastPaths.log_softmax's two paths against each other, and
search's translations with the kernels and without (the cell's too, through the decoder's
table of input gates)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from searchref import model, options, source

from nmt.decoding.ensemble import Ensemble, StepTables
from nmt.decoding.search import beam_search
from nmt.fast import FastPaths, cells, topk
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


def _cell_reference(
    gates_x: torch.Tensor, gates_h: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One GRU (c None) or LSTM step in float64, from the equations in torch's gate order."""
    x, r_h, h = gates_x.double(), gates_h.double(), h.double()
    if c is None:
        x_r, x_z, x_n = x.chunk(3, dim=-1)
        h_r, h_z, h_n = r_h.chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (1 - z) * n + z * h, None
    i, f, g, o = (x + r_h).chunk(4, dim=-1)
    c_next = torch.sigmoid(f) * c.double() + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_next), c_next


@needs_kernels
@pytest.mark.parametrize("lstm", [False, True])
@pytest.mark.parametrize(("batch", "hidden"), [(1, 1), (3, 7), (16, 33), (50, 64)])
def test_the_cell_kernel_matches_float64(lstm: bool, batch: int, hidden: int) -> None:
    """Random gates, some far into the sigmoid's and tanh's flat ends (|a| up to 40)."""
    generator = torch.Generator().manual_seed(batch * hidden + lstm)
    width = (4 if lstm else 3) * hidden
    gates_x = torch.randn(batch, width, generator=generator) * 3
    gates_h = torch.randn(batch, width, generator=generator) * 3
    gates_x[0, : hidden // 2 + 1] = 40.0
    gates_h[-1, -(hidden // 2 + 1) :] = -40.0
    h = torch.randn(batch, hidden, generator=generator)
    c = torch.randn(batch, hidden, generator=generator) * 2 if lstm else None
    done = native.rnn_cell(gates_x, gates_h, h, c)
    assert done is not None
    want_h, want_c = _cell_reference(gates_x, gates_h, h, c)
    torch.testing.assert_close(done[0].double(), want_h, rtol=1e-6, atol=1e-6)
    if lstm:
        assert done[1] is not None and want_c is not None
        torch.testing.assert_close(done[1].double(), want_c, rtol=1e-6, atol=1e-6)
    else:
        assert done[1] is None


@needs_kernels
def test_the_cell_kernel_declines_what_it_cannot_take() -> None:
    gates, h = torch.randn(4, 6), torch.randn(4, 2)
    assert native.rnn_cell(gates.double(), gates.double(), h.double(), None) is None
    assert native.rnn_cell(torch.randn(6, 4).t(), gates, h, None) is None  # not contiguous
    assert native.rnn_cell(gates, gates, h, None) is not None


@needs_kernels
@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_a_search_step_takes_the_cell_kernel_only_without_gradients(
    rnn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through FastPaths.step_rnn with looked-up gates (search's step, two layers): the
    kernel in evaluation without gradients, equal to the torch ops to float32's round-off;
    with gradients, or in training, the torch ops, whose outputs autograd follows."""
    calls = []
    kernel = native.rnn_cell

    def counted(*args: torch.Tensor | None) -> object:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "rnn_cell", counted)
    rnn_module = torch.nn.LSTM if rnn == "lstm" else torch.nn.GRU
    layers = rnn_module(9, 6, num_layers=2, batch_first=True)
    gates = torch.randn(5, layers.weight_ih_l0.size(0))
    rest = torch.randn(5, 1, 4)  # the inputs after the looked-up ones
    h = torch.randn(2, 5, 6)
    state = (h, torch.randn_like(h)) if rnn == "lstm" else h
    fast = FastPaths()
    with torch.no_grad():
        got = fast.step_rnn(layers, rest, state, False, gates)
        assert len(calls) == 2  # one per layer
        want = cells.rnn_step(layers, rest, state, gates)  # torch's ops
    for a, b in zip(
        [got[0], *(got[1] if isinstance(got[1], tuple) else (got[1],))],
        [want[0], *(want[1] if isinstance(want[1], tuple) else (want[1],))],
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls.clear()
    out, _ = fast.step_rnn(layers, rest, state, False, gates)
    assert not calls and out.requires_grad
    with torch.no_grad():
        fast.step_rnn(layers, rest, state, True, gates)
    assert not calls


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
    restricted: bool, rnn: str, tabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam search (3 best of beam 4) and greedy search of a float32 model, with a shortlist's
    columns and without: the compiled log-softmax and top-k, and with a table the prepared
    products (W_o, W_hh, W_c), against torch's ops without search's
    tables (``native_kernels=False, search_tables=False``, the same weights) give the same
    tokens, and the scores to float32's round-off."""
    monkeypatch.setattr(topk, "NATIVE_MIN", 0)  # the kernel for this tiny model's rows too
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
        # the decoder's table of input gates, as a Translator makes it: search's RNN steps
        # through fast.cells, the cell kernel where native
        # and the step's products, from oneDNN's layouts for the fast model
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
