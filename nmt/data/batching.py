"""Token ids -> padded batches, and the orders that group sentences of similar length:
token-budget buckets for training (``bucket_batches``), the same with a few fixed shapes for
CUDA graphs (``shaped_batches``), sentence-count batches for decoding
(``length_sorted_batches``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from nmt.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """A padded batch. src: (B, S) with EOS; trg_in: (B, T) BOS+y; trg_out: (B, T) y+EOS."""

    src: torch.Tensor
    src_lengths: torch.Tensor
    trg_in: torch.Tensor
    trg_out: torch.Tensor
    indices: np.ndarray
    guide: torch.Tensor | None = None  # (B, T, S) attention targets (nmt.data.guidance)
    # (N,) the positions of trg_out.view(-1) that are target tokens, found on the host before
    # the batch goes to a GPU, so that the loss never waits for the GPU to find them
    target_rows: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src, src_lengths, trg_in, trg_out): what ``Seq2Seq.loss`` takes."""
        return self.src, self.src_lengths, self.trg_in, self.trg_out

    def with_target_rows(self) -> Batch:
        """The batch with ``target_rows`` (for the batch as it is: after any padding)."""
        rows = (self.trg_out.reshape(-1) != PAD_ID).nonzero().squeeze(1)
        return replace(self, target_rows=rows)

    @property
    def n_target_tokens(self) -> int:
        return int((self.trg_out != PAD_ID).sum())

    def padded(self, rows: int, length: int) -> Batch:
        """The batch padded to ``rows`` sentences of ``length`` source and target positions (a
        CUDA graph's static shape). An added row is a source of EOS alone (length 1) and a
        target of BOS then padding, which adds no target token to the loss."""
        count, src_len, trg_len = self.src.size(0), self.src.size(1), self.trg_in.size(1)
        if rows < count or length < max(src_len, trg_len):
            raise ValueError(f"a batch of {count} x {src_len}/{trg_len} exceeds {rows} x {length}")
        src = self.src.new_full((rows, length), PAD_ID)
        src[:count, :src_len] = self.src
        src[count:, 0] = EOS_ID
        src_lengths = self.src_lengths.new_ones(rows)
        src_lengths[:count] = self.src_lengths
        trg_in = self.trg_in.new_full((rows, length), PAD_ID)
        trg_in[:count, :trg_len] = self.trg_in
        trg_in[count:, 0] = BOS_ID
        trg_out = self.trg_out.new_full((rows, length), PAD_ID)
        trg_out[:count, :trg_len] = self.trg_out
        guide = None
        if self.guide is not None:
            guide = self.guide.new_zeros((rows, length, length))
            guide[:count, :trg_len, :src_len] = self.guide
        return Batch(src, src_lengths, trg_in, trg_out, self.indices, guide)

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory, so that ``to(cuda)`` copies asynchronously."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> Batch:
        return self._map(lambda tensor: tensor.to(device, non_blocking=True))

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with ``change`` applied to each of its tensors."""
        guide, rows = (None if t is None else change(t) for t in (self.guide, self.target_rows))
        return Batch(
            change(self.src),
            change(self.src_lengths),
            change(self.trg_in),
            change(self.trg_out),
            self.indices,
            guide,
            rows,
        )


def pad(sequences: Sequence[Sequence[int]], length: int | None = None) -> torch.Tensor:
    """(B, L) long tensor, right-padded with PAD_ID."""
    flat, lengths = _flat(sequences)
    length = length or int(lengths.max(initial=0))
    return _scatter(flat, lengths, length, 0)


def make_batch(
    src_ids: Sequence[Sequence[int]], trg_ids: Sequence[Sequence[int]], indices: np.ndarray
) -> Batch:
    """The padded batch of the pairs: src, trg_in = BOS y and trg_out = y EOS."""
    src_flat, src_lengths = _flat(src_ids)
    src = _scatter(src_flat, src_lengths, int(src_lengths.max(initial=0)), 0)
    trg_flat, trg_lengths = _flat(trg_ids)
    width = int(trg_lengths.max(initial=0)) + 1
    trg_in = _scatter(trg_flat, trg_lengths, width, 1)  # y shifted right by one: BOS y
    trg_in[:, 0] = BOS_ID
    trg_out = _scatter(trg_flat, trg_lengths, width, 0)
    trg_out[torch.arange(len(trg_ids)), torch.from_numpy(trg_lengths)] = EOS_ID
    return Batch(src, torch.from_numpy(src_lengths), trg_in, trg_out, indices)


def _flat(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every id of ``sequences`` in one int64 array, and each sequence's length."""
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    flat = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, int(lengths.sum()))
    return flat, lengths


