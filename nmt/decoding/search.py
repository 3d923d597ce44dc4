"""Greedy and batched beam search over token ids; no strings here. One implementation for
every search: a single model, an ensemble or the exported graphs under onnxruntime (anything
that keeps the step contract, ``nmt.decoding.ensemble.Stepper``), with or without coverage
penalty, target prefixes and lexical constraints (nmt.decoding.steering).

Beam search keeps sentences x beams in one (B*K) batch: the encoder runs once, the keys are
projected once, finished hypotheses are set aside with their score on the device
(``nmt.decoding.finished``), sentences that are done leave the batch (``kept_rows``), and
the loop ends when every sentence is done. Greedy and beam search each have one loop
(``captured.run_steps``) over one step; dropping ended rows is the loop's option between
steps. With ``decoding.device_loop`` (a GPU's default) every row is kept to the end
instead, in fixed shapes written in place (the output position a 0-d tensor, the tokens
(N, T) written a column a step, ``Finished`` at its full size), so that the host never
waits for a step and, on a GPU, a step is one CUDA graph replayed (``nmt.decoding.captured``);
the host learns that every sentence is done from a flag it never waits for (``DoneFlag``),
so such a loop may run a step or two past the end, steps that change nothing. A search
whose restrictions read the host at every step (prefixes, constraints, ``no_repeat_ngram``:
``nmt.decoding.steering.Restriction``) keeps the loop on the host.

A finished hypothesis Y of source x scores (Wu et al. 2016, eq. 14)

    s(Y, x) = log P(Y | x) / lp(Y) + cp(x; Y)
    lp(Y) = ((5 + |Y|) / 6)^alpha
    cp(x; Y) = beta * sum_{i=1}^{|x|} log(min(sum_j a_ij, 1))

where |Y| counts the output tokens including the final EOS, a_ij is the attention on source
token i when output token j is predicted (EOS's step included) and beta is
``decoding.coverage_penalty`` (0: off). Alive hypotheses are ranked by log P alone; both
penalties apply where a hypothesis ends, as the length penalty always has here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from nmt.config import DecodingConfig
from nmt.decoding import captured
from nmt.decoding.beams import (
    Beams,
    Candidates,
    coverage_penalty,
    length_penalty,
    next_alive,
    now_done,
    set_aside_finished,
    top_candidates,
)
from nmt.decoding.constraints import ConstraintState
from nmt.decoding.ensemble import Stepper, stepper
from nmt.decoding.finished import Finished
from nmt.decoding.steering import (
    Restriction,
    Steering,
    restrictions,
    search_limits,
)
from nmt.fast.topk import row_max
from nmt.model import Seq2Seq
from nmt.vocab import BOS_ID, EOS_ID


@dataclass
class Hypothesis:
    """tokens exclude EOS; score is s(Y, x) above; log_prob is log P(Y | x) with EOS;
    alphas: (len(tokens)+1, S) attention for each output token including EOS, or None."""

    tokens: list[int]
    score: float
    alphas: Tensor | None = None
    log_prob: float = 0.0


@torch.no_grad()
def greedy_search(
    model: Seq2Seq | Stepper[Any],
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    return_attention: bool = False,
    prefixes: Sequence[Sequence[int]] | None = None,
    stop: threading.Event | None = None,
) -> list[Hypothesis]:
    """Argmax decoding for a batch (``decoding.beam_size`` is not read); what beam search
    runs for beam size 1.

    Like beam search, a sentence at its maximum length may only end (EOS is forced), and the
    score is s(Y, x) of the output including EOS. One loop (``captured.run_steps``) over
    one step (``_greedy_step``); where the loop stays on the host (``runs_on_device``),
    rows that have ended leave the batch between steps (``_drop_ended``, ``kept_rows``).
    ``stop``: once set, the next step raises ``captured.SearchStopped``.
    """
    scorer = stepper(model)
    steering = Steering(prefixes) if prefixes is not None else None
    limits = search_limits(src_lengths, decoding.max_len_ratio, decoding.max_len_offset, steering)
    keep_alphas = return_attention or decoding.coverage_penalty > 0
    device, batch, width, longest = src.device, src.size(0), src.size(1), max(limits)
    own_lengths = src_lengths  # (B,) the batch's, before any padding to a static shape
    fixed = runs_on_device(decoding, device, steering)
    graphs = fixed and captured.captures(decoding, device)
    src, src_lengths, limits, length = captured.shaped_batch(
        graphs, scorer, src, src_lengths, limits, decoding
    )
    state = scorer.encode(src, src_lengths)
    g = _Greedy.first(
        captured.step_as_tensor(state, device) if fixed else state, limits, length, device
    )
    g.position = torch.ones((), dtype=torch.long, device=device) if fixed else 1
    g.steering = steering
    bans = restrictions(decoding, steering)

    def step(inputs: _Greedy, strict: bool = False) -> None:
        _greedy_step(scorer, inputs, keep_alphas, bans, in_place=fixed, strict=strict)

    drop = None if fixed else lambda inputs: _drop_ended(scorer, inputs)
    key = captured.kept_key(scorer, ("greedy", keep_alphas), graphs)
    done = captured.run_steps(step, g, _greedy_ended, longest, graphs, key, drop, stop)
    assert done.scores is not None
    # the batch's own rows, outputs and source positions (clones: a kept step's tensors are
    # the next batch's)
    tokens = done.tokens[:batch, :longest].clone()
    scores = done.scores[:batch, :longest].clone()
    alphas = done.alphas[:batch, :longest, :width].clone() if done.alphas is not None else None
    return _collect_greedy(tokens, scores, alphas, own_lengths, decoding, return_attention)


@dataclass
class _Greedy:
    """A greedy search's step inputs: the stepped rows' length limits (N,), the output
    position (1-based; a 0-d tensor on the device in fixed shapes), prev (N,), whether each
    stepped row has ended (N,), the state, each batch row's tokens (B, T), and, once the
    first step has made them in the log-probabilities' dtype, their log-probabilities
    (B, T) and attention (B, T, S); ``rows`` (N,): the batch rows stepped (None: every row,
    in order), and the stepped rows' steering (prefixes), if any."""

    limit: Tensor
    position: int | Tensor
    prev: Tensor
    ended: Tensor
    state: Any
    tokens: Tensor
    scores: Tensor | None = None
    alphas: Tensor | None = None
    rows: Tensor | None = None
    steering: Steering | None = None
    width = 1  # rows per sentence
    constraints = None

    @classmethod
    def first(cls, state: Any, limits: list[int], length: int, device: torch.device) -> _Greedy:
        """Every row at BOS, room for ``length`` output tokens."""
        batch = len(limits)
        return cls(
            limit=torch.tensor(limits, device=device),
            position=1,
            prev=torch.full((batch,), BOS_ID, dtype=torch.long, device=device),
            ended=torch.zeros(batch, dtype=torch.bool, device=device),
            state=state,
            tokens=torch.zeros((batch, length), dtype=torch.long, device=device),
        )

    def history(self) -> Tensor:
        """(N, position - 1) each stepped row's outputs so far."""
        history = self.tokens[:, : int(self.position) - 1]  # (B, t)
        return history if self.rows is None else history[self.rows]


