"""Constraint tracking and dynamic beam allocation (Post & Vilar 2018) by hand and against a
slot-by-slot statement of the allocation rules."""

from __future__ import annotations

import itertools
import random

import pytest

from nmt.decoding.constraints import Candidate, ConstraintState, allocate, bank_sizes


def _walk(state: ConstraintState, tokens: list[int]) -> ConstraintState:
    for token in tokens:
        state = state.advance(token)
    return state


def test_start_counts_and_rejects_empty_phrases() -> None:
    """A fresh state has met nothing; total counts every phrase token; an empty phrase is refused."""
    state = ConstraintState.start([[4, 5, 6], [7]])
    assert state.phrases == ((4, 5, 6), (7,))
    assert (state.total, state.num_met, state.unmet, state.finished) == (4, 0, 4, False)
    assert state.allowed() == {4, 7}
    with pytest.raises(ValueError):
        ConstraintState.start([[4], []])


def test_advance_through_a_phrase() -> None:
    """Each matching token adds one met token; the last completes the phrase; others change nothing."""
    state = ConstraintState.start([[4, 5, 6], [7]])
    assert state.advance(9) == state  # unrelated token
    one = state.advance(4)
    assert (one.num_met, one.unmet, one.allowed()) == (1, 3, {5})
    two = one.advance(5)
    assert (two.num_met, two.allowed()) == (2, {6})
    three = two.advance(6)
    assert three.met == (True, False) and three.num_met == 3 and three.allowed() == {7}
    assert not three.finished
    done = three.advance(7)
    assert done.finished and done.unmet == 0 and done.num_met == 4 and done.allowed() == set()
    assert done.advance(4) == done and done.advance(7) == done  # met phrases stay met
    assert state.num_met == 0 and one.num_met == 1  # states are values: advance copies


def test_deviating_token_loses_progress() -> None:
    """A token off the phrase in progress loses its progress; a met phrase is kept."""
    state = ConstraintState.start([[4, 5, 6], [7]])
    lost = _walk(state, [4, 5, 9])
    assert (lost.num_met, lost.allowed(), lost.met) == (0, {4, 7}, (False, False))
    kept = _walk(state, [7, 4, 5, 8])
    assert (kept.num_met, kept.met, kept.allowed()) == (1, (False, True), {4})


def test_deviating_token_that_starts_a_phrase_restarts() -> None:
    """The deviating token is read afresh: it starts (or completes) a phrase when it can."""
    state = ConstraintState.start([[4, 5, 6], [7]])
    restarted = _walk(state, [4, 5, 4])  # 4 5 then 4: progress lost, 4 starts the phrase again
    assert (restarted.num_met, restarted.allowed()) == (1, {5})
    assert _walk(restarted, [5, 6]).met == (True, False)
    other = _walk(state, [4, 5, 7])  # 7 completes the one-token phrase
    assert other.met == (False, True) and other.num_met == 1 and other.allowed() == {4}
    same = ConstraintState.start([[5, 5]])
    assert _walk(same, [5, 5]).finished
    assert not _walk(same, [5, 6, 5]).finished and _walk(same, [5, 6, 5]).num_met == 1
    assert _walk(same, [5, 6, 5, 5]).finished


def test_phrases_with_the_same_first_token() -> None:
    """Two phrases starting with 4: the first listed unmet one is followed; both can be met."""
    state = ConstraintState.start([[4, 5], [4, 6]])
    assert state.allowed() == {4}
    started = state.advance(4)
    assert started.allowed() == {5} and started.num_met == 1
    first = started.advance(5)
    assert first.met == (True, False) and first.allowed() == {4}
    second = _walk(first, [4, 6])
    assert second.finished and second.num_met == 4
    # 4 6 is not credited while the first phrase is in progress (progress on it is lost)
    assert _walk(state, [4, 6]).num_met == 0
    assert _walk(state, [4, 6, 4, 5, 4, 6]).finished


