"""Luong's search step as a CPU's Translator runs it in float32 (over a folded memory, greedy's
and the one memory beams share; the first layer's gates looked up; the step's products
prepared once): its attentional state, weights and RNN state are a float64 reference's from
Luong's equations, for GRU and LSTM, one and two layers, with and without input feeding,
every dot-product score, with padding in the source."""

from __future__ import annotations

import copy

import pytest
import torch

from nmt.config import from_dict
from nmt.data.batching import pad
from nmt.model import Seq2Seq, build_model
from nmt.model.decoder import Prepared
from nmt.model.luong import LuongDecoder, LuongState

VOCAB = 23
ROWS = [[5, 9, 4, 11, 6, 7], [7, 8], [12, 4, 13], [20, 21, 22, 4]]


def _model(
    rnn: str, layers: int, feeding: bool, score: str, scale: str, dtype: torch.dtype
) -> Seq2Seq:
    raw = {
        "embedding_size": 6,
        "encoder": {"rnn": rnn, "hidden_size": 5},
        "decoder": {
            "style": "luong",
            "rnn": rnn,
            "hidden_size": 10,
            "layers": layers,
            "input_feeding": feeding,
        },
        "attention": {"score": score, "scale": scale},
    }
    torch.manual_seed(layers * 7 + feeding + len(rnn + score + scale))
    model = build_model(from_dict({"model": raw}).model, VOCAB, VOCAB).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    return model


def _reference_step(
    wide: LuongDecoder,
    prev: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    state: LuongState,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Luong's step in float64 from the equations: h_t = RNN(h_{t-1}, [E y_{t-1}; h~_{t-1}]),
    a_t(s) = softmax_s(g h_t^T k_s) over the real positions (k_s = W_a h_s for general,
    h_s / sqrt(d) for scaled_dot), h~_t = tanh(W_c [c_t; h_t]) -> h~_t (B, H), a_t (B, S),
    the RNN's hidden (L, B, H) and cell."""
    embedded = wide.embed(prev)  # (B, E)
    rnn_input = embedded if state.feed is None else torch.cat([embedded, state.feed.double()], -1)
    hx = state.hidden.double()
    if state.cell is None:
        out, hidden = wide.rnn(rnn_input[:, None], hx)
        cell = None
    else:
        out, (hidden, cell) = wide.rnn(rnn_input[:, None], (hx, state.cell.double()))
    h = out[:, 0]  # (B, H)
    score = wide.attention
    keys = values @ score.key_proj.weight.T if hasattr(score, "key_proj") else values
    energies = torch.einsum("bh,bsh->bs", h, keys * score.fixed_scale)  # type: ignore[operator]
    if score.scale is not None:  # type: ignore[union-attr]
        energies = energies * score.scale  # type: ignore[union-attr]
    alphas = torch.softmax(energies.masked_fill(~mask, float("-inf")), dim=-1)  # (B, S)
    context = torch.einsum("bs,bsk->bk", alphas, values)
    attentional = torch.tanh(torch.cat([context, h], -1) @ wide.combine.weight.T)
    return attentional, alphas, hidden, cell


NETWORKS = [("gru", 1, False), ("gru", 2, True), ("lstm", 1, False), ("lstm", 2, True)]
SCORES = [("general", "none"), ("dot", "none"), ("scaled_dot", "none"), ("general", "learned")]


@pytest.mark.parametrize(("rnn", "layers", "feeding"), NETWORKS)
@pytest.mark.parametrize(("score", "scale"), SCORES)
@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "shared-beams"])
def test_the_search_step_is_the_equations_step(
    rnn: str, layers: int, feeding: bool, score: str, scale: str, beams: int
) -> None:
    model = _model(rnn, layers, feeding, score, scale, torch.float32)
    decoder = model.decoder
    assert isinstance(decoder, LuongDecoder)
    if scale == "learned":  # a scale other than its initial 1
        with torch.no_grad():
            decoder.attention.scale.fill_(0.7)  # type: ignore[union-attr]
    wide = copy.deepcopy(decoder).double()
    products, table = decoder.search_products(), decoder.gate_table()
    assert products is not None and table is not None
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        values = memory.values.double().repeat_interleave(beams, 0)  # (B*K, S, Hk)
        mask = memory.mask.repeat_interleave(beams, 0)
        if beams > 1:  # each sentence's state for its beams, its memory held once
            state = decoder.reorder(state, torch.arange(len(ROWS)).repeat_interleave(beams))
            memory = decoder.for_search(memory.shared(beams))
        else:
            memory = decoder.for_search(memory, greedy=True)
        assert memory.folded is not None
        for _ in range(4):
            prev = torch.randint(4, VOCAB, (len(ROWS) * beams,), generator=generator)
            want = _reference_step(wide, prev, values, mask, state)
            features, alphas, state = decoder.step(
                prev, memory, state, Prepared(table[prev], products)
            )
            assert isinstance(state, LuongState)
            close = {"atol": 1e-5, "rtol": 1e-4}
            torch.testing.assert_close(features.double(), want[0], **close)
            torch.testing.assert_close(alphas.double(), want[1], **close)
            assert bool((alphas[~mask] == 0).all())  # the padding
            torch.testing.assert_close(state.hidden.double(), want[2], **close)
            if want[3] is not None:
                assert state.cell is not None
                torch.testing.assert_close(state.cell.double(), want[3], **close)
            assert (state.feed is None) == (not feeding)