def _greedy_step(
    scorer: Stepper[Any],
    g: _Greedy,
    keep_alphas: bool,
    bans: list[Restriction],
    in_place: bool = False,
    strict: bool = False,
) -> None:
    """The argmax of each stepped row after the restrictions ``bans`` (EOS at its limit),
    written at the position's column; ``in_place``: the state written back into its own
    tensors, as fixed shapes need (``strict``: nothing replaced, as a capture needs)."""
    log_probs, step_alphas, state = scorer.step(g.prev, g.state)  # (N, V), (N, S)
    if g.scores is None:
        g.scores = log_probs.new_zeros(g.tokens.shape)  # (B, T)
        if keep_alphas:
            width = step_alphas.size(-1)
            g.alphas = step_alphas.new_zeros((*g.tokens.shape, width)).float()  # (B, T, S)
    for ban in bans:
        ban.apply(log_probs, g)
    best, chosen = row_max(log_probs, scorer.native_kernels)  # (N,), (N,)
    _write_column(g.tokens, g.rows, g.position, chosen)
    _write_column(g.scores, g.rows, g.position, best.masked_fill(g.ended, 0.0))
    if g.alphas is not None:
        _write_column(g.alphas, g.rows, g.position, step_alphas.float())
    g.ended.logical_or_(chosen == EOS_ID)
    if in_place:
        g.prev.copy_(chosen)
        captured.write_back(g.state, state, strict)
    else:
        g.prev, g.state = chosen, state
    g.position = _next(g.position)


