"""Target prefixes and lexical constraints in greedy and beam search: what every output must
satisfy, what is left unchanged for sentences without them, the scores against float64
teacher forcing, the length limits, and exhaustive enumeration on a six-symbol vocabulary."""

from __future__ import annotations

import random

import pytest
import torch
from searchref import (
    contains,
    enumerate_outputs,
    forced,
    limit,
    lp,
    model,
    options,
    sequence_log_probs,
    source,
)

from nmt.decoding.search import beam_search, greedy_search
from nmt.decoding.steering import Steering, search_limits

VOCAB = 10
LENGTHS = [5, 3, 4, 2, 6]
PREFIXES = [[4, 5], [], [7], [], [6, 6, 8]]


def _same(a, b) -> None:
    """Two hypothesis lists are bit for bit the same (tokens, scores, log-probs, attention)."""
    assert [(h.tokens, h.score, h.log_prob) for h in a] == [
        (h.tokens, h.score, h.log_prob) for h in b
    ]
    for x, y in zip(a, b, strict=True):
        assert (x.alphas is None) == (y.alphas is None)
        assert x.alphas is None or torch.equal(x.alphas, y.alphas)


def _check_scores(m, src, src_lengths, b: int, h, alpha: float) -> None:
    """h's log_prob is the float64 teacher-forced log P(tokens EOS | x); score is it / lp."""
    n = int(src_lengths[b])
    log_prob, _ = forced([m], src[b : b + 1, :n], h.tokens)
    assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
    assert h.score == pytest.approx(log_prob / lp(len(h.tokens) + 1, alpha), abs=1e-4)


def test_search_limits_add_the_forced_tokens() -> None:
    """search_limits = ceil(ratio |x|) + offset, plus prefix and constraint-phrase tokens."""
    lengths = torch.tensor([1, 4, 7])
    base = [limit(n, 1.5, 2) for n in lengths.tolist()]
    assert search_limits(lengths, 1.5, 2, None) == base
    assert search_limits(lengths, 1.5, 2, Steering()) == base
    prefixes = [[4], [], [5, 6, 7]]
    assert search_limits(lengths, 1.5, 2, Steering(prefixes)) == [base[0] + 1, base[1], base[2] + 3]
    constraints = [[[4, 5], [6]], [], [[8]]]
    steering = Steering(prefixes, constraints)
    assert search_limits(lengths, 1.5, 2, steering) == [base[0] + 4, base[1], base[2] + 4]
    assert search_limits(lengths, 1.5, 2, Steering(None, constraints)) == [
        base[0] + 3,
        base[1],
        base[2] + 1,
    ]


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_greedy_prefixes(style: str) -> None:
    """Greedy outputs start with their prefix, scored by teacher forcing; empty prefix = plain."""
    m = model(VOCAB, seed=1, style=style)
    src, src_lengths = source(LENGTHS, VOCAB, seed=2)
    alpha = 0.6
    cfg = options(beam_size=1, alpha=alpha, ratio=1.0, offset=2)
    plain = greedy_search(m, src, src_lengths, cfg, return_attention=True)
    steered = greedy_search(m, src, src_lengths, cfg, return_attention=True, prefixes=PREFIXES)
    via_beam = beam_search(m, src, src_lengths, cfg, steering=Steering(PREFIXES))
    changed = 0
    for b, prefix in enumerate(PREFIXES):
        h = steered[b]
        assert h.tokens[: len(prefix)] == prefix
        assert len(h.tokens) + 1 <= limit(LENGTHS[b], 1.0, 2) + len(prefix)
        _check_scores(m, src, src_lengths, b, h, alpha)
        fast = via_beam[b][0]  # beam size 1: the same greedy search
        assert (fast.tokens, fast.score, fast.log_prob) == (h.tokens, h.score, h.log_prob)
        if not prefix:
            _same([h], [plain[b]])
        else:
            changed += plain[b].tokens[: len(prefix)] != prefix
    assert changed > 0  # precondition: the prefixes are not what the model outputs anyway


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_beam_prefixes(style: str, alpha: float) -> None:
    """Every n-best output starts with its prefix, scored by teacher forcing; empty prefix = plain."""
    m = model(VOCAB, seed=3, style=style)
    src, src_lengths = source(LENGTHS, VOCAB, seed=4)
    cfg = options(beam_size=4, alpha=alpha, ratio=1.0, offset=2)
    plain = beam_search(m, src, src_lengths, cfg, n_best=4, return_attention=True)
    steering = Steering(PREFIXES)
    steered = beam_search(
        m, src, src_lengths, cfg, n_best=4, return_attention=True, steering=steering
    )
    changed = 0
    for b, prefix in enumerate(PREFIXES):
        hyps = steered[b]
        assert 1 <= len(hyps) <= 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert h.tokens[: len(prefix)] == prefix
            assert len(h.tokens) + 1 <= limit(LENGTHS[b], 1.0, 2) + len(prefix)
            _check_scores(m, src, src_lengths, b, h, alpha)
        if not prefix:
            _same(hyps, plain[b])
        else:
            changed += any(h.tokens[: len(prefix)] != prefix for h in plain[b])
    assert changed > 0


