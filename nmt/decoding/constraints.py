"""Lexically constrained decoding with dynamic beam allocation (Post & Vilar 2018).

Each sentence may carry target phrases (lists of token ids) that every output must contain.
A hypothesis's progress through them is a ``ConstraintState``; beam search asks it which
tokens advance a constraint, and ``allocate`` picks the next beam: candidates are grouped in
banks by how many constraint tokens they have met (bank c: c tokens met, c = 0..C) and the K
slots are shared among the banks (section 3 of the paper), so that hypotheses that have
placed more of the constraints are not crowded out by fluent ones that placed none.

A phrase is met when its tokens appear consecutively; a hypothesis that starts a phrase and
then writes another token loses that phrase's progress (the token may start a phrase itself).
A hypothesis may end (EOS) only when every phrase is met, and a candidate that can no longer
meet its phrases before the sentence's length limit is dropped, so every finished output
contains every phrase.

Any number of phrases is allowed; their tokens count towards the length limit on top of the
source-based limit (search adds them). With fewer beam slots than banks (K < C + 1) the
allocation still works but some banks stay empty at each step, and outputs get worse: give a
beam of at least C + 1 for C constraint tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConstraintState:
    """phrases: the constraints (token ids); met: which phrases are complete; current and
    matched: the phrase in progress and how many of its tokens are matched (-1, 0: none)."""

    phrases: tuple[tuple[int, ...], ...]
    met: tuple[bool, ...]
    current: int = -1
    matched: int = 0

    @classmethod
    def start(cls, phrases: Sequence[Sequence[int]]) -> ConstraintState:
        kept = tuple(tuple(p) for p in phrases)
        if any(not p for p in kept):
            raise ValueError("a constraint phrase must have at least one token")
        return cls(kept, (False,) * len(kept))

    @property
    def total(self) -> int:
        """C: the number of constraint tokens."""
        return sum(len(p) for p in self.phrases)

    @property
    def num_met(self) -> int:
        """Constraint tokens met so far: complete phrases plus the one in progress."""
        done = sum(len(p) for p, m in zip(self.phrases, self.met, strict=True) if m)
        return done + self.matched

    @property
    def unmet(self) -> int:
        return self.total - self.num_met

    @property
    def finished(self) -> bool:
        return all(self.met)

    def allowed(self) -> set[int]:
        """The tokens that advance the constraints: the next token of the phrase in
        progress, or else the first token of every unmet phrase."""
        if self.current >= 0:
            return {self.phrases[self.current][self.matched]}
        return {p[0] for p, m in zip(self.phrases, self.met, strict=True) if not m}

    def advance(self, token: int) -> ConstraintState:
        """The state after the hypothesis outputs ``token``."""
        if self.current >= 0:
            phrase = self.phrases[self.current]
            if phrase[self.matched] == token:
                if self.matched + 1 == len(phrase):
                    return self._complete(self.current)
                return ConstraintState(self.phrases, self.met, self.current, self.matched + 1)
            fresh = ConstraintState(self.phrases, self.met)  # progress on the phrase is lost
            return fresh.advance(token)
        for index, (phrase, met) in enumerate(zip(self.phrases, self.met, strict=True)):
            if not met and phrase[0] == token:
                if len(phrase) == 1:
                    return self._complete(index)
                return ConstraintState(self.phrases, self.met, index, 1)
        return self

    def _complete(self, index: int) -> ConstraintState:
        met = tuple(m or i == index for i, m in enumerate(self.met))
        return ConstraintState(self.phrases, met)


@dataclass
class Candidate:
    """A continuation of alive hypothesis ``origin`` (0..K-1) by ``token``: its summed
    log-probability and the constraint state after the token."""

    score: float
    origin: int
    token: int
    state: ConstraintState


def bank_sizes(beam_size: int, counts: Sequence[int]) -> list[int]:
    """Slots per bank (bank c holds candidates with c constraint tokens met), from how many
    candidates each bank has.

    Every bank gets K // (C+1) slots and the highest bank the remainder; a bank with fewer
    candidates than slots hands its spare slots to the next lower bank, and whatever the
    lowest banks cannot fill goes back up to the highest banks that have candidates left.
    """
    banks = len(counts)
    sizes = [beam_size // banks] * banks
    sizes[-1] += beam_size - sum(sizes)
    spare = 0
    for c in reversed(range(banks)):
        sizes[c] += spare
        spare = max(0, sizes[c] - counts[c])
        sizes[c] -= spare
    for c in reversed(range(banks)):
        extra = min(spare, counts[c] - sizes[c])
        sizes[c] += extra
        spare -= extra
    return sizes


def allocate(candidates: Sequence[Candidate], beam_size: int) -> list[Candidate]:
    """The next beam (at most K hypotheses) from a sentence's candidates: each bank's best by
    score, in the sizes of ``bank_sizes``; returned best first. Duplicates (same origin and
    token) must already be removed."""
    if not candidates:
        return []
    total = candidates[0].state.total
    banks: list[list[Candidate]] = [[] for _ in range(total + 1)]
    for candidate in candidates:
        banks[candidate.state.num_met].append(candidate)
    sizes = bank_sizes(beam_size, [len(bank) for bank in banks])
    chosen = []
    for bank, size in zip(banks, sizes, strict=True):
        bank.sort(key=lambda c: -c.score)
        chosen.extend(bank[:size])
    chosen.sort(key=lambda c: -c.score)
    return chosen
