"""A search's folded W_c (``LuongDecoder.for_search``, ``FastPaths.search_tables``): over a
memory its beams share, and over a greedy search's memory on a CPU, Luong's step with W_c's
context half multiplied into the values once equals the step that multiplies every context,
in float64, for every score that shares the beams' memory, with and without input feeding,
padding in the source and sentences dropped (the folded values standing in for the values,
copied once); the memories it leaves alone; and beam and
greedy search's hypotheses with it and without."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nmt.config import DecodingConfig, from_dict
from nmt.data.batching import pad
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.search import beam_search, greedy_search
from nmt.model import Seq2Seq, build_model

VOCAB, BEAMS = 17, 3


def _model(score: str, feeding: bool, folded: bool = True) -> Seq2Seq:
    raw = {
        "embedding_size": 5,
        "encoder": {"hidden_size": 4},  # bidirectional: values 8 wide, as the decoder's h
        "decoder": {"style": "luong", "hidden_size": 8, "input_feeding": feeding},
        "attention": {"score": score},
    }
    torch.manual_seed(len(score) + feeding)
    model = build_model(from_dict({"model": raw}).model, VOCAB, VOCAB).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    model.decoder.fast = replace(model.decoder.fast, search_tables=folded)
    return model


def _source() -> tuple[torch.Tensor, torch.Tensor]:
    rows = [[5, 9, 4, 11, 6], [7, 8], [12, 4, 13]]
    return pad(rows), torch.tensor([len(r) for r in rows])


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "general", "cosine"])
@pytest.mark.parametrize("feeding", [False, True])
@pytest.mark.parametrize("beams", [BEAMS, 1], ids=["beams", "greedy"])
def test_the_folded_step_is_the_step(score: str, feeding: bool, beams: int) -> None:
    model = _model(score, feeding)
    src, lengths = _source()
    index = torch.arange(3).repeat_interleave(beams)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        shared = memory.shared(beams) if beams > 1 else memory
        folded = model.decoder.for_search(shared, greedy=beams == 1)
        assert folded.folded is not None and shared.folded is None
        assert folded.values is folded.folded  # they stand in for the values
        state = model.decoder.reorder(state, index)
        states = {"plain": state, "folded": state}
        memories = {"plain": shared, "folded": folded}
        for step in range(4):
            if step == 2:  # sentence 1 is done: rows of sentences 0 and 2 stay
                kept = torch.tensor([0, 1, 2, 6, 7, 8] if beams > 1 else [0, 2])
                memories = {k: m.index_select(kept) for k, m in memories.items()}
                states = {k: s.index_select(kept) for k, s in states.items()}
                assert memories["folded"].folded is not None
                assert memories["folded"].values is memories["folded"].folded  # one copy
            rows = memories["plain"].row_mask.size(0)
            prev = torch.randint(4, VOCAB, (rows,), generator=generator)
            out = {}
            for kind in ("plain", "folded"):
                features, alphas, states[kind] = model.decoder.step(
                    prev, memories[kind], states[kind]
                )
                out[kind] = (features, alphas)
            torch.testing.assert_close(out["folded"][0], out["plain"][0], rtol=0, atol=1e-12)
            torch.testing.assert_close(out["folded"][1], out["plain"][1], rtol=0, atol=1e-12)


def test_what_it_leaves_alone() -> None:
    """A memory of one row per sentence that is not a greedy search's, a greedy search's
    off a CPU, a memory copied per beam (a score that does not share it: additive), and the
    plain path's: none is folded."""
    src, lengths = _source()
    with torch.no_grad():
        model = _model("general", False)
        memory, _ = model.encode(src, lengths)
        assert model.decoder.for_search(memory).folded is None
        meta = replace(memory, values=memory.values.to("meta"))
        assert model.decoder.for_search(meta, greedy=True).folded is None
        plain = _model("general", False, folded=False)
        shared = plain.encode(src, lengths)[0].shared(BEAMS)
        assert plain.decoder.for_search(shared).folded is None
        assert plain.decoder.for_search(memory, greedy=True).folded is None
        additive = _model("additive", False)
        copied = additive.encode(src, lengths)[0].index_select(torch.arange(3).repeat(2))
        assert additive.decoder.for_search(copied).folded is None


@pytest.mark.parametrize("feeding", [False, True])
def test_beam_search_finds_the_same_hypotheses(feeding: bool) -> None:
    """3 best of beam 4 with a length penalty, float64: the same tokens, scores to
    round-off, with the fold and without."""
    src, lengths = _source()
    decoding = DecodingConfig(beam_size=4, length_penalty=0.8, max_len_ratio=2.0)
    results = []
    for folded in (True, False):
        model = _model("general", feeding, folded=folded)
        results.append(beam_search(Ensemble([model]), src, lengths, decoding, n_best=3))
    for got, want in zip(*results, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        for g, w in zip(got, want, strict=True):
            assert g.score == pytest.approx(w.score, rel=1e-10, abs=1e-12)
    assert len({len(h.tokens) for hyps in results[0] for h in hyps}) > 1


@pytest.mark.parametrize("feeding", [False, True])
def test_greedy_search_finds_the_same_outputs(feeding: bool) -> None:
    """Greedy search steps a folded memory on a CPU (``Ensemble.encode``): the same tokens
    and scores to round-off as without the fold, in float64."""
    src, lengths = _source()
    decoding = DecodingConfig(beam_size=1, max_len_ratio=2.0)
    results = []
    for folded in (True, False):
        model = _model("general", feeding, folded=folded)
        ensemble = Ensemble([model])
        memory = ensemble.encode(src, lengths).memories[0]
        assert (memory.folded is not None) == folded
        results.append(greedy_search(ensemble, src, lengths, decoding))
    for got, want in zip(*results, strict=True):
        assert got.tokens == want.tokens
        assert got.score == pytest.approx(want.score, rel=1e-10, abs=1e-12)
    assert len({len(h.tokens) for h in results[0]}) > 1
