"""A lexical table from the training pairs: for each source piece, the target pieces it is
most likely translated by, and the target pieces most frequent overall. Decoding restricts
the output layer to these (``nmt.decoding.shortlist``), as Marian's lexical shortlist does.

The translation probabilities are IBM Model 1's (Brown et al. 1993, section 4.1): with a
NULL piece s_0 added to every source sentence, EM on the pairs (x, y),

    E: c(t | s; x, y) = sum_{j: y_j = t} t(t | s) / sum_{i=0}^{|x|} t(t | x_i) * #{i: x_i = s}
    M: t(t | s) = sum_{(x, y)} c(t | s; x, y) / sum_t' sum_{(x, y)} c(t' | s; x, y)

from a uniform start. Each source piece keeps its ``per_word`` most probable target pieces
(fewer where fewer ever co-occur with it); NULL's are not kept, since the frequent pieces
cover what no source word brings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PER_WORD = 100  # translations kept per source piece (decoding may take fewer)
FREQUENT = 1000  # most frequent target pieces kept (decoding may take fewer)
ITERATIONS = 5  # EM iterations of Model 1
MAX_EVENTS = 30_000_000  # (source piece, target piece) co-occurrences Model 1 holds at once
SLICE_POSITIONS = 200_000  # target positions per slice of the E-step
DENSE_KEYS = 1 << 27  # (source, target) pairs up to which keys are indexed through a table


@dataclass
class Lexicon:
    """frequent: (F,) target ids, most frequent first; table: (V_src, K) target ids per
    source id, most probable first, -1 where a source id has fewer than K."""

    frequent: np.ndarray
    table: np.ndarray


def build_lexicon(
    src_ids: Sequence[Sequence[int]],
    trg_ids: Sequence[Sequence[int]],
    src_vocab_size: int,
    trg_vocab_size: int,
    per_word: int = PER_WORD,
    frequent: int = FREQUENT,
    iterations: int = ITERATIONS,
) -> Lexicon:
    """The lexicon of these pairs (piece ids without BOS or EOS)."""
    counts = np.zeros(trg_vocab_size, dtype=np.int64)
    for ids in trg_ids:
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    order = np.argsort(-counts, kind="stable")
    most = order[counts[order] > 0][:frequent]
    keys, probs = model1(src_ids, trg_ids, src_vocab_size, trg_vocab_size, iterations)
    table = _best(keys, probs, src_vocab_size, trg_vocab_size, per_word)
    return Lexicon(most.astype(np.int32), table)


def lexicon_sample(src_lengths: np.ndarray, trg_lengths: np.ndarray, seed: int) -> np.ndarray:
    """The pairs a lexicon is built from: all of them, or where they hold more than
    MAX_EVENTS co-occurrences, pairs in a seeded order until that many (sorted indices)."""
    sizes = (np.asarray(src_lengths, dtype=np.int64) + 1) * np.asarray(trg_lengths)
    if sizes.sum() <= MAX_EVENTS:
        return np.arange(len(sizes))
    order = np.random.default_rng(seed).permutation(len(sizes))
    taken = int(np.searchsorted(np.cumsum(sizes[order]), MAX_EVENTS, side="right"))
    return np.sort(order[:taken])


def model1(
    src_ids: Sequence[Sequence[int]],
    trg_ids: Sequence[Sequence[int]],
    src_vocab_size: int,
    trg_vocab_size: int,
    iterations: int,
) -> tuple[np.ndarray, np.ndarray]:
    """IBM Model 1's t(t | s) over the (s, t) that co-occur: keys s * V_trg + t (sorted; s =
    src_vocab_size is NULL) and their probabilities, each (P,)."""
    null = src_vocab_size
    sizes = [(len(src) + 1) * len(trg) for src, trg in zip(src_ids, trg_ids, strict=True)]
    events = np.empty(sum(sizes), dtype=np.int64)  # (N,) each co-occurrence's (s, t) key
    target_position = np.empty(sum(sizes), dtype=np.int32)  # (N,) and its target position
    start = position = 0
    for src, trg, size in zip(src_ids, trg_ids, sizes, strict=True):
        source = np.append(np.asarray(src, dtype=np.int64), null)  # (|x|+1,)
        target = np.asarray(trg, dtype=np.int64)  # (|y|,)
        events[start : start + size] = (target[:, None] + source[None, :] * trg_vocab_size).ravel()
        target_position[start : start + size] = np.repeat(
            np.arange(position, position + len(target), dtype=np.int32), len(source)
        )
        start, position = start + size, position + len(target)
    if position == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    keys, pair = _index(events, (src_vocab_size + 1) * trg_vocab_size)
    del events
    source_of = keys // trg_vocab_size  # (P,)
    # the E-step in slices of whole sentences, so that its float64 temporaries stay small
    bounds = np.searchsorted(target_position, np.arange(0, position, SLICE_POSITIONS))
    slices = list(zip(bounds, [*bounds[1:], len(pair)], strict=True))
    probs = np.ones(len(keys))  # uniform t(t | s): every E-step normalises per position
    for _ in range(iterations):
        expected = np.zeros(len(keys))
        for begin, end in slices:
            weight = probs[pair[begin:end]]  # (n,)
            place = target_position[begin:end] - target_position[begin]  # (n,)
            norm = np.bincount(place, weight)  # (positions of the slice,)
            expected += np.bincount(pair[begin:end], weight / norm[place], minlength=len(keys))
        totals = np.bincount(source_of, expected, minlength=src_vocab_size + 1)
        probs = expected / totals[source_of]
    return keys, probs


def _index(events: np.ndarray, space: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys (P,), sorted, and each event's index among them (N,): through a
    table of every possible key where it is small enough, else by sorting."""
    if space > DENSE_KEYS:
        keys, pair = np.unique(events, return_inverse=True)
        return keys, pair.astype(np.int32)
    seen = np.zeros(space, dtype=bool)
    seen[events] = True
    keys = np.flatnonzero(seen)
    del seen
    where = np.zeros(space, dtype=np.int32)  # P < 2^31: at most DENSE_KEYS keys
    where[keys] = np.arange(len(keys), dtype=np.int32)
    return keys, where[events]


def _best(
    keys: np.ndarray, probs: np.ndarray, src_vocab_size: int, trg_vocab_size: int, per_word: int
) -> np.ndarray:
    """(V_src, per_word) target ids per source id, most probable first (ties: lower id),
    -1 padded; NULL's row is dropped."""
    table = np.full((src_vocab_size, per_word), -1, dtype=np.int32)
    source, target = keys // trg_vocab_size, keys % trg_vocab_size
    real = source < src_vocab_size
    source, target, probs = source[real], target[real], probs[real]
    order = np.lexsort((target, -probs, source))  # by source, then probability, then id
    source, target = source[order], target[order]
    starts = np.searchsorted(source, np.arange(src_vocab_size))  # each source's first row
    rank = np.arange(len(source)) - starts[source]
    keep = rank < per_word
    table[source[keep], rank[keep]] = target[keep]
    return table