def _next(position: int | Tensor) -> int | Tensor:
    """The next output position: a 0-d tensor advanced in place on the device."""
    return position.add_(1) if isinstance(position, Tensor) else position + 1


def _drop_ended(scorer: Stepper[Any], g: _Greedy) -> None:
    """Rows that have ended leave the batch (``kept_rows``: not below MIN_ROWS rows)."""
    chosen = kept_rows(g.ended.tolist()) if g.prev.size(0) > MIN_ROWS else None
    if chosen is None:
        return
    keep = torch.tensor(chosen, device=g.prev.device)  # (N',)
    rows = g.rows if g.rows is not None else torch.arange(g.prev.size(0), device=keep.device)
    g.state = scorer.select(g.state, keep)
    g.rows, g.prev, g.limit, g.ended = rows[keep], g.prev[keep], g.limit[keep], g.ended[keep]
    if g.steering is not None:
        g.steering = g.steering.subset(chosen)


def _write_column(out: Tensor, rows: Tensor | None, position: int | Tensor, values: Tensor) -> None:
    """values (N, ...) into out (B, T, ...) at output ``position`` (1-based; a 0-d tensor on
    the device in fixed shapes) and ``rows`` (N,) (None: every row)."""
    if isinstance(position, Tensor):
        out.index_copy_(1, (position - 1).view(1), values.unsqueeze(1))
    elif rows is None:
        out[:, position - 1] = values
    else:
        out[rows, position - 1] = values


def _greedy_ended(inputs: _Greedy) -> Tensor:
    """Whether each stepped row of a greedy search has ended (N,)."""
    return inputs.ended


def _collect_greedy(
    tokens: Tensor,
    scores: Tensor,
    alphas: Tensor | None,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    return_attention: bool,
) -> list[Hypothesis]:
    """Each row's output up to its first EOS: tokens (B, T), each token's log-probability
    (B, T) and attention (B, T, S) or None -> its Hypothesis."""
    ids = tokens.tolist()  # (B, T)
    score_rows = scores.cpu()  # (B, T)
    attention = alphas.cpu() if alphas is not None else None  # (B, T, S)
    beta = decoding.coverage_penalty
    out = []
    for row, seq in enumerate(ids):
        length = seq.index(EOS_ID) + 1  # every row ends in EOS by its limit
        log_prob = float(score_rows[row, :length].sum())
        total = log_prob / length_penalty(length, decoding.length_penalty)
        row_alphas = attention[row, :length] if attention is not None else None
        if beta > 0 and row_alphas is not None:
            coverage = row_alphas.sum(dim=0, keepdim=True)  # (1, S)
            total += float(coverage_penalty(coverage, src_lengths[row : row + 1].cpu(), beta)[0])
        out.append(
            Hypothesis(seq[: length - 1], total, row_alphas if return_attention else None, log_prob)
        )
    return out


