"""Greedy and beam search against plain references: exhaustive enumeration on a six-symbol
vocabulary, teacher-forced rescoring, batch invariance and the length limits."""

from __future__ import annotations

import math

import pytest
import torch
from decode import run_beam, run_greedy
from searchref import enumerate_outputs as _enumerate
from searchref import limit as _limit
from searchref import model as _model
from searchref import sequence_log_probs
from searchref import source as _source

from nmt.data.tokenizer import BOS_ID, EOS_ID
from nmt.decoding.search import length_penalty
from nmt.decoding.steering import block_repeated_ngrams, search_limits
from nmt.model import Seq2Seq

VOCAB = 6  # PAD UNK BOS EOS + two words
RATIO = 1e-3  # ceil(S * ratio) = 1 for any S here, so the limit is 1 + offset


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize(
    ("style", "feeding"),
    [("bahdanau", True), ("luong", True), ("luong", False)],
    ids=["bahdanau", "luong-feed", "luong"],
)
def test_exhaustive_beam_finds_every_output_in_order(style, feeding, alpha) -> None:
    """With K >= 6 * 5^(limit-2) no candidate is ever pruned, so the finished list must be
    exactly all outputs up to the limit, each scored sum(log p) / lp(|y|+1)."""
    model = _model(VOCAB, seed=11, style=style, feeding=feeding)
    src, src_lengths = _source([4, 2, 3], VOCAB, seed=1)
    offset = 3
    limit = 4
    assert all(_limit(n, RATIO, offset) == limit for n in src_lengths.tolist())
    candidates = _enumerate(VOCAB, limit - 1)  # 1 + 5 + 25 + 125 = 156
    beam = 6 * 5 ** (limit - 2)
    results = run_beam(
        model,
        src,
        src_lengths,
        beam_size=beam,
        alpha=alpha,
        max_len_ratio=RATIO,
        max_len_offset=offset,
        n_best=len(candidates),
    )
    for b, hyps in enumerate(results):
        scores = sequence_log_probs([model], src[b : b + 1, : int(src_lengths[b])], candidates)
        expected = {y: s / length_penalty(len(y) + 1, alpha) for y, s in scores.items()}
        found = {tuple(h.tokens): h.score for h in hyps}
        assert len(found) == len(hyps) == len(candidates)
        assert found.keys() == expected.keys()
        for y, score in found.items():
            assert score == pytest.approx(expected[y], abs=1e-4)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        best = max(expected, key=expected.get)
        assert tuple(hyps[0].tokens) == best


@pytest.mark.parametrize("beam", [8, 16])
@pytest.mark.parametrize(
    ("style", "seed"), [("bahdanau", 0), ("bahdanau", 4), ("luong", 0), ("luong", 6)]
)
def test_wide_beam_finds_the_exhaustive_best(style: str, seed: int, beam: int) -> None:
    """Not guaranteed for every model (the beam prunes), but on these the best output is not
    the greedy one and not empty, and an 8- or 16-wide beam must find it with its score."""
    model = _model(VOCAB, seed=seed, style=style, sharpen=16.0, eos=0.3)
    src, src_lengths = _source([5, 3], VOCAB, seed=seed)
    offset = 4
    candidates = _enumerate(VOCAB, _limit(5, RATIO, offset) - 1)  # up to 4 symbols: 781
    options = {"max_len_ratio": RATIO, "max_len_offset": offset}
    results = run_beam(model, src, src_lengths, beam_size=beam, alpha=0.0, **options)
    greedy = run_greedy(model, src, src_lengths, **options)
    beam_mattered = False
    for b, hyps in enumerate(results):
        scores = sequence_log_probs([model], src[b : b + 1, : int(src_lengths[b])], candidates)
        best = max(scores, key=scores.get)
        assert tuple(hyps[0].tokens) == best
        assert hyps[0].score == pytest.approx(scores[best], abs=1e-4)
        beam_mattered |= len(best) > 0 and tuple(greedy[b].tokens) != best
    assert beam_mattered  # precondition: the search problem is not trivial


def test_length_penalty_formula() -> None:
    for length in (1, 2, 7, 30):
        for alpha in (0.0, 0.6, 1.0, 2.0):
            assert length_penalty(length, alpha) == pytest.approx(((5 + length) / 6) ** alpha)
    assert length_penalty(1, 1.0) == 1.0 and length_penalty(7, 1.0) == 2.0


def test_search_limits_formula() -> None:
    """ceil(ratio |x|) + offset, at least 1, for the ratios whose float product rounds."""
    lengths = torch.tensor([1, 2, 3, 10])
    for ratio, offset in [(1.5, 10), (1.0, 0), (0.34, 2), (RATIO, 0), (0.5, -3)]:
        expected = [_limit(n, ratio, offset) for n in lengths.tolist()]
        assert search_limits(lengths, ratio, offset, None) == expected


