"""The encoder's RNN in search (nmt.fast.source_tables): looked-up first-layer gates and the
recurrence stepped row-prefix by row-prefix, against each sentence run alone through the GRU
equations and against the packed module, in float64 with random weights and padded batches
in no particular order; then in float32 through the compiled cells, through the encoder and
through a Translator's search."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from nmt.fast import FastPaths, cells, compiled, source_tables
from nmt.fast.recurrence import plain_rnn
from nmt.model import build_model
from nmt.vocab import PAD_ID


def _setup(kind: type[nn.RNNBase], layers: int, bidirectional: bool, dtype: torch.dtype):
    torch.manual_seed(layers + 2 * bidirectional)
    embed = nn.Embedding(11, 5, padding_idx=PAD_ID).to(dtype)
    rnn = kind(5, 7, num_layers=layers, batch_first=True, bidirectional=bidirectional).to(dtype)
    with torch.no_grad():
        for param in rnn.parameters():
            param.add_(0.5 * torch.randn_like(param))
    lengths = torch.tensor([3, 6, 1, 6, 4])  # not sorted, two alike
    src = torch.randint(1, 11, (5, 7))  # one column more than the longest
    src = src.masked_fill(torch.arange(7)[None, :] >= lengths[:, None], PAD_ID)
    return embed, rnn, src, lengths


def _gru_alone(rnn: nn.GRU, x: Tensor, suffix: str) -> tuple[Tensor, Tensor]:
    """One sentence x (T, I) through one direction of a one-layer GRU, straight from the
    equations -> the states after each step (T, H) and the last."""
    w_ih, w_hh = getattr(rnn, f"weight_ih_l0{suffix}"), getattr(rnn, f"weight_hh_l0{suffix}")
    b_ih, b_hh = getattr(rnn, f"bias_ih_l0{suffix}"), getattr(rnn, f"bias_hh_l0{suffix}")
    hidden = rnn.hidden_size
    h = x.new_zeros(hidden)
    states = []
    for x_t in x:
        gx, gh = w_ih @ x_t + b_ih, w_hh @ h + b_hh
        r = torch.sigmoid(gx[:hidden] + gh[:hidden])
        z = torch.sigmoid(gx[hidden : 2 * hidden] + gh[hidden : 2 * hidden])
        n = torch.tanh(gx[2 * hidden :] + r * gh[2 * hidden :])
        h = (1 - z) * n + z * h
        states.append(h)
    return torch.stack(states), h


def test_each_sentence_reads_as_the_gru_equations_alone_give_it() -> None:
    embed, rnn, src, lengths = _setup(nn.GRU, 1, True, torch.float64)
    tables = source_tables.source_tables(embed, rnn)
    assert tables is not None
    with torch.no_grad():
        outputs, hidden = tables.run(src, lengths)
        assert isinstance(hidden, Tensor)
        for b, length in enumerate(lengths.tolist()):
            x = embed(src[b, :length])  # (T, E)
            forward, last_forward = _gru_alone(rnn, x, "")
            backward, last_backward = _gru_alone(rnn, x.flip(0), "_reverse")
            want = torch.cat([forward, backward.flip(0)], dim=-1)  # (T, 2H) in time order
            torch.testing.assert_close(outputs[b, :length], want, rtol=1e-12, atol=1e-12)
            assert bool((outputs[b, length:] == 0).all())  # zero past the end
            torch.testing.assert_close(hidden[0, b], last_forward, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(hidden[1, b], last_backward, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_tables_read_a_batch_as_the_packed_module(
    kind: type[nn.RNNBase], layers: int, bidirectional: bool
) -> None:
    embed, rnn, src, lengths = _setup(kind, layers, bidirectional, torch.float64)
    tables = source_tables.source_tables(embed, rnn)
    assert tables is not None
    with torch.no_grad():
        want_out, want_state = plain_rnn(rnn, embed(src), lengths, None)
        got_out, got_state = tables.run(src, lengths)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    wants = want_state if isinstance(want_state, tuple) else (want_state,)
    gots = got_state if isinstance(got_state, tuple) else (got_state,)
    assert len(gots) == len(wants) == (2 if kind is nn.LSTM else 1)
    for got, want in zip(gots, wants, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_float32_through_prepared_products_and_compiled_cells(kind: type[nn.RNNBase]) -> None:
    embed, rnn, src, lengths = _setup(kind, 2, True, torch.float64)
    with torch.no_grad():
        want_out, want_state = plain_rnn(rnn, embed(src), lengths, None)
    embed32, rnn32 = embed.float(), rnn.float()
    tables = source_tables.source_tables(embed32, rnn32)
    assert tables is not None
    with torch.no_grad():
        got_out, got_state = tables.run(src, lengths)
    assert got_out.dtype == torch.float32
    torch.testing.assert_close(got_out.double(), want_out, rtol=1e-5, atol=1e-5)
    wants = want_state if isinstance(want_state, tuple) else (want_state,)
    gots = got_state if isinstance(got_state, tuple) else (got_state,)
    for got, want in zip(gots, wants, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_compiled_steps_and_the_torch_ops_agree(
    kind: type[nn.RNNBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled.library() is None:
        pytest.skip("no C compiler: the cells run as torch ops alone")
    embed, rnn, src, lengths = _setup(kind, 1, True, torch.float32)
    kernels = source_tables.source_tables(embed, rnn, native=True)
    torch_ops = source_tables.source_tables(embed, rnn, native=False)
    assert kernels is not None and torch_ops is not None
    made = []
    real = compiled.cell_steps
    monkeypatch.setattr(compiled, "cell_steps", lambda *args: made.append(1) or real(*args))
    with torch.no_grad():
        got_out, got_state = kernels.run(src, lengths)
        assert len(made) == 2  # the compiled steps ran, one per direction
        want_out, want_state = torch_ops.run(src, lengths)
        assert len(made) == 2  # and not for the torch ops
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    gots = got_state if isinstance(got_state, tuple) else (got_state,)
    wants = want_state if isinstance(want_state, tuple) else (want_state,)
    for got, want in zip(gots, wants, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cell_steps_decline_what_the_kernels_cannot_run() -> None:
    gates, states = torch.zeros(4, 3, 9), torch.zeros(4, 3, 3)
    assert compiled.cell_steps(gates.double(), states.double(), None) is None
    assert compiled.cell_steps(gates.transpose(0, 1), states, None) is None  # not contiguous
    assert compiled.cell_steps(gates, states, states) is None  # 3H gates with an LSTM's cells
    assert compiled.cell_steps(torch.zeros(4, 3, 12), states[:, :2], None) is None  # rows
    if compiled.library() is not None:
        assert compiled.cell_steps(gates, states, None) is not None


def test_tables_are_made_only_where_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    embed, rnn, _, _ = _setup(nn.GRU, 1, True, torch.float32)
    assert source_tables.source_tables(embed, rnn) is not None
    monkeypatch.setattr(cells, "TABLE_LIMIT", 11 * 21 - 1)  # V x 3H, one value short
    assert source_tables.source_tables(embed, rnn) is None
    monkeypatch.undo()
    assert source_tables.source_tables(embed.double(), rnn) is None  # dtypes
    time_first = nn.GRU(5, 7)
    assert source_tables.source_tables(embed, time_first) is None
    assert FastPaths.plain().source_tables(embed, rnn) is None


def _config(rnn: str, layers: int) -> dict:
    return {
        "data": {"train": "x", "dev": "x"},
        "tokenizer": {"vocab_size": 16},
        "model": {
            "embedding_size": 6,
            "encoder": {"rnn": rnn, "hidden_size": 5, "layers": layers},
            "decoder": {"style": "luong", "rnn": rnn, "hidden_size": 8, "input_feeding": False},
            "attention": {"score": "general"},
        },
    }


@pytest.mark.parametrize(("rnn", "layers"), [("gru", 1), ("lstm", 2)])
def test_the_encoder_with_its_tables_is_the_encoder(rnn: str, layers: int) -> None:
    from nmt.config import from_dict

    torch.manual_seed(3)
    model = build_model(from_dict(_config(rnn, layers)).model, 16, 16).eval()
    lengths = torch.tensor([2, 5, 4])
    src = torch.randint(4, 16, (3, 5)).masked_fill(torch.arange(5) >= lengths[:, None], PAD_ID)
    tables = model.encoder.source_tables()
    assert tables is not None
    with torch.no_grad():
        want = model.encoder(src, lengths)
        got = model.encoder(src, lengths, tables)
    torch.testing.assert_close(got.outputs, want.outputs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-6)
    if want.cell is not None:
        assert got.cell is not None
        torch.testing.assert_close(got.cell, want.cell, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.mask, want.mask)
    model.train()
    with pytest.raises(AssertionError):
        model.encoder(src, lengths, tables)