DROP_SHARE = 8  # ended sentences are dropped once they are 1/DROP_SHARE of the batch
MIN_ROWS = 16  # the fewest rows a batch keeps while it drops ended sentences (``kept_rows``)


def kept_rows(ended: Sequence[bool], width: int = 1) -> list[int] | None:
    """The sentences (each ``width`` rows: its beams) that a batch keeps when it drops those
    that have ended, or None to keep them all for now.

    Each drop copies the source memory of the rest, so it waits until an eighth of the
    sentences have ended. A batch never falls below MIN_ROWS rows (ended sentences stay to
    fill them): a matmul library may take other kernels, with another round-off, for a few
    rows than for many (MKL did under 4 rows on a 2-core AMD EPYC and under 16 on a Xeon),
    and a sentence's outcome would then depend on when the others ended.
    """
    alive = [i for i, done in enumerate(ended) if not done]
    filler = [i for i, done in enumerate(ended) if done]
    wanted = max(len(alive), math.ceil(MIN_ROWS / width))
    keep = sorted(alive + filler[: max(0, wanted - len(alive))])
    dropped = len(ended) - len(keep)
    return keep if dropped > 0 and dropped * DROP_SHARE >= len(ended) else None


def runs_on_device(
    decoding: DecodingConfig, device: torch.device, steering: Steering | None
) -> bool:
    """Whether a search (beam or greedy) keeps its loop on the device: where
    ``decoding.device_loop`` asks for it (None: on a GPU) and none of its restrictions
    reads the host at every step (``steering.restrictions``: prefixes, constraints,
    ``no_repeat_ngram``)."""
    wanted = decoding.device_loop
    if wanted is None:
        wanted = device.type == "cuda"
    return wanted and not any(ban.host for ban in restrictions(decoding, steering))