BIG_VOCAB = 9
LENGTHS = [6, 2, 4, 3, 5, 1]  # with seed 0 and eos=2.0: some end after a word, some hit the limit


def _greedy_reference(model: Seq2Seq, src: torch.Tensor, limit: int):
    """Argmax step by step for one sentence, EOS forced at the limit (as beam search does)."""
    memory, state = model.encode(src, torch.tensor([src.size(1)]))
    prev, tokens, total = torch.tensor([BOS_ID]), [], 0.0
    for length in range(1, limit + 1):
        features, _, state = model.decoder.step(prev, memory, state)
        log_probs = model.log_probs(features)[0]
        token = EOS_ID if length == limit else int(log_probs.argmax())
        total += float(log_probs[token])
        if token == EOS_ID:
            return tokens, total
        tokens.append(token)
        prev = torch.tensor([token])
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("style", "seed", "eos"), [("bahdanau", 0, 2.0), ("luong", 2, 1.5)])
def test_beam_one_equals_greedy_when_eos_comes_first(style: str, seed: int, eos: float) -> None:
    """K = 1 through the beam machinery (n_best=2 avoids the greedy fast path)."""
    model = _model(BIG_VOCAB, seed=seed, style=style, eos=eos)
    src, src_lengths = _source(LENGTHS, BIG_VOCAB, seed=seed)
    ratio, offset = 1.0, 3
    greedy = run_greedy(model, src, src_lengths, ratio, offset, alpha=0.0)
    beam = run_beam(model, src, src_lengths, 1, 0.0, ratio, offset, n_best=2)
    checked = 0
    with torch.no_grad():
        for b, n in enumerate(LENGTHS):
            limit = _limit(n, ratio, offset)
            ref_tokens, ref_score = _greedy_reference(model, src[b : b + 1, :n], limit)
            assert len(beam[b]) == 1  # with K = 1 only the greedy path can finish
            assert beam[b][0].tokens == ref_tokens
            assert beam[b][0].score == pytest.approx(ref_score, abs=1e-5)
            if 0 < len(ref_tokens) < limit - 1:  # EOS chosen freely, before the limit
                assert greedy[b].tokens == ref_tokens
                assert greedy[b].score == pytest.approx(ref_score, abs=1e-5)
                checked += 1
    assert checked >= 2  # precondition: some sentences end by themselves


def test_greedy_respects_the_same_limit_as_beam() -> None:
    model = _model(BIG_VOCAB, seed=0, eos=2.0)
    src, src_lengths = _source(LENGTHS, BIG_VOCAB, seed=0)
    ratio, offset = 1.0, 3
    greedy = run_greedy(model, src, src_lengths, ratio, offset, alpha=0.0)
    beam = run_beam(model, src, src_lengths, 1, 0.0, ratio, offset, n_best=2)
    limits = [_limit(n, ratio, offset) for n in LENGTHS]
    assert any(len(h[0].tokens) + 1 == limit for h, limit in zip(beam, limits, strict=True))
    for b, n in enumerate(LENGTHS):
        assert len(greedy[b].tokens) + 1 <= _limit(n, ratio, offset)
        assert greedy[b].tokens == beam[b][0].tokens
        assert greedy[b].score == pytest.approx(beam[b][0].score, abs=1e-5)


def test_beam_one_fast_path_applies_length_penalty() -> None:
    model = _model(BIG_VOCAB, seed=0, eos=2.0)
    src, src_lengths = _source(LENGTHS, BIG_VOCAB, seed=0)
    fast = run_beam(model, src, src_lengths, 1, 1.0, 1.0, 3)
    general = run_beam(model, src, src_lengths, 1, 1.0, 1.0, 3, n_best=2)
    checked = 0
    for b, n in enumerate(LENGTHS):
        if 0 < len(general[b][0].tokens) < _limit(n, 1.0, 3) - 1:  # ended before the limit
            assert fast[b][0].tokens == general[b][0].tokens
            assert fast[b][0].score == pytest.approx(general[b][0].score, abs=1e-5)
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize(
    ("style", "feeding"), [("bahdanau", True), ("luong", True), ("luong", False)]
)
def test_beam_is_batch_invariant(style: str, feeding: bool) -> None:
    model = _model(BIG_VOCAB, seed=5, style=style, feeding=feeding)
    lengths = [7, 2, 5, 3]
    src, src_lengths = _source(lengths, BIG_VOCAB, seed=6)
    options = {"beam_size": 4, "alpha": 1.0, "max_len_ratio": 1.5, "max_len_offset": 3, "n_best": 4}
    batched = run_beam(model, src, src_lengths, **options)
    for b, n in enumerate(lengths):
        alone = run_beam(model, src[b : b + 1, :n], src_lengths[b : b + 1], **options)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        for x, y in zip(alone, batched[b], strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-5)