def test_prefix_tokens_do_not_eat_the_length_budget() -> None:
    """A model that never ends by itself reaches exactly ceil(ratio |x|) + offset + |prefix|."""
    m = model(VOCAB, seed=3, eos=-1.0)
    src, src_lengths = source(LENGTHS, VOCAB, seed=3)
    cfg = options(beam_size=1, alpha=1.0, ratio=1.0, offset=2)
    greedy = greedy_search(m, src, src_lengths, cfg, prefixes=PREFIXES)
    beam = beam_search(m, src, src_lengths, options(3, 1.0, 1.0, 2), 3, steering=Steering(PREFIXES))
    for b, prefix in enumerate(PREFIXES):
        full = limit(LENGTHS[b], 1.0, 2) + len(prefix)
        assert len(greedy[b].tokens) + 1 == full
        assert max(len(h.tokens) for h in beam[b]) + 1 == full


SMALL = 6  # PAD UNK BOS EOS + two words
RATIO = 1e-3  # ceil(S * ratio) = 1 for any S here, so the base limit is 1 + offset


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_exhaustive_beam_with_a_prefix(alpha: float) -> None:
    """With K = 150 nothing is pruned: the finished list is every prefix + y, |y| <= 3, each
    scored by float64 teacher forcing / lp, best first."""
    m = model(SMALL, seed=11, style="luong")
    src, src_lengths = source([4, 2], SMALL, seed=1)
    prefixes = [[5, 4], [4]]
    cfg = options(beam_size=150, alpha=alpha, ratio=RATIO, offset=3)
    results = beam_search(m, src, src_lengths, cfg, n_best=1000, steering=Steering(prefixes))
    for b, prefix in enumerate(prefixes):
        candidates = [(*prefix, *y) for y in enumerate_outputs(SMALL, 3)]
        raw = sequence_log_probs([m], src[b : b + 1, : int(src_lengths[b])], candidates)
        expected = {y: s / lp(len(y) + 1, alpha) for y, s in raw.items()}
        found = {tuple(h.tokens): h.score for h in results[b]}
        assert len(found) == len(results[b]) and found.keys() == expected.keys()
        for y, score in found.items():
            assert score == pytest.approx(expected[y], abs=1e-4)
        assert tuple(results[b][0].tokens) == max(expected, key=expected.get)


def _random_constraints(rng: random.Random, vocab: int) -> list[list[int]]:
    """1-3 phrases of 1-2 word tokens."""
    return [
        [rng.randrange(4, vocab) for _ in range(rng.randint(1, 2))]
        for _ in range(rng.randint(1, 3))
    ]


