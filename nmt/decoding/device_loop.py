"""Beam search with its loop on the device (``decoding.device_loop``, a GPU's default):
``nmt.decoding.search.beam_search``'s search, the same scores, in fixed shapes, so that the host never waits for a step and, on a GPU, a step is
one CUDA graph replayed.

The plain loop reads once a step which sentences are done, to drop them; on a GPU each read
waits until the device has run every kernel queued so far, and each of a step's many small
kernels is launched on its own. Here every sentence keeps its K rows to the end, and
everything a step reads and writes (``_Carry``) has a fixed shape and address:

- the output position being chosen, a 0-d tensor on the device, from which the length
  limits and the length penalty (a table made on the host, so that it is the plain loop's
  Python floats) are read;
- the alive hypotheses' scores, tokens (N, T) and, as needed, attention (N, T, S) and
  coverage (N, S), T the batch's longest output, written one column a step;
- each sentence's finished hypotheses (``Finished`` at its full size, written in place);
- whether each sentence is done, and the model's state (its ``step`` a 0-d tensor too).

Greedy search has one step for both loops (``nmt.decoding.search._greedy_step``), which
its fixed-shape loop runs through the same ``captured.run_steps``.

A step writes each of these back into its own tensor (``captured.write_back``). On a GPU
(``decoding.cuda_graphs``) the first steps run as they are, the next is captured as a CUDA
graph, and the rest replay it; the host learns that every sentence is done from a flag it
never waits for (``DoneFlag``), so the loop may run a step or two past the end, steps whose
candidates are all -inf and change nothing. There the batch is padded to a static shape
first, and its captured step is kept for later batches of that shape
(``nmt.decoding.captured``).

The plain loop's outputs (``tests/decoding/test_device_loop.py``: float64, every decoder,
n-best, both penalties, attention), save where round-off differs: the plain loop multiplies
fewer rows once sentences drop out. Prefixes, constraints and ``no_repeat_ngram`` take the
plain loop: they read the host's lists or the outputs' history at every step.
"""

from __future__ import annotations

import math
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
from nmt.decoding.ensemble import Stepper
from nmt.decoding.finished import Finished
from nmt.vocab import BOS_ID, EOS_ID


@dataclass
class _Carry:
    """What a step reads and writes, each tensor written back in place (see the module
    docstring): position () long, prev (N,), scores (B, K), tokens (N, T), alphas (N, T, S)
    or None, coverage (N, S) or None, done (B,) bool, the finished store and the state."""

    position: Tensor
    prev: Tensor
    scores: Tensor
    tokens: Tensor
    alphas: Tensor | None
    coverage: Tensor | None
    done: Tensor
    finished: Finished
    state: Any


@dataclass
class _Fixed:
    """What every step of a batch reads and no step writes: the beam size K, each sentence's
    length limit (B,), each row's source length (N,), each sentence's first row (B, 1), the
    length penalty of each output length 1..T (T,) float64 and the coverage penalty's beta."""

    beam_size: int
    limit: Tensor
    row_lengths: Tensor
    first_rows: Tensor
    penalties: Tensor
    beta: float


@dataclass
class _Search:
    """A beam search's step inputs: what it writes (``carry``) and what it only reads."""

    carry: _Carry
    fixed: _Fixed


