"""The encoder's RNN in search (nmt.fast.source_tables): looked-up first-layer gates and each
direction's loop in one compiled call, in float32 against each sentence run alone through the
GRU equations and against the packed module in float64, with random weights and padded
batches in no particular order; where the tables are made; and through the encoder."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from nmt.fast import FastPaths, cells, compiled, source_tables
from nmt.fast.recurrence import plain_rnn
from nmt.model import build_model
from nmt.vocab import PAD_ID

needs_one_call = pytest.mark.skipif(
    compiled.library() is None or compiled.blas_sgemm() is None,
    reason="no compiled kernels or no MKL sgemm in this torch: no source tables",
)


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


def _float32_tables(embed: nn.Embedding, rnn: nn.RNNBase) -> source_tables.SourceTables:
    """The tables of float32 copies of a float64 embedding and RNN."""
    tables = source_tables.source_tables(copy.deepcopy(embed).float(), copy.deepcopy(rnn).float())
    assert tables is not None
    return tables


@needs_one_call
def test_each_sentence_reads_as_the_gru_equations_alone_give_it() -> None:
    embed, rnn, src, lengths = _setup(nn.GRU, 1, True, torch.float64)
    tables = _float32_tables(embed, rnn)
    with torch.no_grad():
        outputs, hidden = tables.run(src, lengths)
        assert isinstance(hidden, Tensor) and outputs.dtype == torch.float32
        for b, length in enumerate(lengths.tolist()):
            x = embed(src[b, :length])  # (T, E)
            forward, last_forward = _gru_alone(rnn, x, "")
            backward, last_backward = _gru_alone(rnn, x.flip(0), "_reverse")
            want = torch.cat([forward, backward.flip(0)], dim=-1)  # (T, 2H) in time order
            torch.testing.assert_close(outputs[b, :length].double(), want, rtol=1e-5, atol=1e-5)
            assert bool((outputs[b, length:] == 0).all())  # zero past the end
            torch.testing.assert_close(hidden[0, b].double(), last_forward, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden[1, b].double(), last_backward, rtol=1e-5, atol=1e-5)


@needs_one_call
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_tables_read_a_batch_as_the_packed_module(
    kind: type[nn.RNNBase], layers: int, bidirectional: bool
) -> None:
    embed, rnn, src, lengths = _setup(kind, layers, bidirectional, torch.float64)
    tables = _float32_tables(embed, rnn)
    with torch.no_grad():
        want_out, want_state = plain_rnn(rnn, embed(src), lengths, None)
        got_out, got_state = tables.run(src, lengths)
    assert got_out.dtype == torch.float32
    torch.testing.assert_close(got_out.double(), want_out, rtol=1e-5, atol=1e-5)
    wants = want_state if isinstance(want_state, tuple) else (want_state,)
    gots = got_state if isinstance(got_state, tuple) else (got_state,)
    assert len(gots) == len(wants) == (2 if kind is nn.LSTM else 1)
    for got, want in zip(gots, wants, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _direction_reference(
    table: Tensor, ids: Tensor, lengths: Tensor, w_hh: Tensor, b_hh: Tensor, backward: bool
) -> tuple[Tensor, Tensor]:
    """A GRU direction over table rows, each sentence alone, in float64 from the equations ->
    outputs (B, S, H) at the positions read, zero past each end, and the last states (B, H)."""
    batch, steps = ids.shape
    hidden = w_hh.size(1)
    outputs, finals = torch.zeros(batch, steps, hidden, dtype=torch.float64), []
    for b, length in enumerate(lengths.tolist()):
        h = torch.zeros(hidden, dtype=torch.float64)
        order = range(length - 1, -1, -1) if backward else range(length)
        for p in order:
            gx, gh = table[ids[b, p]], w_hh @ h + b_hh
            r = torch.sigmoid(gx[:hidden] + gh[:hidden])
            z = torch.sigmoid(gx[hidden : 2 * hidden] + gh[hidden : 2 * hidden])
            n = torch.tanh(gx[2 * hidden :] + r * gh[2 * hidden :])
            h = (1 - z) * n + z * h
            outputs[b, p] = h
        finals.append(h)
    return outputs, torch.stack(finals)


@needs_one_call
@pytest.mark.parametrize("backward", [False, True])
def test_a_direction_in_one_call_follows_the_gru_equations(backward: bool) -> None:
    """kernels.c's loop over time against the equations in float64: rows longest first, one
    of length 0, ids past each end that no table holds (never read), the outputs a strided
    half of a layer's."""
    torch.manual_seed(5)
    vocab, hidden, steps = 13, 6, 7
    table = torch.randn(vocab, 3 * hidden, dtype=torch.float64)
    w_hh = 0.5 * torch.randn(3 * hidden, hidden, dtype=torch.float64)
    b_hh = torch.randn(3 * hidden, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 5, 2, 0])
    ids = torch.randint(0, vocab, (5, steps))
    ids = ids.masked_fill(torch.arange(steps)[None, :] >= lengths[:, None], 10**6)
    want_out, want_last = _direction_reference(table, ids, lengths, w_hh, b_hh, backward)
    layer = torch.full((5, steps, 2 * hidden), float("nan"))
    half = layer[..., hidden:]  # the second direction's half
    h = torch.full((5, hidden), float("nan"))
    direction = compiled.Direction(
        table.float(), ids, None, w_hh.t().float().contiguous(), b_hh.float(), backward
    )
    assert compiled.rnn_direction(direction, lengths, half, h, None)
    torch.testing.assert_close(half.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), want_last, rtol=1e-5, atol=1e-5)
    assert bool(layer[..., :hidden].isnan().all())  # the other half untouched