@pytest.mark.parametrize("seed", range(8))
def test_every_hypothesis_contains_every_phrase(seed: int) -> None:
    """Random models, constraints and beams: each n-best output contains each phrase, scores
    are float64 teacher forcing / lp, and unconstrained sentences equal the plain beam."""
    rng = random.Random(seed)
    vocab = rng.randint(8, 12)
    beam = rng.randint(3, 6)
    alpha = rng.choice([0.0, 0.6, 1.0])
    style = rng.choice(["bahdanau", "luong"])
    m = model(vocab, seed=seed, style=style)
    lengths = [rng.randint(1, 7) for _ in range(5)]
    src, src_lengths = source(lengths, vocab, seed=seed)
    constraints = [_random_constraints(rng, vocab) for _ in lengths]
    constraints[1] = []  # unconstrained sentences beside constrained ones
    constraints[3] = []
    cfg = options(beam_size=beam, alpha=alpha, ratio=1.2, offset=2)
    steering = Steering(constraints=constraints)
    results = beam_search(
        m, src, src_lengths, cfg, n_best=beam, return_attention=True, steering=steering
    )
    plain = beam_search(m, src, src_lengths, cfg, n_best=beam, return_attention=True)
    forced_in = 0
    for b, phrases in enumerate(constraints):
        hyps = results[b]
        assert 1 <= len(hyps) <= beam
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == len(hyps)
        room = limit(lengths[b], 1.2, 2) + sum(len(p) for p in phrases)
        for h in hyps:
            assert all(contains(h.tokens, p) for p in phrases), (h.tokens, phrases)
            assert len(h.tokens) + 1 <= room
            _check_scores(m, src, src_lengths, b, h, alpha)
        if not phrases:
            _same(hyps, plain[b])
        else:
            forced_in += not all(contains(plain[b][0].tokens, p) for p in phrases)
    assert forced_in > 0  # precondition: the constraints changed some output


def test_no_constraints_is_the_plain_beam_bit_for_bit() -> None:
    """steering=None, Steering() and Steering(constraints=[[], ...]) all equal the plain beam."""
    m = model(VOCAB, seed=5, style="luong")
    src, src_lengths = source(LENGTHS, VOCAB, seed=6)
    cfg = options(beam_size=4, alpha=0.6, ratio=1.0, offset=2, coverage=0.2)
    plain = beam_search(m, src, src_lengths, cfg, n_best=4, return_attention=True)
    for steering in [None, Steering(), Steering([[] for _ in LENGTHS], [[] for _ in LENGTHS])]:
        got = beam_search(
            m, src, src_lengths, cfg, n_best=4, return_attention=True, steering=steering
        )
        for a, g in zip(plain, got, strict=True):
            _same(a, g)


def test_constraint_inside_the_prefix_and_after_it() -> None:
    """Prefixes and constraints together: outputs start with the prefix and contain the phrases."""
    m = model(VOCAB, seed=7)
    lengths = [5, 3, 4]
    src, src_lengths = source(lengths, VOCAB, seed=8)
    prefixes = [[6, 7], [5], []]
    constraints = [[[7]], [[8, 9], [4]], [[6, 6]]]
    cfg = options(beam_size=5, alpha=1.0, ratio=1.0, offset=2)
    results = beam_search(
        m, src, src_lengths, cfg, n_best=5, steering=Steering(prefixes, constraints)
    )
    for b, hyps in enumerate(results):
        assert hyps
        for h in hyps:
            assert h.tokens[: len(prefixes[b])] == prefixes[b]
            assert all(contains(h.tokens, p) for p in constraints[b])
            _check_scores(m, src, src_lengths, b, h, 1.0)


def test_blocked_constraint_gives_an_empty_list() -> None:
    """no_repeat_ngram=1 makes phrase [5, 5] impossible: that sentence gets [], the others don't."""
    m = model(VOCAB, seed=9)
    lengths = [4, 3, 5]
    src, src_lengths = source(lengths, VOCAB, seed=10)
    constraints = [[[5, 5]], [[6]], []]
    cfg = options(beam_size=4, alpha=1.0, ratio=1.0, offset=2, no_repeat_ngram=1)
    results = beam_search(m, src, src_lengths, cfg, n_best=4, steering=Steering(None, constraints))
    assert results[0] == []
    assert results[1] and all(6 in h.tokens for h in results[1])
    assert results[2] == beam_search(m, src, src_lengths, cfg, n_best=4)[2]
    for h in [*results[1], *results[2]]:
        assert len(set(h.tokens)) == len(h.tokens)  # the blocking still holds


def test_constraints_need_a_beam() -> None:
    """Constraints with beam size 1 are refused with a ValueError."""
    m = model(VOCAB, seed=9)
    src, src_lengths = source([3], VOCAB, seed=10)
    with pytest.raises(ValueError, match="beam of at least 2"):
        beam_search(m, src, src_lengths, options(beam_size=1), steering=Steering(None, [[[5]]]))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize(("style", "seed"), [("bahdanau", 11), ("luong", 12)])