@torch.no_grad()
def device_beam_search(
    scorer: Stepper[Any],
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    limits: list[int],
    n_best: int,
    return_attention: bool,
) -> list[tuple[list[float], list[float], list[list[int]], list[Tensor] | None]]:
    """The search of one batch, ``limits`` its sentences' longest outputs: per sentence the
    ``n_best`` best scores, log-probabilities, tokens and attention (``Finished``); where
    steps are captured, over the batch padded to a static shape (``captured.shaped_batch``)."""
    beam_size, device = decoding.beam_size, src.device
    graphs = captured.captures(decoding, device)
    batch, width, longest = src.size(0), src.size(1), max(limits)
    src, src_lengths, limits, length = captured.shaped_batch(
        graphs, scorer, src, src_lengths, limits, decoding
    )
    rows = src.size(0) * beam_size
    fixed = _Fixed(
        beam_size,
        torch.tensor(limits, device=device),
        src_lengths.repeat_interleave(beam_size),
        torch.arange(src.size(0), device=device)[:, None] * beam_size,
        torch.tensor(
            [length_penalty(n, decoding.length_penalty) for n in range(1, length + 1)],
            dtype=torch.float64,
            device=device,
        ),
        decoding.coverage_penalty,
    )
    scores = torch.full((src.size(0), beam_size), -math.inf, device=device)
    scores[:, 0] = 0.0  # one live hypothesis (the empty one) per sentence
    carry = _Carry(
        position=torch.ones((), dtype=torch.long, device=device),
        prev=torch.full((rows,), BOS_ID, dtype=torch.long, device=device),
        scores=scores,
        tokens=torch.zeros((rows, length), dtype=torch.long, device=device),
        alphas=src.new_zeros((rows, length, src.size(1)), dtype=torch.float32)
        if return_attention
        else None,
        coverage=src.new_zeros((rows, src.size(1)), dtype=torch.float32)
        if fixed.beta > 0
        else None,
        done=torch.zeros(src.size(0), dtype=torch.bool, device=device),
        finished=Finished(
            src.size(0),
            max(beam_size, n_best),
            src.size(1),
            return_attention,
            device,
            longest=length,
        ),
        state=captured.step_as_tensor(scorer.encode(src, src_lengths, repeat=beam_size), device),
    )

    def step(inputs: _Search, strict: bool = False) -> None:
        _search_step(scorer, inputs.carry, inputs.fixed, strict)

    settings = ("beam", beam_size, n_best, return_attention, fixed.beta)
    key = captured.kept_key(scorer, settings, graphs)
    done = captured.run_steps(step, _Search(carry, fixed), _search_done, longest, graphs, key)
    found = done.carry.finished.hypotheses(n_best)[:batch]
    if src.size(1) == width:
        return found
    return [  # the attention over the batch's own source positions
        (scores, log_probs, tokens, [a[:, :width] for a in alphas] if alphas else alphas)
        for scores, log_probs, tokens, alphas in found
    ]


def _search_step(scorer: Stepper[Any], carry: _Carry, fixed: _Fixed, strict: bool = False) -> None:
    """Score every row's next token, set aside the candidates that end, keep the best K
    that do not, and decide which sentences are done: the plain loop's step, in place
    (``strict``: nothing in the carry may be replaced, as a graph's capture needs)."""
    beam_size, length = fixed.beam_size, carry.position
    column = (length - 1).view(1)  # the tokens' column this step writes
    penalty = fixed.penalties.index_select(0, column)  # lp(length), (1,) float64
    log_probs, step_alphas, state = scorer.step(carry.prev, carry.state)  # (N, V), (N, S)
    _force_eos_on_device(log_probs, fixed.limit, length, beam_size)
    beams = Beams(carry.scores, carry.tokens, carry.alphas, None, None)
    top_scores, origins, top_tokens = top_candidates(
        beams, log_probs, beam_size, scorer.native_kernels
    )  # (B, 2K)
    kept = step_alphas.float() if carry.alphas is not None or carry.coverage is not None else None
    penalties = None  # (N,) float64: each row's coverage penalty, were it to end here
    if carry.coverage is not None and kept is not None:
        summed = carry.coverage + kept
        penalties = coverage_penalty(summed, fixed.row_lengths, fixed.beta).double()
    step = Candidates(top_scores, origins, top_tokens, kept, penalties)
    set_aside_finished(carry.finished, beams, step, carry.done, length, penalty, column)
    # the next K alive hypotheses (no constraints here: the limits are not read)
    alive_scores, picked, tokens, _ = next_alive(beams, log_probs, step, [], 0)  # (B, K)
    chosen = tokens.view(-1, 1)  # (N, 1)
    flat = (fixed.first_rows + picked).view(-1)  # (N,)
    captured.write_back(carry.state, scorer.reorder(state, flat), strict)
    carry.tokens.copy_(carry.tokens[flat].index_copy_(1, column, chosen))
    if carry.alphas is not None and kept is not None:
        carry.alphas.copy_(carry.alphas[flat].index_copy_(1, column, kept[flat].unsqueeze(1)))
    if carry.coverage is not None and kept is not None:
        carry.coverage.copy_(carry.coverage[flat] + kept[flat])
    carry.prev.copy_(chosen.view(-1))

    carry.done |= now_done(carry.finished, alive_scores, length, fixed.limit, beam_size, penalty)
    carry.scores.copy_(alive_scores.masked_fill(carry.done[:, None], -math.inf))
    carry.position += 1


def _force_eos_on_device(log_probs: Tensor, limit: Tensor, length: Tensor, beam_size: int) -> None:
    """Rows of sentences at their length limit (limit (B,)) may only end: every other token
    gets -inf (the plain loop's ``_force_eos_at_limit``, nothing read)."""
    at_limit = (limit <= length)[:, None].expand(-1, beam_size).reshape(-1)  # (N,)
    eos = log_probs[:, EOS_ID].clone()
    log_probs.masked_fill_(at_limit[:, None], -math.inf)
    log_probs[:, EOS_ID] = eos


def _search_done(inputs: _Search) -> Tensor:
    """Whether each sentence of a beam search is done (B,)."""
    return inputs.carry.done
