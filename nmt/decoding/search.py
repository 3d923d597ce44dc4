"""Greedy and batched beam search over token ids; no strings here.

Beam search keeps sentences x beams in one (B*K) batch: the encoder runs once, the keys are
projected once, finished hypotheses are set aside with their length-normalised score, and the
loop ends when every sentence is done. Scores are sums of log-probabilities divided by the
GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14), where |Y| counts
the output tokens including the final EOS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.config import DecodingConfig
from nmt.model import Seq2Seq
from nmt.model.attention import Memory
from nmt.model.decoder import DecoderState
from nmt.vocab import BOS_ID, EOS_ID


@dataclass
class Hypothesis:
    """tokens exclude EOS; score is the length-normalised log-probability;
    alphas: (len(tokens)+1, S) attention for each output token including EOS, or None."""

    tokens: list[int]
    score: float
    alphas: Tensor | None = None


def length_penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src_lengths: Tensor, ratio: float, offset: int) -> Tensor:
    """Longest output per sentence: ratio * source length + offset (at least 1)."""
    return (src_lengths.float() * ratio).ceil().long().add(offset).clamp(min=1)


@torch.no_grad()
def greedy_search(
    model: Seq2Seq,
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    return_attention: bool = False,
) -> list[Hypothesis]:
    """Argmax decoding for a batch (``decoding.beam_size`` is not read); what beam search
    runs for beam size 1.

    Like beam search, a sentence at its maximum length may only end (EOS is forced), and the
    score is the length-normalised log-probability of the output including EOS.
    """
    batch = src.size(0)
    no_repeat_ngram = decoding.no_repeat_ngram
    limit_tensor = max_lengths(src_lengths, decoding.max_len_ratio, decoding.max_len_offset)
    longest = int(limit_tensor.max())
    memory, state = model.encode(src, src_lengths)
    prev = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
    tokens: list[Tensor] = []
    scores: list[Tensor] = []
    alphas: list[Tensor] = []
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    for t in range(longest):
        features, alphas_t, state = model.decoder.step(prev, memory, state)
        log_probs = model.log_probs(features)  # (B, V)
        if no_repeat_ngram and tokens:
            block_repeated_ngrams(log_probs, torch.stack(tokens, dim=1), no_repeat_ngram)
        best, prev = log_probs.max(dim=-1)  # (B,), (B,)
        at_limit = limit_tensor <= t + 1  # (B,) only EOS may follow
        prev = prev.masked_fill(at_limit, EOS_ID)
        best = torch.where(at_limit, log_probs[:, EOS_ID], best)
        tokens.append(prev)
        scores.append(best.masked_fill(done, 0.0))
        if return_attention:
            alphas.append(alphas_t)
        done = done | (prev == EOS_ID)
        if bool(done.all()):
            break
    return _collect_greedy(tokens, scores, alphas, decoding.length_penalty, return_attention)


def _collect_greedy(
    tokens: list[Tensor],
    scores: list[Tensor],
    alphas: list[Tensor],
    alpha: float,
    return_attention: bool,
) -> list[Hypothesis]:
    ids = torch.stack(tokens, dim=1).tolist()  # (B, T)
    score_rows = torch.stack(scores, dim=1).cpu()  # (B, T)
    attention = torch.stack(alphas, dim=1).cpu() if return_attention else None  # (B, T, S)
    out = []
    for row, seq in enumerate(ids):
        length = seq.index(EOS_ID) + 1  # every row ends in EOS by its limit
        total = float(score_rows[row, :length].sum()) / length_penalty(length, alpha)
        out.append(
            Hypothesis(
                seq[: length - 1], total, attention[row, :length] if attention is not None else None
            )
        )
    return out


@dataclass
class _Beams:
    """Alive hypotheses of all sentences, flattened to (B*K)."""

    scores: Tensor  # (B, K) summed log-probabilities
    tokens: Tensor  # (B*K, t)
    alphas: Tensor | None  # (B*K, t, S)


def _expand(
    model: Seq2Seq, src: Tensor, src_lengths: Tensor, beam_size: int
) -> tuple[Memory, DecoderState]:
    """The encoder's memory and the decoder's first state, each sentence repeated K times."""
    memory, state = model.encode(src, src_lengths)
    index = torch.arange(src.size(0), device=src.device).repeat_interleave(beam_size)
    return memory.index_select(index), model.decoder.reorder(state, index)


def _top_candidates(
    beams: _Beams, log_probs: Tensor, beam_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(B*K, V) -> scores, source beam, token of the 2K best continuations, each (B, 2K)."""
    batch = beams.scores.size(0)
    vocab = log_probs.size(-1)
    total = beams.scores.unsqueeze(-1) + log_probs.view(batch, beam_size, vocab)  # (B, K, V)
    scores, flat = total.view(batch, -1).topk(2 * beam_size, dim=-1)  # (B, 2K)
    return scores, flat // vocab, flat % vocab