@torch.no_grad()
def beam_search(
    model: Seq2Seq | Stepper[Any],
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    n_best: int = 1,
    return_attention: bool = False,
    steering: Steering | None = None,
    stop: threading.Event | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the ``n_best`` hypotheses per sentence, best first.

    ``steering``: per-sentence prefixes and constraints. A constrained sentence for which
    no hypothesis meets every constraint within its length limit (possible only when
    ``no_repeat_ngram`` blocks a constraint) gets an empty list. ``stop``: once set, the
    next step raises ``captured.SearchStopped``.

    One loop (``captured.run_steps``) over one step (``_beam_step``). The finished
    hypotheses and the stopping rule live on the device (``Finished``). Where the loop
    stays on the host it reads once a step which sentences are done, and drops them
    between steps (``_drop_done``, ``kept_rows``); with ``decoding.device_loop`` (a GPU's
    default, ``runs_on_device``) it reads nothing until the end and keeps every row.
    """
    beam_size = decoding.beam_size
    if steering is not None and steering.constrained and beam_size == 1:
        raise ValueError("lexical constraints need a beam of at least 2")
    if beam_size == 1 and n_best == 1:
        prefixes = steering.prefixes if steering is not None else None
        hyps = greedy_search(model, src, src_lengths, decoding, return_attention, prefixes, stop)
        return [[h] for h in hyps]
    scorer = stepper(model)
    batch, width, device = src.size(0), src.size(1), src.device
    limits = search_limits(src_lengths, decoding.max_len_ratio, decoding.max_len_offset, steering)
    longest = max(limits)
    fixed = runs_on_device(decoding, device, steering)
    graphs = fixed and captured.captures(decoding, device)
    src, src_lengths, limits, length = captured.shaped_batch(
        graphs, scorer, src, src_lengths, limits, decoding
    )
    state = scorer.encode(src, src_lengths, repeat=beam_size)
    if fixed:
        state = captured.step_as_tensor(state, device)
    slots = max(beam_size, n_best)
    finished = Finished(src.size(0), slots, src.size(1), return_attention, device, length)
    inputs = _Beam.first(state, src, src_lengths, limits, length, decoding, steering, finished)
    if fixed:
        inputs.position = torch.ones((), dtype=torch.long, device=device)
    bans = restrictions(decoding, steering)

    def step(inputs: _Beam, strict: bool = False) -> None:
        _beam_step(scorer, inputs, bans, in_place=fixed, strict=strict)

    drop = None if fixed else partial(_drop_done, scorer)
    settings = ("beam", beam_size, n_best, return_attention, decoding.coverage_penalty)
    key = captured.kept_key(scorer, settings, graphs)
    done = captured.run_steps(step, inputs, _beam_done, longest, graphs, key, drop, stop)
    found = done.finished.hypotheses(n_best)[:batch]
    return [  # each sentence's Hypothesis list, attention over its batch's source positions
        [
            Hypothesis(tokens, score, alphas[f][:, :width] if alphas else None, log_prob)
            for f, (score, log_prob, tokens) in enumerate(
                zip(scores, log_probs, token_lists, strict=True)
            )
        ]
        for scores, log_probs, token_lists, alphas in found
    ]


@dataclass
class _Beam:
    """A beam search's step inputs. What a step writes: the output position (1-based; a
    0-d tensor on the device in fixed shapes), prev (N,), the alive hypotheses (their
    tokens (N, T) and attention (N, T, S) written a column a step), whether each sentence
    is done (B,) (a done one stays until ``_drop_done`` drops it), the finished ones and
    the state. What it reads: K (``width``), each sentence's length limit (B,) and first
    row (B, 1), each row's source length (N,), the length penalty of each output length
    1..T (T,) float64 (a table of the Python floats ``length_penalty`` gives), the coverage
    penalty's beta and the sentences' steering."""

    position: int | Tensor
    prev: Tensor
    beams: Beams
    done: Tensor
    finished: Finished
    state: Any
    width: int
    limit: Tensor
    first_rows: Tensor
    row_lengths: Tensor
    penalties: Tensor
    beta: float
    steering: Steering | None

    @classmethod
    def first(
        cls,
        state: Any,
        src: Tensor,
        src_lengths: Tensor,
        limits: list[int],
        length: int,
        decoding: DecodingConfig,
        steering: Steering | None,
        finished: Finished,
    ) -> _Beam:
        """One live hypothesis (the empty one) per sentence of ``src`` (B, S), K-1 dead
        slots beside it, room for ``length`` output tokens, attention kept as ``finished``
        keeps it."""
        batch, beam_size, device = len(limits), decoding.beam_size, src.device
        rows, width = batch * beam_size, src.size(1)
        scores = torch.full((batch, beam_size), -math.inf, device=device)
        scores[:, 0] = 0.0
        beams = Beams(
            scores,
            torch.zeros((rows, length), dtype=torch.long, device=device),
            src.new_zeros((rows, length, width), dtype=torch.float32)
            if finished.alphas is not None
            else None,
            src.new_zeros((rows, width), dtype=torch.float32)
            if decoding.coverage_penalty > 0
            else None,
            steering.initial_states(beam_size)
            if steering is not None and steering.constrained
            else None,
        )
        penalties = [length_penalty(n, decoding.length_penalty) for n in range(1, length + 1)]
        return cls(
            position=1,
            prev=torch.full((rows,), BOS_ID, dtype=torch.long, device=device),
            beams=beams,
            done=torch.zeros(batch, dtype=torch.bool, device=device),
            finished=finished,
            state=state,
            width=beam_size,
            limit=torch.tensor(limits, device=device),
            first_rows=torch.arange(batch, device=device)[:, None] * beam_size,
            row_lengths=src_lengths.repeat_interleave(beam_size),
            penalties=torch.tensor(penalties, dtype=torch.float64, device=device),
            beta=decoding.coverage_penalty,
            steering=steering,
        )

    @property
    def constraints(self) -> list[ConstraintState | None] | None:
        return self.beams.constraints

    def history(self) -> Tensor:
        """(N, position - 1) each row's outputs so far."""
        return self.beams.tokens[:, : int(self.position) - 1]

    def column(self) -> Tensor:
        """(1,) the tokens' column this step writes."""
        if isinstance(self.position, Tensor):
            return (self.position - 1).view(1)
        return torch.tensor([self.position - 1], device=self.prev.device)