def test_greedy_is_batch_invariant() -> None:
    model = _model(BIG_VOCAB, seed=7)
    lengths = [7, 2, 5, 3]
    src, src_lengths = _source(lengths, BIG_VOCAB, seed=8)
    batched = run_greedy(model, src, src_lengths, 1.5, 3)
    for b, n in enumerate(lengths):
        alone = run_greedy(model, src[b : b + 1, :n], src_lengths[b : b + 1], 1.5, 3)[0]
        assert alone.tokens == batched[b].tokens
        assert alone.score == pytest.approx(batched[b].score, abs=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_n_best_scores_and_attention_match_teacher_forcing(alpha: float) -> None:
    model = _model(BIG_VOCAB, seed=9)
    lengths = [6, 3, 4]
    src, src_lengths = _source(lengths, BIG_VOCAB, seed=10)
    results = run_beam(
        model,
        src,
        src_lengths,
        beam_size=5,
        alpha=alpha,
        max_len_ratio=1.0,
        max_len_offset=3,
        n_best=5,
        return_attention=True,
    )
    for b, (hyps, n) in enumerate(zip(results, lengths, strict=True)):
        assert 1 <= len(hyps) <= 5
        assert len({tuple(h.tokens) for h in hyps}) == len(hyps)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        raw = sequence_log_probs([model], src[b : b + 1, :n], [tuple(h.tokens) for h in hyps])
        for h in hyps:
            expected = raw[tuple(h.tokens)] / length_penalty(len(h.tokens) + 1, alpha)
            assert h.score == pytest.approx(expected, abs=1e-4)
            with torch.no_grad():
                trg_in = torch.tensor([[BOS_ID, *h.tokens]])
                _, alphas = model(src[b : b + 1, :n], src_lengths[b : b + 1], trg_in)
            assert h.alphas is not None and h.alphas.shape == (len(h.tokens) + 1, src.size(1))
            torch.testing.assert_close(h.alphas[:, :n], alphas[0], atol=1e-5, rtol=0)
            assert torch.all(h.alphas[:, n:] == 0)


@pytest.mark.parametrize(("ratio", "offset"), [(0.5, 1), (1.0, 0), (1.5, 2)])
def test_beam_respects_max_length(ratio: float, offset: int) -> None:
    model = _model(BIG_VOCAB, seed=12)
    lengths = [6, 1, 4, 3]
    src, src_lengths = _source(lengths, BIG_VOCAB, seed=13)
    results = run_beam(
        model,
        src,
        src_lengths,
        beam_size=3,
        alpha=1.0,
        max_len_ratio=ratio,
        max_len_offset=offset,
        n_best=3,
    )
    at_limit = 0
    for hyps, n in zip(results, lengths, strict=True):
        limit = _limit(n, ratio, offset)
        for h in hyps:
            assert len(h.tokens) + 1 <= limit  # + 1 for the EOS
            at_limit += len(h.tokens) + 1 == limit
    assert at_limit > 0  # the limit was actually reached, so it was tested


def _has_repeat(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


def test_block_repeated_ngrams_by_hand() -> None:
    history = torch.tensor([[5, 6, 7, 5, 6], [4, 4, 4, 4, 4], [5, 6, 7, 8, 9]])
    log_probs = torch.zeros(3, 10)
    block_repeated_ngrams(log_probs, history, 3)
    banned = [set(torch.nonzero(row == -math.inf).flatten().tolist()) for row in log_probs]
    assert banned == [{7}, {4}, set()]  # "5 6" was followed by 7; "4 4" by 4; no repeat
    unigram = torch.zeros(1, 10)
    block_repeated_ngrams(unigram, torch.tensor([[5, 8]]), 1)
    assert set(torch.nonzero(unigram[0] == -math.inf).flatten().tolist()) == {5, 8}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_output_repeats_a_blocked_ngram(n: int) -> None:
    """A model that loves repeating itself cannot, with blocking, in greedy or beam search."""
    model = _model(BIG_VOCAB, seed=3, eos=0.0)
    src, src_lengths = _source([6, 4, 5], BIG_VOCAB, seed=3)
    plain = run_greedy(model, src, src_lengths, 2.0, 6)
    assert any(_has_repeat(h.tokens, n) for h in plain)  # precondition: repeats happen
    greedy = run_greedy(model, src, src_lengths, 2.0, 6, no_repeat_ngram=n)
    beam = run_beam(model, src, src_lengths, 3, 1.0, 2.0, 6, n_best=3, no_repeat_ngram=n)
    for hyp in [*greedy, *(h for hyps in beam for h in hyps)]:
        assert not _has_repeat(hyp.tokens, n), hyp.tokens
