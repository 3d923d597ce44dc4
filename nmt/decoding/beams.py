"""The parts of beam search's step (``nmt.decoding.search._beam_step``): the alive
hypotheses (``Beams``), a step's best continuations (``top_candidates``), setting aside
those that end (``set_aside_finished``), the next alive hypotheses (``next_alive``) and the
stopping rule (``now_done``). The scores they compute are ``nmt.decoding.search``'s
s(Y, x)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.decoding.constraints import ConstraintState
from nmt.decoding.finished import Finished
from nmt.decoding.steering import constrained_beams
from nmt.fast.topk import top_k
from nmt.vocab import EOS_ID


def length_penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


def coverage_penalty(coverage: Tensor, src_lengths: Tensor, beta: float) -> Tensor:
    """cp(x; Y) per row: coverage (N, S) summed attention, src_lengths (N,) -> (N,) float32.

    A source token that no step attended to at all (local attention's zeros) would make the
    log -inf; its coverage is raised to float32's smallest normal number first.
    """
    tiny = torch.finfo(torch.float32).tiny
    capped = coverage.float().clamp(min=tiny, max=1.0).log()  # (N, S)
    positions = torch.arange(coverage.size(1), device=coverage.device)
    real = positions[None, :] < src_lengths[:, None]  # (N, S) padding excluded
    return beta * capped.masked_fill(~real, 0.0).sum(dim=-1)


@dataclass
class Beams:
    """Alive hypotheses of all sentences, flattened to (B*K), their outputs T wide (zeros
    past the output position)."""

    scores: Tensor  # (B, K) summed log-probabilities
    tokens: Tensor  # (B*K, T)
    alphas: Tensor | None  # (B*K, T, S)
    coverage: Tensor | None  # (B*K, S) summed attention, with a coverage penalty
    constraints: list[ConstraintState | None] | None  # (B*K) with constraints

    def select(self, sentences: Tensor, rows: Tensor) -> Beams:
        """The hypotheses of ``sentences`` (B',), whose rows are ``rows`` (B'*K,)."""
        constraints = None
        if self.constraints is not None:
            constraints = [self.constraints[r] for r in rows.tolist()]
        return Beams(
            self.scores[sentences],
            self.tokens[rows],
            self.alphas[rows] if self.alphas is not None else None,
            self.coverage[rows] if self.coverage is not None else None,
            constraints,
        )


def top_candidates(
    beams: Beams, log_probs: Tensor, beam_size: int, native: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(B*K, V) -> scores, source beam, token of the 2K best continuations, each (B, 2K).

    A sentence's best 2K continuations are among each of its hypotheses' own best 2K
    tokens (a hypothesis adds one score to all of its tokens), so the top-k runs per row
    and then over the K x 2K survivors, without a (B, K, V) sum. ``native``: the row top-k
    through the compiled kernel (``nmt.fast.topk``)."""
    batch = beams.scores.size(0)
    width = min(2 * beam_size, log_probs.size(-1))
    row_best, row_tokens = top_k(log_probs, width, native)  # (B*K, 2K)
    total = beams.scores.view(-1, 1) + row_best  # (B*K, 2K)
    scores, flat = total.view(batch, -1).topk(2 * beam_size, dim=-1)  # (B, 2K)
    return scores, flat // width, row_tokens.view(batch, -1).gather(1, flat)


@dataclass
class Candidates:
    """One step's candidates (each (B, 2K)), attention (B*K, S) and the finished
    hypotheses' coverage penalty per row (B*K,) in float64, or None."""

    scores: Tensor
    origins: Tensor
    tokens: Tensor
    alphas: Tensor | None
    penalties: Tensor | None


def set_aside_finished(
    finished: Finished,
    beams: Beams,
    step: Candidates,
    done: Tensor,
    length: int | Tensor,
    penalty: Tensor,
    column: Tensor,
) -> None:
    """Set aside candidates that end in EOS among each open sentence's top K, with their
    score s(Y, x) in float64, ``penalty`` lp(length) (1,) float64; ``column`` (1,): this
    step's in the beams' outputs. At a Python int ``length`` (a loop that reads the device
    at every step) nothing is added where none ended; in fixed shapes the candidates are
    added without reading that."""
    beam_size = beams.scores.size(1)
    top_scores, top_tokens = step.scores[:, :beam_size], step.tokens[:, :beam_size]
    # finite: a top score is at most 0, or -inf (one comparison; isfinite takes four kernels)
    is_eos = (top_tokens == EOS_ID) & (top_scores > -math.inf) & ~done[:, None]  # (N, K)
    if isinstance(length, int) and not bool(is_eos.any()):
        return
    sentences = torch.arange(top_scores.size(0), device=top_scores.device)[:, None]
    sources = sentences * beam_size + step.origins[:, :beam_size]  # (N, K) their rows
    log_prob = top_scores.double()
    score = log_prob / penalty
    if step.penalties is not None:
        score = score + step.penalties[sources]
    alphas = None  # (N, K, T, S)
    if beams.alphas is not None and step.alphas is not None:
        ended = step.alphas[sources].unsqueeze(2)  # (N, K, 1, S)
        alphas = beams.alphas[sources].index_copy_(2, column, ended)
    finished.add(
        score.masked_fill(~is_eos, -math.inf), log_prob, length, beams.tokens[sources], alphas
    )


def now_done(
    finished: Finished,
    alive_scores: Tensor,
    length: int | Tensor,
    limit: Tensor,
    beam_size: int,
    penalty: Tensor,
) -> Tensor:
    """(N,) the sentences done after this step: at their length limit, or with K finished
    of which the best scores at least the best alive hypothesis over the length penalty
    ``penalty`` lp(length) (which only falls as log P does)."""
    beaten = finished.best() >= alive_scores[:, 0].double() / penalty
    return (limit <= length) | ((finished.count >= beam_size) & beaten)


def next_alive(
    beams: Beams, log_probs: Tensor, step: Candidates, limit: Tensor, length: int | Tensor
) -> tuple[Tensor, Tensor, Tensor, list[ConstraintState | None] | None]:
    """The next K alive hypotheses per sentence: the best non-EOS candidates, or for a
    constrained sentence Post & Vilar's allocation (which reads the length limits (B,)
    on the host). -> scores, origins, tokens (B, K), and
    the constraint states (B*K) or None."""
    beam_size = beams.scores.size(1)
    scores = step.scores.masked_fill(step.tokens == EOS_ID, -math.inf)
    alive_scores, pick = scores.topk(beam_size, dim=-1)  # (B, K) best non-EOS
    origins, tokens = step.origins.gather(1, pick), step.tokens.gather(1, pick)
    if beams.constraints is None:
        return alive_scores, origins, tokens, None
    top = (step.scores, step.origins, step.tokens)
    limits, position = limit.tolist(), int(length)
    chosen = constrained_beams(beams.scores, log_probs, top, beams.constraints, limits, position)
    if chosen.sentences:
        rows = torch.tensor(chosen.sentences, device=alive_scores.device)
        alive_scores[rows] = torch.tensor(chosen.scores, device=alive_scores.device)
        origins[rows] = torch.tensor(chosen.origins, device=origins.device)
        tokens[rows] = torch.tensor(chosen.tokens, device=tokens.device)
    states: list[ConstraintState | None] = [None] * len(beams.constraints)
    for b, k in enumerate(origins.view(-1).tolist()):
        states[b] = beams.constraints[(b // beam_size) * beam_size + k]
    for b in chosen.sentences:  # their states were advanced by the allocation
        states[b * beam_size : (b + 1) * beam_size] = chosen.states[
            b * beam_size : (b + 1) * beam_size
        ]
    return alive_scores, origins, tokens, states