def _finalise(
    finished: list[list[Hypothesis]],
    beams: _Beams,
    step_alphas: Tensor | None,
    scores: Tensor,
    origins: Tensor,
    tokens: Tensor,
    done: list[bool],
    alpha: float,
) -> None:
    """Set aside candidates that end in EOS among each sentence's top K (still open only)."""
    beam_size = beams.scores.size(1)
    is_eos = (tokens[:, :beam_size] == EOS_ID) & torch.isfinite(scores[:, :beam_size])
    length = beams.tokens.size(1) + 1
    penalty = length_penalty(length, alpha)
    for b, k in is_eos.nonzero().tolist():
        if done[b]:
            continue
        source = b * beam_size + int(origins[b, k])
        alphas = None
        if beams.alphas is not None and step_alphas is not None:
            alphas = torch.cat([beams.alphas[source], step_alphas[source : source + 1]], dim=0)
        finished[b].append(
            Hypothesis(beams.tokens[source].tolist(), float(scores[b, k]) / penalty, alphas)
        )


def _is_done(
    finished: list[Hypothesis],
    best_alive: float,
    length: int,
    limit: int,
    beam_size: int,
    alpha: float,
) -> bool:
    if length >= limit:
        return True
    if len(finished) < beam_size:
        return False
    best_finished = max(h.score for h in finished)
    return best_finished >= best_alive / length_penalty(length, alpha)


@torch.no_grad()
def beam_search(
    model: Seq2Seq,
    src: Tensor,
    src_lengths: Tensor,
    decoding: DecodingConfig,
    n_best: int = 1,
    return_attention: bool = False,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the ``n_best`` hypotheses per sentence, best first."""
    beam_size, alpha = decoding.beam_size, decoding.length_penalty
    if beam_size == 1 and n_best == 1:
        return [[h] for h in greedy_search(model, src, src_lengths, decoding, return_attention)]
    batch, device = src.size(0), src.device
    limits = max_lengths(src_lengths, decoding.max_len_ratio, decoding.max_len_offset).tolist()
    memory, state = _expand(model, src, src_lengths, beam_size)
    initial = torch.full((batch, beam_size), -math.inf, device=device)
    initial[:, 0] = 0.0  # only one live hypothesis at the start
    beams = _Beams(
        initial,
        torch.empty((batch * beam_size, 0), dtype=torch.long, device=device),
        memory.values.new_empty((batch * beam_size, 0, src.size(1)), dtype=torch.float32)
        if return_attention
        else None,
    )
    prev = torch.full((batch * beam_size,), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    done = [False] * batch
    while not all(done):
        length = beams.tokens.size(1) + 1
        features, step_alphas, state = model.decoder.step(prev, memory, state)
        log_probs = model.log_probs(features)  # (B*K, V)
        if decoding.no_repeat_ngram:
            block_repeated_ngrams(log_probs, beams.tokens, decoding.no_repeat_ngram)
        _force_eos_at_limit(log_probs, limits, length, beam_size)
        scores, origins, tokens = _top_candidates(beams, log_probs, beam_size)
        _finalise(
            finished,
            beams,
            step_alphas if return_attention else None,
            scores,
            origins,
            tokens,
            done,
            alpha,
        )
        scores = scores.masked_fill(tokens == EOS_ID, -math.inf)
        alive_scores, pick = scores.topk(beam_size, dim=-1)  # (B, K) best non-EOS
        origins, tokens = origins.gather(1, pick), tokens.gather(1, pick)
        flat = (torch.arange(batch, device=device)[:, None] * beam_size + origins).view(-1)
        state = model.decoder.reorder(state, flat)
        beams = _Beams(
            alive_scores,
            torch.cat([beams.tokens[flat], tokens.view(-1, 1)], dim=1),
            torch.cat([beams.alphas[flat], step_alphas[flat].unsqueeze(1).float()], dim=1)
            if beams.alphas is not None
            else None,
        )
        prev = tokens.view(-1)
        best_alive = alive_scores[:, 0].tolist()
        for b in range(batch):
            if not done[b]:
                done[b] = _is_done(finished[b], best_alive[b], length, limits[b], beam_size, alpha)
        beams.scores.masked_fill_(torch.tensor(done, device=device)[:, None], -math.inf)
    return [sorted(hyps, key=lambda h: -h.score)[:n_best] for hyps in finished]


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
