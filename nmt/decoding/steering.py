"""What may be imposed on the search: per sentence, a target prefix that every output
starts with and constraint phrases that every output contains (``constraints``); for every
sentence, its length limit and ``decoding.no_repeat_ngram``. Search applies them as
``Restriction``s between computing a step's log-probabilities and choosing from them; a
restriction says whether it reads the host at every step, and a search with one keeps its
loop on the host (``nmt.decoding.search.runs_on_device``).

Forced tokens do not eat the source-based length budget: a sentence's longest output is
ceil(ratio * |x|) + offset plus the tokens of its prefix and of its constraint phrases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

from nmt.config import MAX_LENGTH, DecodingConfig
from nmt.decoding.constraints import Candidate, ConstraintState, allocate
from nmt.vocab import EOS_ID


@dataclass
class Steering:
    """Prefixes and constraints, as token ids, one entry per sentence (of a batch, or of
    all the lines a caller gives); an empty prefix or an empty list of phrases imposes
    nothing. None: nothing for any sentence."""

    prefixes: Sequence[Sequence[int]] | None = None
    constraints: Sequence[Sequence[Sequence[int]]] | None = None

    @property
    def constrained(self) -> bool:
        return self.constraints is not None and any(self.constraints)

    def subset(self, index: Sequence[int]) -> Steering:
        """The entries of sentences ``index``, in that order."""
        return Steering(
            [self.prefixes[i] for i in index] if self.prefixes is not None else None,
            [self.constraints[i] for i in index] if self.constraints is not None else None,
        )

    def forced_pieces(self, sentence: int) -> list[int]:
        """The pieces of the sentence's prefix and constraint phrases, in that order."""
        pieces = list(self.prefixes[sentence]) if self.prefixes is not None else []
        if self.constraints is not None:
            pieces.extend(i for phrase in self.constraints[sentence] for i in phrase)
        return pieces

    def forced_tokens(self, sentence: int) -> int:
        """Tokens of the sentence's prefix and constraint phrases."""
        return len(self.forced_pieces(sentence))

    def initial_states(self, beam_size: int) -> list[ConstraintState | None]:
        """Each beam row's constraint state (None: an unconstrained sentence)."""
        assert self.constraints is not None
        states: list[ConstraintState | None] = []
        for phrases in self.constraints:
            state = ConstraintState.start(phrases) if phrases else None
            states.extend([state] * beam_size)
        return states


def search_limits(
    src_lengths: Tensor, ratio: float, offset: int, steering: Steering | None
) -> list[int]:
    """Longest output per sentence, EOS included: ceil(ratio * |x|) + offset (at least 1, at
    most ``MAX_LENGTH`` pieces), plus the sentence's forced tokens."""
    scaled = (src_lengths.float() * ratio).ceil().clamp(max=MAX_LENGTH).long()
    limits = scaled.add(offset).clamp(min=1, max=MAX_LENGTH).tolist()
    if steering is None:
        return limits
    return [limit + steering.forced_tokens(b) for b, limit in enumerate(limits)]


class Stepped(Protocol):
    """What a restriction reads of the rows a search steps (``nmt.decoding.search``'s
    greedy and beam inputs): the output position being chosen (1-based; a 0-d tensor on
    the device in fixed shapes), each stepped sentence's length limit (B',), its rows
    (``width``: K, or 1), its steering and its hypotheses' constraint states (N,) or None."""

    @property
    def position(self) -> int | Tensor: ...
    @property
    def limit(self) -> Tensor: ...
    @property
    def width(self) -> int: ...
    @property
    def steering(self) -> Steering | None: ...
    @property
    def constraints(self) -> list[ConstraintState | None] | None: ...

    def history(self) -> Tensor:
        """(N, position - 1) each stepped row's outputs so far."""
        ...


@dataclass(frozen=True)
class Restriction:
    """A ban on tokens, applied in place to a step's log-probabilities (N, V) before search
    chooses from them. ``host``: it reads the host at every step (a sentence's lists, the
    outputs' history), so that a loop with it cannot stay on the device."""

    apply: Callable[[Tensor, Stepped], None]
    host: bool