def _beam_step(
    scorer: Stepper[Any],
    s: _Beam,
    bans: list[Restriction],
    in_place: bool = False,
    strict: bool = False,
) -> None:
    """Score every row's next token (after the restrictions ``bans``), set aside the
    candidates that end, keep the best K that do not, and decide which sentences are done;
    ``in_place``: each tensor written back into its own, as fixed shapes need (``strict``:
    nothing replaced, as a graph's capture needs)."""
    beam_size, beams, column = s.width, s.beams, s.column()
    penalty = s.penalties.index_select(0, column)  # lp(length), (1,) float64
    log_probs, step_alphas, state = scorer.step(s.prev, s.state)  # (N, V), (N, S)
    for ban in bans:
        ban.apply(log_probs, s)
    top_scores, origins, top_tokens = top_candidates(
        beams, log_probs, beam_size, scorer.native_kernels
    )  # (B, 2K)
    kept = None  # this step's attention, when a hypothesis keeps it or sums it
    if beams.alphas is not None or beams.coverage is not None:
        kept = step_alphas.float()
    penalties = None  # (N,) float64: each row's coverage penalty, were it to end here
    if beams.coverage is not None and kept is not None:
        penalties = coverage_penalty(beams.coverage + kept, s.row_lengths, s.beta).double()
    step = Candidates(top_scores, origins, top_tokens, kept, penalties)
    set_aside_finished(s.finished, beams, step, s.done, s.position, penalty, column)
    alive_scores, picked, tokens, constraint_states = next_alive(
        beams, log_probs, step, s.limit, s.position
    )  # (B, K)
    flat = (s.first_rows + picked).view(-1)  # (N,) the rows they extend
    s.done |= now_done(s.finished, alive_scores, s.position, s.limit, beam_size, penalty)
    alphas, coverage = None, None
    if beams.alphas is not None and kept is not None:
        alphas = beams.alphas[flat].index_copy_(1, column, kept[flat].unsqueeze(1))
    if beams.coverage is not None and kept is not None:
        coverage = beams.coverage[flat] + kept[flat]
    following = Beams(
        alive_scores.masked_fill(s.done[:, None], -math.inf),
        beams.tokens[flat].index_copy_(1, column, tokens.view(-1, 1)),
        alphas,
        coverage,
        constraint_states,
    )
    values = {"beams": following, "state": scorer.reorder(state, flat), "prev": tokens.view(-1)}
    for name, value in values.items():
        if in_place:
            value = captured.write_back(getattr(s, name), value, strict)
        setattr(s, name, value)
    s.position = _next(s.position)


def _drop_done(scorer: Stepper[Any], s: _Beam) -> None:
    """Sentences that are done leave the batch (``kept_rows``: not below MIN_ROWS rows)."""
    keep = kept_rows(s.done.tolist(), s.width)
    if keep is None:
        return
    device = s.prev.device
    index = torch.tensor(keep, device=device)
    rows = (index[:, None] * s.width + torch.arange(s.width, device=device)).view(-1)
    s.state, s.beams = scorer.select(s.state, rows), s.beams.select(index, rows)
    s.prev, s.row_lengths = s.prev[rows], s.row_lengths[rows]
    s.limit, s.done, s.first_rows = s.limit[index], s.done[index], s.first_rows[: len(keep)]
    s.steering = s.steering.subset(keep) if s.steering is not None else None
    s.finished.select(keep)


def _beam_done(inputs: _Beam) -> Tensor:
    """Whether each sentence of a beam search is done (B,)."""
    return inputs.done