def _scatter(flat: np.ndarray, lengths: np.ndarray, width: int, offset: int) -> torch.Tensor:
    """(B, width) PAD_ID, with row b's ids at positions offset .. offset + lengths[b] - 1:
    one vectorised write instead of a copy per sentence."""
    out = np.full((len(lengths), width), PAD_ID, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    positions = np.arange(len(flat)) - np.repeat(starts, lengths) + offset
    out[rows, positions] = flat
    return torch.from_numpy(out)


def bucket_batches(
    src_lengths: np.ndarray, trg_lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Token-based batches of similar lengths, in a seeded order for this epoch.

    Pairs are sorted by their longer side, then source length, then target length, with ties
    broken randomly, and cut into batches whose padded size (sentences x longest side) stays
    within ``batch_tokens``; the batch order is shuffled. Sorting by the side the budget
    counts fills each batch to it, and the source length next keeps the encoder's padding
    small (the bidirectional encoder costs the most per padded position). The result depends
    only on (lengths, batch_tokens, seed, epoch), which makes the data order reproducible for
    exact resume.
    """
    rng = np.random.default_rng([seed, epoch])
    order, longer = _length_order(src_lengths, trg_lengths, rng)
    return _shuffled(_cut(order, longer, batch_tokens, None), rng)


def _length_order(
    src_lengths: np.ndarray, trg_lengths: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs sorted by their longer side, then source, then target length, ties broken
    at random; and each pair's longer side."""
    tie_break = rng.permutation(len(src_lengths))
    longer = np.maximum(src_lengths, trg_lengths)
    return np.lexsort((tie_break, trg_lengths, src_lengths, longer)), longer


def _shuffled(batches: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    return [batches[i] for i in rng.permutation(len(batches))]


def shape_length(length: int) -> int:
    """The static length a CUDA graph's batch pads ``length`` to: the next multiple of 8 up to
    64, of 16 up to 128, of 32 up to 256, then of 64 (about 16 lengths cover a corpus whose
    pairs reach 300 pieces, each at most an eighth over its sentences' length past 64)."""
    for limit, step in ((64, 8), (128, 16), (256, 32)):
        if length <= limit:
            return max(step, -(-length // step) * step)
    return -(-length // 64) * 64


def shape_rows(length: int, batch_tokens: int) -> int:
    """The sentences of a static batch of ``shape_length`` ``length`` within the budget."""
    return max(1, batch_tokens // length)


def batch_shape(
    src_lengths: np.ndarray, trg_lengths: np.ndarray, batch_tokens: int
) -> tuple[int, int]:
    """(rows, length): the static shape of the batch of these pairs' lengths."""
    length = shape_length(int(max(src_lengths.max(), trg_lengths.max())))
    return shape_rows(length, batch_tokens), length


def shaped_batches(
    src_lengths: np.ndarray, trg_lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """``bucket_batches`` for CUDA graphs: each batch's pairs share one ``shape_length`` L of
    their longer side and number at most ``batch_tokens // L`` (the batch's static shape,
    ``batch_shape``; only a class's last batch has fewer, padded with empty rows). A graph is
    captured once per shape, so an epoch has as few shapes as length classes. Sorted and
    shuffled as ``bucket_batches`` does, from (lengths, batch_tokens, seed, epoch) alone."""
    rng = np.random.default_rng([seed, epoch])
    order, longer = _length_order(src_lengths, trg_lengths, rng)
    classes = np.array([shape_length(int(n)) for n in longer[order]])
    batches: list[np.ndarray] = []
    starts = np.flatnonzero(np.r_[True, classes[1:] != classes[:-1]])
    for start, end in zip(starts, [*starts[1:], len(order)], strict=True):
        rows = shape_rows(int(classes[start]), batch_tokens)
        batches += [order[i : min(i + rows, end)] for i in range(start, end, rows)]
    return _shuffled(batches, rng)


def padding_fraction(
    batches: list[np.ndarray],
    src_lengths: np.ndarray,
    trg_lengths: np.ndarray,
    batch_tokens: int | None = None,
) -> float:
    """Fraction of padded positions over all batches (source and target); with
    ``batch_tokens``, of batches padded to their static shape (``batch_shape``)."""
    real = padded = 0
    for batch in batches:
        shape = None
        if batch_tokens is not None:
            shape = batch_shape(src_lengths[batch], trg_lengths[batch], batch_tokens)
        for lengths in (src_lengths[batch], trg_lengths[batch]):
            real += int(lengths.sum())
            padded += shape[0] * shape[1] if shape else int(lengths.max()) * len(batch)
    return 1.0 - real / max(padded, 1)


def length_sorted_batches(
    lengths: Sequence[int], batch_size: int, batch_tokens: int | None = None
) -> list[np.ndarray]:
    """Indices grouped by similar length, shortest first: at most ``batch_size`` sentences
    and, when given, ``batch_tokens`` padded tokens per batch.

    Without a token budget the fewest batches of at most ``batch_size`` share the sentences
    evenly (their sizes differ by one at most): 200 sentences at 64 are four batches of 50,
    not 64, 64, 64 and a last 8 that would decode the longest sentences a few rows at a
    time."""
    sizes = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(sizes, kind="stable")
    if batch_tokens is None:
        count = -(-len(order) // batch_size)  # ceil
        return [part for part in np.array_split(order, count) if len(part)] if count else []
    return _cut(order, sizes, batch_tokens, batch_size)


def _cut(
    order: np.ndarray, sizes: np.ndarray, max_tokens: int | None, max_sentences: int | None
) -> list[np.ndarray]:
    """``order``, sorted by ``sizes``, cut into consecutive batches whose padded size
    (sentences x largest size) stays within ``max_tokens`` and whose sentences number at most
    ``max_sentences`` (either None: no limit); a single sentence over the budget is a batch of
    its own.

    As the sizes never decrease along ``order``, a batch's largest size is its last one: a
    batch from ``start`` ends before the first position p whose count (p - start + 1) times
    its size exceeds the budget, or whose count exceeds ``max_sentences``, found with one
    vectorised look at the next few positions rather than a walk one position at a time."""
    ordered = sizes[order]
    assert bool(np.all(ordered[1:] >= ordered[:-1])), "both callers sort by the sizes"
    batches: list[np.ndarray] = []
    total, start = len(order), 0
    while start < total:
        first = int(ordered[start])
        most = max_sentences or total
        if max_tokens:
            most = min(most, max(1, max_tokens // max(first, 1)))
        end = min(total, start + most)
        if max_tokens and end - start > 1:
            counts = np.arange(1, end - start + 1)
            over = counts * ordered[start:end] > max_tokens
            over[0] = False  # a sentence over the budget is a batch of its own
            if over.any():
                end = start + int(np.argmax(over))
        batches.append(order[start:end])
        start = end
    return batches