def restrictions(decoding: DecodingConfig, steering: Steering | None) -> list[Restriction]:
    """A search's restrictions, in the order they apply: no repeated n-gram, the prefixes'
    forced tokens, EOS at the length limit, no EOS before the constraints are met."""
    found = []
    if decoding.no_repeat_ngram:
        found.append(Restriction(partial(_no_repeats, n=decoding.no_repeat_ngram), host=True))
    if steering is not None and steering.prefixes is not None:
        found.append(Restriction(_prefixes, host=True))
    found.append(Restriction(_eos_at_limit, host=False))
    if steering is not None and steering.constraints is not None:
        found.append(Restriction(_constraints_unmet, host=True))
    return found


def _no_repeats(log_probs: Tensor, rows: Stepped, n: int) -> None:
    if int(rows.position) > 1:
        block_repeated_ngrams(log_probs, rows.history(), n)


def _prefixes(log_probs: Tensor, rows: Stepped) -> None:
    assert rows.steering is not None and rows.steering.prefixes is not None
    force_prefixes(log_probs, rows.steering.prefixes, int(rows.position), rows.width)


def _eos_at_limit(log_probs: Tensor, rows: Stepped) -> None:
    """Rows of sentences at their length limit may only end: every other token gets -inf.
    The host's loop (a Python int position) bans only the rows at their limit, found on the
    host; in fixed shapes every row is masked, nothing read."""
    at_limit = rows.limit <= rows.position  # (B',)
    if rows.width > 1:
        at_limit = at_limit[:, None].expand(-1, rows.width).reshape(-1)  # (N,)
    index = at_limit.nonzero().view(-1) if isinstance(rows.position, int) else None
    if index is not None and index.numel() == 0:
        return
    eos = log_probs[:, EOS_ID].clone()  # (N,)
    if index is not None:
        log_probs.index_fill_(0, index, -math.inf)
    else:
        log_probs.masked_fill_(at_limit[:, None], -math.inf)
    log_probs[:, EOS_ID] = eos


def _constraints_unmet(log_probs: Tensor, rows: Stepped) -> None:
    if rows.constraints is not None:
        forbid_early_eos(log_probs, rows.constraints)


def block_repeated_ngrams(log_probs: Tensor, history: Tensor, n: int) -> None:
    """Give -inf to every token that would repeat an n-gram already in the hypothesis.

    log_probs: (N, V), changed in place; history: (N, t) tokens output so far. The last n-1
    tokens are matched against every earlier (n-1)-gram; the token that followed a match is
    banned (Paulus et al. 2018, section 2.5; OpenNMT's block_ngram_repeat).
    """
    if n < 1 or history.size(1) < n - 1:
        return
    if n == 1:
        banned = torch.zeros_like(log_probs, dtype=torch.bool)
        banned.scatter_(1, history, True)
        log_probs.masked_fill_(banned, -math.inf)
        return
    if history.size(1) < n:
        return
    windows = history.unfold(1, n, 1)  # (N, W, n) every n-gram so far
    prefix = history[:, history.size(1) - n + 1 :]  # (N, n-1) the n-gram being completed
    match = (windows[:, :, :-1] == prefix[:, None, :]).all(dim=-1)  # (N, W)
    counts = torch.zeros_like(log_probs, dtype=torch.int32)
    counts.scatter_add_(1, windows[:, :, -1], match.to(torch.int32))
    log_probs.masked_fill_(counts > 0, -math.inf)


def force_prefixes(
    log_probs: Tensor, prefixes: Sequence[Sequence[int]], length: int, beam_size: int
) -> None:
    """At output position ``length`` (1-based), rows of a sentence whose prefix is that long
    may only output the prefix's token there (its log-probability counts as usual)."""
    rows: list[int] = []
    tokens: list[int] = []
    for b, prefix in enumerate(prefixes):
        if len(prefix) >= length:
            rows.extend(range(b * beam_size, (b + 1) * beam_size))
            tokens.extend([prefix[length - 1]] * beam_size)
    if not rows:
        return
    row_index = torch.tensor(rows, device=log_probs.device)
    token_index = torch.tensor(tokens, device=log_probs.device)
    kept = log_probs[row_index, token_index].clone()
    log_probs[row_index] = -math.inf
    log_probs[row_index, token_index] = kept


def forbid_early_eos(log_probs: Tensor, states: Sequence[ConstraintState | None]) -> None:
    """A hypothesis with unmet constraints may not end."""
    rows = [i for i, state in enumerate(states) if state is not None and not state.finished]
    if rows:
        log_probs[torch.tensor(rows, device=log_probs.device), EOS_ID] = -math.inf