@needs_one_call
def test_a_direction_in_one_call_refuses_what_it_cannot_run() -> None:
    table, w_t, lengths = torch.randn(9, 12), torch.randn(4, 12), torch.tensor([3, 2])
    ids = torch.randint(0, 9, (2, 3))

    def run(**change: object) -> bool:
        args: dict = {"table": table, "ids": ids, "w_t": w_t, "lengths": lengths}
        args.update(change)
        direction = compiled.Direction(
            args["table"], args["ids"], None, args["w_t"], None, backward=False
        )
        out, h = torch.empty(2, 3, 4), torch.empty(2, 4)
        return compiled.rnn_direction(direction, args["lengths"], out, h, None)

    assert run()
    assert not run(table=table.double())  # float32 alone
    assert not run(w_t=torch.randn(12, 4).t())  # not contiguous
    assert not run(table=torch.randn(9, 16))  # 4H gates without an LSTM's cells
    assert not run(lengths=torch.tensor([2, 3]))  # not longest first
    assert not run(lengths=torch.tensor([4, 2]))  # longer than the steps
    assert not run(ids=ids[:, :2].contiguous())
    outside = ids.clone()
    outside[1, 1] = 9  # the table has rows 0-8; position 1 of a sentence of 2 is read
    with pytest.raises(ValueError, match="outside the table"):
        run(ids=outside)
    outside[1, 1], outside[1, 2] = 0, 9  # past that sentence's end: never read
    assert run(ids=outside)


@needs_one_call
def test_tables_are_made_only_where_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    embed, rnn, _, _ = _setup(nn.GRU, 1, True, torch.float32)
    assert source_tables.source_tables(embed, rnn) is not None
    monkeypatch.setattr(cells, "TABLE_LIMIT", 11 * 21 - 1)  # V x 3H, one value short
    assert source_tables.source_tables(embed, rnn) is None
    monkeypatch.undo()
    assert source_tables.source_tables(embed.double(), rnn) is None  # dtypes
    assert source_tables.source_tables(embed.double(), rnn.double()) is None  # float32 alone
    assert source_tables.source_tables(embed, rnn, native=False) is None
    monkeypatch.setattr(compiled, "blas_sgemm", lambda: None)  # no MKL: the module reads
    assert source_tables.source_tables(embed, rnn) is None
    monkeypatch.undo()
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


@needs_one_call
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
