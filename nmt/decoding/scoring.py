"""Forced scoring: the probability a model (or an ensemble) gives a given translation.

For a source x and a target y = y_1 .. y_n, teacher forcing reads BOS y and predicts y EOS:

    log P(y | x) = sum_{t=1}^{n+1} log p(y_t | y_<t, x),   y_{n+1} = EOS

and the length-normalised score is what beam search ranks by (nmt.decoding.search):
log P(y | x) / lp(y) + cp(x; y), with the length penalty over n + 1 tokens and the coverage
penalty over every step's attention. An empty target scores EOS alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.config import DecodingConfig
from nmt.data.batching import length_sorted_batches, pad
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.search import coverage_penalty, length_penalty
from nmt.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Scored:
    """One pair's scores: log_prob = log P(y | x); score, length-normalised (and with the
    coverage penalty when set); token_log_probs, one per target piece and EOS; alphas
    (n+1, S) the attention while reading y, or None; alignment (n+1, S) the alignment
    heads' weights (nmt.model.aligner) when asked for the attention and every model has
    one, else None."""

    log_prob: float
    score: float
    token_log_probs: list[float]
    alphas: Tensor | None = None
    alignment: Tensor | None = None


@torch.no_grad()
def score_batch(
    scorer: Ensemble,
    src: Tensor,
    src_lengths: Tensor,
    trg_ids: Sequence[Sequence[int]],
    decoding: DecodingConfig,
    return_attention: bool = False,
) -> list[Scored]:
    """src (B, S) padded source ids, src_lengths (B,), trg_ids the B targets without BOS and
    EOS -> one Scored per pair."""
    device = src.device
    trg_in = pad([[BOS_ID, *y] for y in trg_ids]).to(device)  # (B, T)
    trg_out = pad([[*y, EOS_ID] for y in trg_ids]).to(device)  # (B, T)
    heads = trg_out if return_attention else None
    log_probs, alphas, aligned = scorer.teacher_forced(src, src_lengths, trg_in, heads)
    picked = log_probs.float().gather(2, trg_out.unsqueeze(2)).squeeze(2)  # (B, T)
    real = trg_out != PAD_ID  # (B, T)
    penalties = None
    if decoding.coverage_penalty > 0:
        coverage = (alphas.float() * real.unsqueeze(2)).sum(dim=1)  # (B, S)
        penalties = coverage_penalty(coverage, src_lengths, decoding.coverage_penalty).tolist()
    rows = picked.cpu().tolist()
    out = []
    for b, y in enumerate(trg_ids):
        length = len(y) + 1
        tokens = rows[b][:length]
        log_prob = float(torch.tensor(tokens, dtype=torch.float64).sum())
        score = log_prob / length_penalty(length, decoding.length_penalty)
        if penalties is not None:
            score += penalties[b]
        attention = alignment = None
        if return_attention:
            attention = alphas[b, :length, : int(src_lengths[b])].float().cpu()
        if aligned is not None:
            alignment = aligned[b, :length, : int(src_lengths[b])].float().cpu()
        out.append(Scored(log_prob, score, tokens, attention, alignment))
    return out


def score_ids(
    scorer: Ensemble,
    src_ids: Sequence[list[int]],
    trg_ids: Sequence[list[int]],
    decoding: DecodingConfig,
    device: torch.device,
    return_attention: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[Scored]:
    """Score every pair (non-empty sources), in batches of ``decoding.batch_size`` sorted by
    source length; results in input order."""
    out: list[Scored | None] = [None] * len(src_ids)
    lengths = [len(s) for s in src_ids]
    for index in length_sorted_batches(lengths, decoding.batch_size, None):
        chunk = [src_ids[i] for i in index]
        src = pad(chunk).to(device)
        src_lengths = torch.tensor([len(s) for s in chunk], device=device)
        targets = [trg_ids[i] for i in index]
        results = score_batch(scorer, src, src_lengths, targets, decoding, return_attention)
        for i, result in zip(index, results, strict=True):
            out[int(i)] = result
        if progress is not None:
            progress(len(index))
    return [r for r in out if r is not None]
