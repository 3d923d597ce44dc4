"""Luong's search step with the compiled kernels (the memory's ``KernelProducts``, chosen once
by ``FastPaths.search_products``): over a folded memory (greedy's, and the one memory beams
share) a score that declares the dot kernel attends through ``compiled.attend``, and the step's
RNN state, weights and attentional state are a float64 reference's from Luong's equations,
for GRU and LSTM, one and two layers, with and without input feeding, every dot-product score,
with padding in the source; a subclass that changes the math declares no kernel and attends
by its own equations; float64 takes no kernel."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from nmt.config import DecodingConfig, from_dict
from nmt.data.batching import pad
from nmt.decoding.ensemble import Ensemble, StepTables
from nmt.decoding.search import beam_search
from nmt.fast import compiled
from nmt.model import Seq2Seq, build_model
from nmt.model.attention import Memory
from nmt.model.decoder import Prepared
from nmt.model.luong import LuongDecoder, LuongState
from nmt.model.scores import GeneralAttention
from nmt.vocab import BOS_ID

pytestmark = pytest.mark.skipif(
    compiled.library() is None, reason="the compiled kernels need a C compiler"
)

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


def _tables(model: Seq2Seq) -> StepTables:
    """The search tables a CPU's Translator makes in float32 (the kernels' products)."""
    return StepTables(
        model.decoder.gate_table(),
        model.fast.product(model.generator.weight),
        model.decoder.search_products(),
    )


@contextmanager
def _counted() -> Iterator[list[int]]:
    """How many times the compiled attention kernel attended (returned weights, not None)."""
    taken = [0]
    original = compiled.attend

    def spy(*args: object) -> object:
        found = original(*args)  # type: ignore[arg-type]
        taken[0] += found is not None
        return found

    with mock.patch.object(compiled, "attend", spy):
        yield taken


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
def test_the_kernels_step_is_the_equations_step(
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
            with _counted() as taken:
                features, alphas, state = decoder.step(
                    prev, memory, state, Prepared(table[prev], products)
                )
            assert taken == [1]
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


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_search_attends_through_the_kernel(beam_size: int) -> None:
    model = _model("gru", 1, False, "general", "none", torch.float32)
    ensemble = Ensemble([model], tables=[_tables(model)])
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    decoding = DecodingConfig(beam_size=beam_size, max_len_ratio=2.0)
    with torch.no_grad(), _counted() as taken:
        found = beam_search(ensemble, src, lengths, decoding)
    assert taken[0] > 0 and len(found) == len(ROWS)


def test_float64_takes_no_kernel() -> None:
    model = _model("gru", 1, False, "general", "none", torch.float64)
    decoder = model.decoder
    products, table = decoder.search_products(), decoder.gate_table()
    assert products is not None and table is not None
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        memory = decoder.for_search(memory, greedy=True)
        prev = torch.tensor([4, 5, 6, 7])
        with _counted() as taken:
            features, alphas, _ = decoder.step(prev, memory, state, Prepared(table[prev], products))
    assert taken == [0]
    assert features.dtype == torch.float64 and alphas.shape == (len(ROWS), src.size(1))


class _SharperGeneral(GeneralAttention):
    """A score that changes the math of its parent: twice the general energies. It declares
    no kernel, so it must not get its parent's."""

    def energies(self, query: torch.Tensor, memory: Memory) -> torch.Tensor:
        return 2.0 * super().energies(query, memory)


def test_a_subclass_that_changes_the_math_does_not_inherit_the_kernel() -> None:
    """Its searches take its own energies: on a CPU in float32 with the kernels' tables, no
    compiled attention; and its weights are those of a float64 reference written from
    e = 2 q^T W_a k, with padding."""
    assert GeneralAttention.kernel == "dot" and _SharperGeneral.kernel is None
    model = _model("gru", 1, False, "general", "none", torch.float32)
    general = model.decoder.attention
    sharper = _SharperGeneral(general.query_size, general.key_size)
    sharper.load_state_dict(general.state_dict())
    model.decoder.attention = sharper
    ensemble = Ensemble([model], tables=[_tables(model)])
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    decoding = DecodingConfig(beam_size=1, max_len_ratio=2.0)
    with torch.no_grad():
        with _counted() as taken:
            found = beam_search(ensemble, src, lengths, decoding, return_attention=True)
        assert taken == [0]
        # the weights at the first output position from the equation, in float64: the
        # decoder's first hidden state h_1 (its RNN, in float64), then e = 2 h_1^T W_a k
        wide = copy.deepcopy(model).double()
        memory, state = wide.encode(src, lengths)
        bos = torch.full((len(ROWS),), BOS_ID)
        hidden = wide.decoder.step(bos, memory, state)[2].hidden[-1]  # (B, H)
        keys = memory.values @ sharper.key_proj.weight.double().T  # (B, S, H) W_a k
        energies = 2.0 * torch.einsum("bh,bsh->bs", hidden, keys)  # (B, S)
        energies = energies.masked_fill(~memory.mask, float("-inf"))
        alphas = torch.softmax(energies, dim=-1)
    for b, hyps in enumerate(found):
        got = hyps[0].alphas[0, : lengths[b]].double()
        torch.testing.assert_close(got, alphas[b, : lengths[b]], atol=1e-5, rtol=1e-4)
