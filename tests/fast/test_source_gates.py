"""The encoder's RNN in search (``FastPaths.source_rnn``): its first layer's input gates
looked up in a table (``recurrence.gate_table``), the recurrence as training's, in float32
against each sentence run alone through the GRU equations and against the packed module in
float64, with random weights and padded batches in no particular order; where the table is
made; and through the encoder."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from nmt.fast import FastPaths, cells, compiled, recurrence
from nmt.fast.recurrence import plain_rnn
from nmt.model import build_model
from nmt.vocab import PAD_ID

needs_kernels = pytest.mark.skipif(
    compiled.library() is None, reason="no compiled kernels: search reads the source as it is"
)
FAST = FastPaths()


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


def _looked_up(embed: nn.Embedding, rnn: nn.RNNBase, src: Tensor, lengths: Tensor):
    """Search's encoder RNN over src through float32 copies of a float64 embedding and RNN."""
    embed, rnn = copy.deepcopy(embed).float(), copy.deepcopy(rnn).float()
    table = FAST.source_gates(embed, rnn)
    assert table is not None
    with torch.no_grad():
        return FAST.source_rnn(rnn, table, src, lengths)


@needs_kernels
def test_each_sentence_reads_as_the_gru_equations_alone_give_it() -> None:
    embed, rnn, src, lengths = _setup(nn.GRU, 1, True, torch.float64)
    outputs, hidden = _looked_up(embed, rnn, src, lengths)
    assert isinstance(hidden, Tensor) and outputs.dtype == torch.float32
    with torch.no_grad():
        for b, length in enumerate(lengths.tolist()):
            x = embed(src[b, :length])  # (T, E)
            forward, last_forward = _gru_alone(rnn, x, "")
            backward, last_backward = _gru_alone(rnn, x.flip(0), "_reverse")
            want = torch.cat([forward, backward.flip(0)], dim=-1)  # (T, 2H) in time order
            torch.testing.assert_close(outputs[b, :length].double(), want, rtol=1e-5, atol=1e-5)
            assert bool((outputs[b, length:] == 0).all())  # zero past the end
            torch.testing.assert_close(hidden[0, b].double(), last_forward, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden[1, b].double(), last_backward, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_table_reads_a_batch_as_the_packed_module(
    kind: type[nn.RNNBase], layers: int, bidirectional: bool
) -> None:
    embed, rnn, src, lengths = _setup(kind, layers, bidirectional, torch.float64)
    with torch.no_grad():
        want_out, want_state = plain_rnn(rnn, embed(src), lengths, None)
    got_out, got_state = _looked_up(embed, rnn, src, lengths)
    assert got_out.dtype == torch.float32
    torch.testing.assert_close(got_out.double(), want_out, rtol=1e-5, atol=1e-5)
    wants = want_state if isinstance(want_state, tuple) else (want_state,)
    gots = got_state if isinstance(got_state, tuple) else (got_state,)
    assert len(gots) == len(wants) == (2 if kind is nn.LSTM else 1)
    for got, want in zip(gots, wants, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_table_holds_each_pieces_input_gates_in_loop_order(kind: type[nn.RNNBase]) -> None:
    """gate_table and looked_up against W_i E_x + b_i (+ b_h's parts the layer joins: an
    LSTM's all, a GRU's r and z) in float64, the backward direction's steps reversed."""
    embed, rnn, src, _ = _setup(kind, 1, True, torch.float64)
    rnn32 = copy.deepcopy(rnn).float()
    table = recurrence.gate_table(copy.deepcopy(embed).float(), rnn32)
    assert table is not None and table.shape == (2, 11, (4 if kind is nn.LSTM else 3) * 7)
    gates = recurrence.looked_up(table, src)  # (D, T, B, G*H)
    assert gates.dtype == torch.float32
    with torch.no_grad():
        for d, suffix in enumerate(["", "_reverse"]):
            w_ih, b_ih = getattr(rnn, f"weight_ih_l0{suffix}"), getattr(rnn, f"bias_ih_l0{suffix}")
            b_hh = getattr(rnn, f"bias_hh_l0{suffix}").clone()
            if kind is nn.GRU:
                b_hh[14:] = 0  # b_hn stays inside r * (W_hn h + b_hn)
            want = embed(src) @ w_ih.t() + b_ih + b_hh  # (B, T, G*H) in time order
            want = want.transpose(0, 1)  # (T, B, G*H)
            want = want.flip(0) if d else want
            torch.testing.assert_close(gates[d].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):  # the looked-up gates are for search alone
        recurrence.run_rnn(rnn32, None, None, None, gates)


@needs_kernels
def test_the_table_is_made_only_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    embed, rnn, _, _ = _setup(nn.GRU, 1, True, torch.float32)
    assert FAST.source_gates(embed, rnn) is not None
    monkeypatch.setattr(recurrence, "TABLE_LIMIT", 11 * 21 - 1)  # V x 3H, one value short
    assert FAST.source_gates(embed, rnn) is None
    monkeypatch.undo()
    assert recurrence.TABLE_LIMIT == cells.TABLE_LIMIT
    assert FAST.source_gates(embed.double(), rnn) is None  # dtypes
    assert FAST.source_gates(embed, nn.GRU(5, 7)) is None  # time first
    assert FAST.source_gates(embed, nn.RNN(5, 7, batch_first=True)) is None  # no such cell
    assert FastPaths.plain().source_gates(embed, rnn) is None
    from dataclasses import replace

    assert replace(FAST, native_kernels=False).source_gates(embed, rnn) is None


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


@needs_kernels
@pytest.mark.parametrize(("rnn", "layers"), [("gru", 1), ("lstm", 2)])
def test_the_encoder_with_its_table_is_the_encoder(rnn: str, layers: int) -> None:
    from nmt.config import from_dict

    torch.manual_seed(3)
    model = build_model(from_dict(_config(rnn, layers)).model, 16, 16).eval()
    lengths = torch.tensor([2, 5, 4])
    src = torch.randint(4, 16, (3, 5)).masked_fill(torch.arange(5) >= lengths[:, None], PAD_ID)
    table = model.encoder.gate_table()
    assert table is not None
    with torch.no_grad():
        want = model.encoder(src, lengths)
        got = model.encoder(src, lengths, table)
    torch.testing.assert_close(got.outputs, want.outputs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-6)
    if want.cell is not None:
        assert got.cell is not None
        torch.testing.assert_close(got.cell, want.cell, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.mask, want.mask)
    model.train()
    with pytest.raises(AssertionError):
        model.encoder(src, lengths, table)