def _rule_sizes(beam_size: int, counts: list[int]) -> list[int]:
    """bank_sizes' rules one slot at a time: each bank starts with K // (C+1) slots and the top
    bank with the remainder; going down from the top, a slot its bank cannot fill moves to
    the nearest lower bank with a candidate left; slots that reach below bank 0 go to the
    highest banks with candidates left."""
    banks = len(counts)
    owner = [c for c in range(banks) for _ in range(beam_size // banks)]
    owner += [banks - 1] * (beam_size - len(owner))
    used = [0] * banks
    lost = 0
    for c in reversed(range(banks)):
        for _ in range(owner.count(c)):
            target = next((d for d in range(c, -1, -1) if used[d] < counts[d]), None)
            if target is None:
                lost += 1
            else:
                used[target] += 1
    for _ in range(lost):
        target = next((d for d in reversed(range(banks)) if used[d] < counts[d]), None)
        if target is not None:
            used[target] += 1
    return used


def test_bank_sizes_by_hand() -> None:
    """The paper's cases: even split with the remainder on top, spare pushed down, then up."""
    assert bank_sizes(6, [9, 9, 9]) == [2, 2, 2]
    assert bank_sizes(7, [9, 9, 9]) == [2, 2, 3]  # remainder to the top bank
    assert bank_sizes(6, [9, 9, 0]) == [2, 4, 0]  # the empty top bank's slots go down
    assert bank_sizes(6, [9, 0, 0]) == [6, 0, 0]
    assert bank_sizes(6, [1, 9, 9]) == [1, 2, 3]  # bank 0's spare goes back up, top first
    assert bank_sizes(6, [0, 1, 9]) == [0, 1, 5]
    assert bank_sizes(6, [1, 1, 1]) == [1, 1, 1]  # fewer candidates than slots
    assert bank_sizes(2, [5, 5, 5]) == [0, 0, 2]  # fewer slots than banks: all on top
    assert bank_sizes(4, [0, 0, 0]) == [0, 0, 0]


def test_bank_sizes_follow_the_rules_exhaustively() -> None:
    """All small K and bank counts: the rules' slot-by-slot result; sum = min(K, candidates)."""
    for beam_size in range(1, 8):
        for banks in range(1, 5):
            for counts in itertools.product(range(6), repeat=banks):
                counts = list(counts)
                sizes = bank_sizes(beam_size, counts)
                assert sizes == _rule_sizes(beam_size, counts), (beam_size, counts)
                assert all(0 <= s <= n for s, n in zip(sizes, counts, strict=True))
                assert sum(sizes) == min(beam_size, sum(counts))


def _candidates(rng: random.Random, phrases: list[list[int]], count: int) -> list[Candidate]:
    """Random candidates over distinct (origin, token), states from random token walks."""
    start = ConstraintState.start(phrases)
    pool = sorted({t for p in phrases for t in p} | {9, 10})
    pairs = rng.sample([(k, t) for k in range(6) for t in range(4, 12)], count)
    out = []
    for origin, token in pairs:
        state = _walk(start, [rng.choice(pool) for _ in range(rng.randint(0, 6))])
        out.append(Candidate(-rng.random() * 10, origin, token, state))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_allocate_keeps_each_banks_best(seed: int) -> None:
    """allocate takes each bank's best in bank_sizes' numbers and returns them best first."""
    rng = random.Random(seed)
    phrases = [[4, 5], [6]]
    beam_size = rng.randint(2, 6)
    candidates = _candidates(rng, phrases, rng.randint(1, 14))
    chosen = allocate(candidates, beam_size)
    banks = [[c for c in candidates if c.state.num_met == m] for m in range(4)]
    sizes = bank_sizes(beam_size, [len(b) for b in banks])
    expected = []
    for bank, size in zip(banks, sizes, strict=True):
        expected.extend(sorted(bank, key=lambda c: -c.score)[:size])
    assert {id(c) for c in chosen} == {id(c) for c in expected}
    assert [c.score for c in chosen] == sorted((c.score for c in chosen), reverse=True)
    assert len(chosen) == min(beam_size, len(candidates))
    for m, size in enumerate(sizes):
        assert sum(c.state.num_met == m for c in chosen) == size


def test_allocate_by_hand() -> None:
    """A fluent bank-0 crowd does not push out the one candidate that met the constraint."""
    start = ConstraintState.start([[7]])
    met = start.advance(7)
    fluent = [Candidate(-1.0 - i / 10, i, 4, start) for i in range(5)]
    placed = Candidate(-9.0, 0, 7, met)
    chosen = allocate([*fluent, placed], 4)
    assert chosen == [*fluent[:3], placed]  # 2 + 2 slots; bank 1 has one: its spare goes down
    assert allocate([], 4) == []
    assert allocate([placed], 4) == [placed]
