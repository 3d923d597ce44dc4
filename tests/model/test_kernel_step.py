"""Luong's search step through the compiled kernels (``LuongDecoder._kernel_step``): on a CPU
in float32, over a folded memory (greedy's, and the one memory beams share), it gives the
same bits as the general path (``_recur`` and ``_attend``) for GRU and LSTM, one and two
layers, with and without input feeding, and every dot-product score, with padding in the
source; a whole search takes it and finds the same outputs; float64 takes the general path."""

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
from nmt.model.luong import LuongDecoder
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
def _general_path() -> Iterator[None]:
    """The step as it runs where the kernels do not take it."""
    with mock.patch.object(LuongDecoder, "_kernels_take", lambda self, memory, state: False):
        yield


@contextmanager
def _counted() -> Iterator[list[int]]:
    """How many steps ``_kernel_step`` took (returned a step, not None)."""
    taken = [0]
    original = LuongDecoder._kernel_step

    def spy(self: LuongDecoder, *args: object) -> object:
        stepped = original(self, *args)  # type: ignore[arg-type]
        taken[0] += stepped is not None
        return stepped

    with mock.patch.object(LuongDecoder, "_kernel_step", spy):
        yield taken


NETWORKS = [("gru", 1, False), ("gru", 2, True), ("lstm", 1, False), ("lstm", 2, True)]
SCORES = [("general", "none"), ("dot", "none"), ("scaled_dot", "none"), ("general", "learned")]


@pytest.mark.parametrize(("rnn", "layers", "feeding"), NETWORKS)
@pytest.mark.parametrize(("score", "scale"), SCORES)
@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "shared-beams"])
def test_the_kernel_step_is_the_general_step_to_the_bit(
    rnn: str, layers: int, feeding: bool, score: str, scale: str, beams: int
) -> None:
    model = _model(rnn, layers, feeding, score, scale, torch.float32)
    decoder = model.decoder
    assert isinstance(decoder, LuongDecoder)
    if scale == "learned":  # a scale other than its initial 1
        with torch.no_grad():
            decoder.attention.scale.fill_(0.7)  # type: ignore[union-attr]
    products, table = decoder.search_products(), decoder.gate_table()
    assert products is not None and table is not None
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        memory, first = model.encode(src, lengths)
        if beams > 1:  # each sentence's state for its beams, its memory held once
            first = decoder.reorder(first, torch.arange(len(ROWS)).repeat_interleave(beams))
            memory = decoder.for_search(memory.shared(beams))
        else:
            memory = decoder.for_search(memory, greedy=True)
        assert memory.folded is not None
        states = {"kernels": first, "general": first}
        for _ in range(4):
            prev = torch.randint(4, VOCAB, (len(ROWS) * beams,), generator=generator)
            gates = table.index_select(0, prev)
            with _counted() as taken:
                kernels = decoder.step(prev, memory, states["kernels"], gates, products)
            assert taken == [1]
            with _general_path():
                general = decoder.step(prev, memory, states["general"], gates, products)
            for got, want in zip(kernels[:2], general[:2], strict=True):
                assert torch.equal(got, want)
            states = {"kernels": kernels[2], "general": general[2]}
            for name in ("hidden", "cell", "feed"):
                got, want = getattr(states["kernels"], name), getattr(states["general"], name)
                assert (got is None) == (want is None)
                assert got is None or torch.equal(got, want), name
            assert states["kernels"].step == states["general"].step


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_search_takes_the_kernel_step_and_finds_the_same_outputs(beam_size: int) -> None:
    model = _model("gru", 1, False, "general", "none", torch.float32)
    ensemble = Ensemble([model], tables=[_tables(model)])
    src, lengths = pad(ROWS), torch.tensor([len(r) for r in ROWS])
    decoding = DecodingConfig(beam_size=beam_size, max_len_ratio=2.0)
    with torch.no_grad():
        with _counted() as taken:
            kernels = beam_search(ensemble, src, lengths, decoding)
        with _general_path():
            general = beam_search(ensemble, src, lengths, decoding)
    assert taken[0] > 0
    for got, want in zip(kernels, general, strict=True):
        assert [(h.tokens, h.score) for h in got] == [(h.tokens, h.score) for h in want]


def test_float64_takes_the_general_path() -> None:
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
            features, alphas, _ = decoder.step(prev, memory, state, table[prev], products)
    assert taken == [0]
    assert features.dtype == torch.float64 and alphas.shape == (len(ROWS), src.size(1))


class _SharperGeneral(GeneralAttention):
    """A score that changes the math of its parent: twice the general energies. It declares
    no kernel, so it must not get its parent's."""

    def energies(self, query: torch.Tensor, memory: Memory) -> torch.Tensor:
        return 2.0 * super().energies(query, memory)


def test_a_subclass_that_changes_the_math_does_not_inherit_the_kernel() -> None:
    """Its searches take its own energies: on a CPU in float32 with the kernels' tables, the
    same outputs as the general path; and its weights are those of a float64 reference
    written from e = 2 q^T W_a k, with padding."""
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
        with _general_path():
            want = beam_search(ensemble, src, lengths, decoding, return_attention=True)
        assert taken == [0]
        assert [[h.tokens for h in hs] for hs in found] == [[h.tokens for h in hs] for hs in want]
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
        torch.testing.assert_close(got, alphas[b, : lengths[b]], atol=1e-5, rtol=1e-5)
