"""Greedy and batched beam search over token ids; no strings here. One implementation for
every search: a single model, an ensemble or the exported graphs under onnxruntime (anything
that keeps the step contract, ``nmt.decoding.ensemble.Stepper``), with or without coverage
penalty, target prefixes and lexical constraints (nmt.decoding.steering).

Beam search keeps sentences x beams in one (B*K) batch: the encoder runs once, the keys are
projected once, finished hypotheses are set aside with their score on the device
(``nmt.decoding.finished``), sentences that are done leave the batch (``kept_rows``), and
the loop ends when every sentence is done; on a GPU the loop reads nothing from the device
until its end and keeps every row (``decoding.device_loop``). A finished hypothesis Y of
source x scores (Wu et al. 2016, eq. 14)

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
from collections.abc import Sequence
from dataclasses import dataclass
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
from nmt.decoding.device_loop import device_beam_search
from nmt.decoding.ensemble import Stepper, stepper
from nmt.decoding.finished import Finished
from nmt.decoding.floor import MIN_ROWS
from nmt.decoding.steering import (
    Steering,
    forbid_early_eos,
    force_prefixes,
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
) -> list[Hypothesis]:
    """Argmax decoding for a batch (``decoding.beam_size`` is not read); what beam search
    runs for beam size 1.

    Like beam search, a sentence at its maximum length may only end (EOS is forced), and the
    score is s(Y, x) of the output including EOS. One loop (``captured.run_steps``) over
    one step (``_greedy_step``). By default rows that have ended leave the batch
    (``_drop_ended``, ``kept_rows``) and the host's bans apply (prefixes,
    ``no_repeat_ngram``); with ``decoding.device_loop`` (a GPU's default) every row runs
    to the end in fixed shapes, nothing read until then, and on a GPU the step after the
    first few is a CUDA graph, the batch padded to a static shape (``nmt.decoding.captured``).
    """
    scorer = stepper(model)
    steering = Steering(prefixes) if prefixes is not None else None
    limits = search_limits(src_lengths, decoding.max_len_ratio, decoding.max_len_offset, steering)
    keep_alphas = return_attention or decoding.coverage_penalty > 0
    device, batch, width, longest = src.device, src.size(0), src.size(1), max(limits)
    own_lengths = src_lengths  # (B,) the batch's, before any padding to a static shape
    fixed = runs_on_device(decoding, device, steering)
    graphs = fixed and captured.captures(decoding, device)
    length = longest
    if fixed:
        src, src_lengths, limits, length = captured.shaped_batch(
            graphs, scorer, src, src_lengths, limits, decoding
        )
    state = scorer.encode(src, src_lengths)
    g = _Greedy.first(
        captured.step_as_tensor(state, device) if fixed else state, limits, length, device
    )
    if fixed:
        g.position = torch.ones((), dtype=torch.long, device=device)
    g.prefixes = prefixes
    host = bool(decoding.no_repeat_ngram) or prefixes is not None

    def step(inputs: _Greedy, strict: bool = False) -> None:
        bans = decoding.no_repeat_ngram if host else None
        _greedy_step(scorer, inputs, keep_alphas, bans, in_place=fixed, strict=strict)

    floor = min(MIN_ROWS, scorer.row_floor) if batch > 1 else MIN_ROWS  # (tests lower MIN_ROWS)
    drop = None if fixed else lambda inputs: _drop_ended(scorer, inputs, floor)
    key = captured.kept_key(scorer, ("greedy", keep_alphas), graphs)
    done = captured.run_steps(step, g, _greedy_ended, longest, graphs, key, after=drop)
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
    in order), and the stepped rows' prefixes, if any."""

    limit: Tensor
    position: int | Tensor
    prev: Tensor
    ended: Tensor
    state: Any
    tokens: Tensor
    scores: Tensor | None = None
    alphas: Tensor | None = None
    rows: Tensor | None = None
    prefixes: Sequence[Sequence[int]] | None = None

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


def _greedy_step(
    scorer: Stepper[Any],
    g: _Greedy,
    keep_alphas: bool,
    bans: int | None = None,
    in_place: bool = False,
    strict: bool = False,
) -> None:
    """The argmax of each stepped row (with ``bans``, the host's first: its prefixes'
    forced tokens and, if ``bans`` is not 0, no repeated n-gram of that size; EOS at its
    limit), written at the position's column; ``in_place``: the state written back into
    its own tensors, as fixed shapes need (``strict``: nothing replaced, as a capture
    needs)."""
    log_probs, step_alphas, state = scorer.step(g.prev, g.state)  # (N, V), (N, S)
    if g.scores is None:
        g.scores = log_probs.new_zeros(g.tokens.shape)  # (B, T)
        if keep_alphas:
            width = step_alphas.size(-1)
            g.alphas = step_alphas.new_zeros((*g.tokens.shape, width)).float()  # (B, T, S)
    if bans is not None:
        _host_bans(log_probs, g, bans)
    best, chosen = row_max(log_probs, scorer.native_kernels)  # (N,), (N,)
    at_limit = g.limit <= g.position  # (N,) only EOS may follow
    chosen = chosen.masked_fill(at_limit, EOS_ID)
    best = torch.where(at_limit, log_probs[:, EOS_ID], best)
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
    if isinstance(g.position, Tensor):
        g.position.add_(1)
    else:
        g.position += 1


def _host_bans(log_probs: Tensor, g: _Greedy, no_repeat_ngram: int) -> None:
    """The bans read from the host, in place: repeated n-grams of the outputs so far, and
    the prefixes' forced tokens (at a Python int position: the loop that drops rows)."""
    length = int(g.position)
    if no_repeat_ngram and length > 1:
        history = g.tokens[:, : length - 1]  # (B, t)
        stepped = history if g.rows is None else history[g.rows]
        block_repeated_ngrams(log_probs, stepped, no_repeat_ngram)
    if g.prefixes is not None:
        force_prefixes(log_probs, g.prefixes, length, 1)


def _drop_ended(scorer: Stepper[Any], g: _Greedy, floor: int) -> None:
    """Rows that have ended leave the batch (``kept_rows``: not below ``floor`` rows)."""
    chosen = kept_rows(g.ended.tolist(), 1, floor) if g.prev.size(0) > floor else None
    if chosen is None:
        return
    keep = torch.tensor(chosen, device=g.prev.device)  # (N',)
    rows = g.rows if g.rows is not None else torch.arange(g.prev.size(0), device=keep.device)
    g.state = scorer.select(g.state, keep)
    g.rows, g.prev, g.limit, g.ended = rows[keep], g.prev[keep], g.limit[keep], g.ended[keep]
    if g.prefixes is not None:
        g.prefixes = [g.prefixes[i] for i in chosen]


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


DROP_SHARE = 8  # ended sentences are dropped once they are 1/DROP_SHARE of the batch


def kept_rows(ended: Sequence[bool], width: int = 1, floor: int = MIN_ROWS) -> list[int] | None:
    """The sentences (each ``width`` rows: its beams) that a batch keeps when it drops those
    that have ended, or None to keep them all for now.

    Each drop copies the source memory of the rest, so it waits until an eighth of the
    sentences have ended. A batch never falls below ``floor`` rows (ended sentences stay to
    fill them): the stepper's ``row_floor``, MIN_ROWS where a matmul library may take other
    kernels for a few rows, whose round-off differs, so that a sentence's outcome would
    depend on when the others ended (``nmt.decoding.floor``).
    """
    alive = [i for i, done in enumerate(ended) if not done]
    filler = [i for i, done in enumerate(ended) if done]
    wanted = max(len(alive), math.ceil(floor / width))
    keep = sorted(alive + filler[: max(0, wanted - len(alive))])
    dropped = len(ended) - len(keep)
    return keep if dropped > 0 and dropped * DROP_SHARE >= len(ended) else None


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


@torch.no_grad()
def beam_search(
    model: Seq2Seq | Stepper[Any],
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    n_best: int = 1,
    return_attention: bool = False,
    steering: Steering | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the ``n_best`` hypotheses per sentence, best first.

    ``steering``: per-sentence prefixes and constraints. A constrained sentence for which
    no hypothesis meets every constraint within its length limit (possible only when
    ``no_repeat_ngram`` blocks a constraint) gets an empty list.

    The finished hypotheses and the stopping rule live on the device (``Finished``). The
    loop reads once a step which sentences are done, and drops them (``kept_rows``); with
    ``decoding.device_loop`` (a GPU's default) it reads nothing until the end and keeps
    every row (``runs_on_device``).
    """
    beam_size, alpha = decoding.beam_size, decoding.length_penalty
    if steering is not None and steering.constrained and beam_size == 1:
        raise ValueError("lexical constraints need a beam of at least 2")
    if beam_size == 1 and n_best == 1:
        prefixes = steering.prefixes if steering is not None else None
        hyps = greedy_search(model, src, src_lengths, decoding, return_attention, prefixes)
        return [[h] for h in hyps]
    scorer = stepper(model)
    batch, device = src.size(0), src.device
    limits = search_limits(src_lengths, decoding.max_len_ratio, decoding.max_len_offset, steering)
    if runs_on_device(decoding, device, steering):
        found = device_beam_search(
            scorer, src, src_lengths, decoding, limits, n_best, return_attention
        )
        return _hypotheses(found)
    state = scorer.encode(src, src_lengths, repeat=beam_size)
    beams = _first_beams(src, decoding, return_attention, steering)
    live = _Live.first(limits, steering, device)
    row_lengths = src_lengths.repeat_interleave(beam_size)
    prev = torch.full((batch * beam_size,), BOS_ID, dtype=torch.long, device=device)
    finished = Finished(batch, max(beam_size, n_best), src.size(1), return_attention, device)
    for length in range(1, max(limits) + 1):
        log_probs, step_alphas, state = scorer.step(prev, state)  # (N*K, V), (N*K, S)
        _restrict(log_probs, beams, decoding, live, length)
        scores, origins, tokens = top_candidates(beams, log_probs, beam_size, scorer.native_kernels)
        kept = None  # this step's attention, when a hypothesis keeps it or sums it
        if beams.alphas is not None or beams.coverage is not None:
            kept = step_alphas.float()
        penalties = None  # (N*K,) float64: each row's coverage penalty, were it to end here
        if beams.coverage is not None and kept is not None:
            coverage = beams.coverage + kept
            penalties = coverage_penalty(coverage, row_lengths, decoding.coverage_penalty).double()
        step = Candidates(scores, origins, tokens, kept, penalties)
        penalty = length_penalty(length, alpha)
        set_aside_finished(finished, beams, step, live.done, length, penalty)
        alive_scores, origins, tokens, constraint_states = next_alive(
            beams, log_probs, step, live.limits, length
        )
        present = len(live.limits)
        flat = (torch.arange(present, device=device)[:, None] * beam_size + origins).view(-1)
        state = scorer.reorder(state, flat)
        beams = _advance(beams, step, alive_scores, flat, tokens, constraint_states)
        prev = tokens.view(-1)
        live.done |= now_done(finished, alive_scores, length, live.limit, beam_size, penalty)
        beams.scores.masked_fill_(live.done[:, None], -math.inf)
        done = live.done.tolist()
        if all(done):
            break
        keep = kept_rows(done, beam_size, MIN_ROWS)  # (the probed floor: no faster, benchmarks.md)
        if keep is not None:
            index = torch.tensor(keep, device=device)
            rows = (index[:, None] * beam_size + torch.arange(beam_size, device=device)).view(-1)
            state = scorer.select(state, rows)
            beams = beams.select(index, rows)
            prev, row_lengths = prev[rows], row_lengths[rows]
            live = live.subset(keep, index)
            finished.select(keep)
    return _hypotheses(finished.hypotheses(n_best))


def _hypotheses(
    found: list[tuple[list[float], list[float], list[list[int]], list[Tensor] | None]],
) -> list[list[Hypothesis]]:
    """``Finished.hypotheses`` as each sentence's Hypothesis list."""
    return [
        [
            Hypothesis(tokens, score, alphas[f] if alphas is not None else None, log_prob)
            for f, (score, log_prob, tokens) in enumerate(
                zip(scores, log_probs, token_lists, strict=True)
            )
        ]
        for scores, log_probs, token_lists, alphas in found
    ]


def runs_on_device(
    decoding: DecodingConfig, device: torch.device, steering: Steering | None
) -> bool:
    """Whether a search (beam or greedy) keeps its loop on the device
    (``decoding.device_loop``; None: on a GPU; ``nmt.decoding.device_loop``). Prefixes and
    constraints are steered from the host, and ``no_repeat_ngram`` reads the outputs'
    history, at every step: a search with them takes the plain loop."""
    wanted = decoding.device_loop
    if wanted is None:
        wanted = device.type == "cuda"
    return wanted and steering is None and not decoding.no_repeat_ngram


@dataclass
class _Live:
    """The sentences a beam search still steps, in row order: their length limit (a list
    for the host, ``limit`` (N,) on the device), whether each is done (N,) bool on the
    device (a done one stays until ``kept_rows`` drops it), and their steering."""

    limits: list[int]
    limit: Tensor
    done: Tensor
    steering: Steering | None

    @classmethod
    def first(cls, limits: list[int], steering: Steering | None, device: torch.device) -> _Live:
        done = torch.zeros(len(limits), dtype=torch.bool, device=device)
        return cls(limits, torch.tensor(limits, device=device), done, steering)

    def subset(self, keep: list[int], index: Tensor) -> _Live:
        """The sentences ``keep`` (as ``index`` on the device)."""
        return _Live(
            [self.limits[i] for i in keep],
            self.limit[index],
            self.done[index],
            self.steering.subset(keep) if self.steering is not None else None,
        )


def _first_beams(
    src: Tensor,
    decoding: DecodingConfig,
    return_attention: bool,
    steering: Steering | None,
) -> Beams:
    """One live hypothesis (the empty one) per sentence, K-1 dead slots beside it."""
    batch, beam_size, device = src.size(0), decoding.beam_size, src.device
    rows, width = batch * beam_size, src.size(1)
    scores = torch.full((batch, beam_size), -math.inf, device=device)
    scores[:, 0] = 0.0
    return Beams(
        scores,
        torch.empty((rows, 0), dtype=torch.long, device=device),
        src.new_empty((rows, 0, width), dtype=torch.float32) if return_attention else None,
        src.new_zeros((rows, width), dtype=torch.float32)
        if decoding.coverage_penalty > 0
        else None,
        steering.initial_states(beam_size)
        if steering is not None and steering.constrained
        else None,
    )


def _restrict(
    log_probs: Tensor,
    beams: Beams,
    decoding: DecodingConfig,
    live: _Live,
    length: int,
) -> None:
    """This step's bans, in place: repeated n-grams, the prefixes' forced tokens, EOS at the
    length limit, and EOS before a hypothesis has met its constraints."""
    beam_size = beams.scores.size(1)
    if decoding.no_repeat_ngram:
        block_repeated_ngrams(log_probs, beams.tokens, decoding.no_repeat_ngram)
    if live.steering is not None and live.steering.prefixes is not None:
        force_prefixes(log_probs, live.steering.prefixes, length, beam_size)
    _force_eos_at_limit(log_probs, live.limits, length, beam_size)
    if beams.constraints is not None:
        forbid_early_eos(log_probs, beams.constraints)


def _advance(
    beams: Beams,
    step: Candidates,
    alive_scores: Tensor,
    flat: Tensor,
    tokens: Tensor,
    constraint_states: list[ConstraintState | None] | None,
) -> Beams:
    """The alive hypotheses ``flat`` (B*K,) extended by ``tokens`` (B, K)."""
    alphas, coverage = None, None
    if beams.alphas is not None and step.alphas is not None:
        alphas = torch.cat([beams.alphas[flat], step.alphas[flat].unsqueeze(1)], dim=1)
    if beams.coverage is not None and step.alphas is not None:
        coverage = beams.coverage[flat] + step.alphas[flat]
    return Beams(
        alive_scores,
        torch.cat([beams.tokens[flat], tokens.view(-1, 1)], dim=1),
        alphas,
        coverage,
        constraint_states,
    )


def _force_eos_at_limit(log_probs: Tensor, limits: list[int], length: int, beam_size: int) -> None:
    """Sentences at their maximum length may only end: every other token gets -inf."""
    at_limit = [b for b, limit in enumerate(limits) if length >= limit]
    if not at_limit:
        return
    rows = torch.tensor(at_limit, device=log_probs.device)
    rows = (rows[:, None] * beam_size + torch.arange(beam_size, device=log_probs.device)).view(-1)
    eos = log_probs[rows, EOS_ID].clone()
    log_probs[rows] = -math.inf
    log_probs[rows, EOS_ID] = eos


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