def test_exhaustive_constrained_beam_single_token(style: str, seed: int, alpha: float) -> None:
    """One single-token constraint, K = 150 (no pruning): the finished list is exactly every
    output up to the limit that contains the token, scored by teacher forcing / lp, best first;
    the token is one the unconstrained best output lacks."""
    m = model(SMALL, seed=seed, style=style)
    lengths = [4, 2, 3]
    src, src_lengths = source(lengths, SMALL, seed=seed)
    offset = 2  # base limit 3, + 1 constraint token: outputs of up to 3 tokens
    everything = enumerate_outputs(SMALL, 3)
    constraints, wanted = [], []
    for b, n in enumerate(lengths):
        raw = sequence_log_probs([m], src[b : b + 1, :n], everything)
        plain_best = max(
            (y for y in raw if len(y) <= 2), key=lambda y: raw[y] / lp(len(y) + 1, alpha)
        )
        token = 4 if 4 not in plain_best else 5
        assert token not in plain_best  # precondition: the constraint changes the answer
        constraints.append([[token]])
        wanted.append({y: s / lp(len(y) + 1, alpha) for y, s in raw.items() if token in y})
    cfg = options(beam_size=150, alpha=alpha, ratio=RATIO, offset=offset)
    results = beam_search(
        m, src, src_lengths, cfg, n_best=1000, steering=Steering(None, constraints)
    )
    for b, hyps in enumerate(results):
        found = {tuple(h.tokens): h.score for h in hyps}
        assert len(found) == len(hyps)
        assert found.keys() == wanted[b].keys()  # 1 + 9 + 61 outputs
        for y, score in found.items():
            assert score == pytest.approx(wanted[b][y], abs=1e-4)
        assert tuple(hyps[0].tokens) == max(wanted[b], key=wanted[b].get)


@pytest.mark.parametrize("phrase", [[4, 5], [5, 5]])
def test_exhaustive_constrained_beam_two_token_phrase(phrase: list[int]) -> None:
    """One two-token phrase, K = 400 (no pruning): the finished list is every output of up to
    4 tokens containing the phrase contiguously, each scored by teacher forcing."""
    m = model(SMALL, seed=13, style="bahdanau")
    lengths = [3, 2]
    src, src_lengths = source(lengths, SMALL, seed=13)
    cfg = options(beam_size=400, alpha=0.5, ratio=RATIO, offset=2)  # limit 3 + 2
    steering = Steering(None, [[phrase], [phrase]])
    results = beam_search(m, src, src_lengths, cfg, n_best=1000, steering=steering)
    everything = enumerate_outputs(SMALL, 4)
    for b, hyps in enumerate(results):
        raw = sequence_log_probs([m], src[b : b + 1, : lengths[b]], everything)
        wanted = {y: s / lp(len(y) + 1, 0.5) for y, s in raw.items() if contains(y, phrase)}
        found = {tuple(h.tokens): h.score for h in hyps}
        assert found.keys() == wanted.keys()
        for y, score in found.items():
            assert score == pytest.approx(wanted[y], abs=1e-4)
        assert tuple(hyps[0].tokens) == max(wanted, key=wanted.get)


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_steered_beam_is_batch_invariant(style: str) -> None:
    """Each sentence's prefixed and constrained hypotheses are the same alone as in the batch."""
    m = model(VOCAB, seed=14, style=style)
    lengths = [6, 2, 5, 3]
    src, src_lengths = source(lengths, VOCAB, seed=15)
    prefixes = [[4], [], [8, 8], []]
    constraints = [[[5, 6]], [[7], [9]], [], [[4, 4]]]
    cfg = options(beam_size=5, alpha=0.8, ratio=1.2, offset=2)
    batched = beam_search(
        m, src, src_lengths, cfg, n_best=5, steering=Steering(prefixes, constraints)
    )
    for b, n in enumerate(lengths):
        alone = beam_search(
            m,
            src[b : b + 1, :n],
            src_lengths[b : b + 1],
            cfg,
            n_best=5,
            steering=Steering([prefixes[b]], [constraints[b]]),
        )[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        for x, y in zip(alone, batched[b], strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-5)