@dataclass
class NextBeams:
    """The constrained sentences' next beams, to write over the plain selection: for each
    sentence b in ``sentences``, K scores, origins (0..K-1) and tokens; ``states`` (B*K)."""

    sentences: list[int]
    scores: list[list[float]]
    origins: list[list[int]]
    tokens: list[list[int]]
    states: list[ConstraintState | None]


def constrained_beams(
    beam_scores: Tensor,
    log_probs: Tensor,
    top: tuple[Tensor, Tensor, Tensor],
    states: list[ConstraintState | None],
    limits: Sequence[int],
    length: int,
) -> NextBeams:
    """Post & Vilar's candidates for each constrained sentence and its next beam.

    beam_scores (B, K) summed log-probabilities of the alive hypotheses; log_probs (B*K, V)
    this step's (masked) log-probabilities; top: the plain search's best 2K candidates
    (scores, origins, tokens), each (B, 2K); states (B*K) the alive hypotheses' constraint
    states. Candidates: the plain best 2K, plus for each alive hypothesis every token that
    advances its constraints and its own best token (EOS excluded: ending is handled with
    the plain candidates). A candidate that could not meet its remaining constraint tokens
    before the sentence's limit is dropped.
    """
    batch, beam_size = beam_scores.size()
    sentences = [b for b in range(batch) if states[b * beam_size] is not None]
    wanted: list[tuple[int, int]] = []  # (row, token): the extra candidates
    best = log_probs.argmax(dim=-1).tolist()
    alive = beam_scores.tolist()
    for b in sentences:
        for k in range(beam_size):
            row = b * beam_size + k
            state = states[row]
            if state is None or alive[b][k] == -math.inf:
                continue
            wanted.extend((row, token) for token in sorted(state.allowed()))
            wanted.append((row, best[row]))
    extra = _gather(log_probs, wanted)
    top_scores, top_origins, top_tokens = (t.tolist() for t in top)
    out = NextBeams([], [], [], [], list(states))
    by_row: dict[int, list[tuple[int, int, float]]] = {}
    for (row, token), value in zip(wanted, extra, strict=True):
        by_row.setdefault(row // beam_size, []).append((row % beam_size, token, value))
    for b in sentences:
        pairs = zip(top_origins[b], top_tokens[b], top_scores[b], strict=True)
        listed = [(k, token, score) for k, token, score in pairs]
        listed += [(k, token, alive[b][k] + value) for k, token, value in by_row.get(b, [])]
        room = limits[b] - 1 - length  # tokens still possible before EOS after this one
        candidates, seen = [], set()
        for k, token, score in listed:
            if token == EOS_ID or score == -math.inf or (k, token) in seen:
                continue
            seen.add((k, token))
            state = states[b * beam_size + k]
            assert state is not None
            after = state.advance(token)
            if after.unmet <= room:
                candidates.append(Candidate(score, k, token, after))
        chosen = allocate(candidates, beam_size)
        _record(out, b, chosen, beam_size, states[b * beam_size])
    return out


def _gather(log_probs: Tensor, pairs: list[tuple[int, int]]) -> list[float]:
    if not pairs:
        return []
    rows = torch.tensor([r for r, _ in pairs], device=log_probs.device)
    tokens = torch.tensor([t for _, t in pairs], device=log_probs.device)
    return log_probs[rows, tokens].tolist()


def _record(
    out: NextBeams,
    sentence: int,
    chosen: list[Candidate],
    beam_size: int,
    filler: ConstraintState | None,
) -> None:
    """Write a sentence's chosen K (padded with dead slots at -inf) into ``out``."""
    scores = [c.score for c in chosen] + [-math.inf] * (beam_size - len(chosen))
    origins = [c.origin for c in chosen] + [0] * (beam_size - len(chosen))
    tokens = [c.token for c in chosen] + [EOS_ID] * (beam_size - len(chosen))
    out.sentences.append(sentence)
    out.scores.append(scores)
    out.origins.append(origins)
    out.tokens.append(tokens)
    for k in range(beam_size):
        out.states[sentence * beam_size + k] = chosen[k].state if k < len(chosen) else filler
