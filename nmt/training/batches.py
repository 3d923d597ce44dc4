"""An epoch's batches as a model trains on them: bucketed by length (``bucket_batches``), or
with a few static shapes where the model captures CUDA graphs (``shaped_batches``), then
padded (``host_batch``) and copied to the device (``to_device``), the next update's padded on a
background thread while this one trains where ``Prefetch`` is on. ``nmt train`` and
scripts/bench.py take them from here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from nmt.data.batching import Batch, batch_shape, bucket_batches, shaped_batches


class Corpus(Protocol):
    src_lengths: np.ndarray
    trg_lengths: np.ndarray

    def batch(self, indices: np.ndarray) -> Batch: ...


def epoch_batches(
    corpus: Corpus, batch_tokens: int, seed: int, epoch: int, shaped: bool
) -> list[np.ndarray]:
    """The epoch's batches of corpus indices, in their seeded order; ``shaped``: cut for
    CUDA graphs."""
    cut = shaped_batches if shaped else bucket_batches
    return cut(corpus.src_lengths, corpus.trg_lengths, batch_tokens, seed, epoch)


def device_batch(
    corpus: Corpus, indices: np.ndarray, device: torch.device, batch_tokens: int, shaped: bool
) -> Batch:
    """The padded batch of ``indices`` on ``device`` (``host_batch``, then ``to_device``)."""
    return to_device(host_batch(corpus, indices, batch_tokens, shaped), device)


def host_batch(corpus: Corpus, indices: np.ndarray, batch_tokens: int, shaped: bool) -> Batch:
    """The padded batch of ``indices`` in host memory; ``shaped``: padded to its static shape
    (``batch_shape``); its target rows found here (``Batch.target_rows``). Only reads the
    corpus and makes CPU tensors: no device call."""
    batch = corpus.batch(indices)
    if shaped:
        rows, length = batch_shape(
            corpus.src_lengths[indices], corpus.trg_lengths[indices], batch_tokens
        )
        batch = batch.padded(rows, length)
    return batch.with_target_rows()


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A host batch on ``device``. A GPU's goes through page-locked memory, so that its copy
    does not wait for the GPU, and keeps its source lengths on the host: the encoder's packed
    RNN reads them there (``fast.recurrence.unwaited_pack``), and a copy back from the GPU
    would wait for every kernel queued before it."""
    if device.type != "cuda":
        return batch.to(device)
    return dataclasses.replace(batch.pin_memory().to(device), src_lengths=batch.src_lengths)


class Prefetch:
    """The next update's host batches (``host_batch``), made on one background thread while
    this update trains, where ``enabled`` (``nmt train`` on a GPU: ``training.prefetch``).

    ``ahead`` hands the thread the batches the loop takes next; ``take`` returns them, made
    (waiting for the thread if it is still at it), or, for any other batches, makes them at
    once. The thread only reads the corpus and makes CPU tensors, no CUDA call, so it cannot
    disturb a CUDA graph being captured meanwhile; pinning and the copies stay on the
    training thread (``to_device``). An error of the thread's is raised by ``take``, where
    the loop would have met it; batches handed ahead and never taken are dropped."""

    def __init__(self, enabled: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nmt-batches") if enabled else None
        self._ahead: tuple[tuple[Any, ...], Future[list[Batch]]] | None = None

    def ahead(
        self, corpus: Corpus, shard: Sequence[np.ndarray], batch_tokens: int, shaped: bool
    ) -> None:
        """Start making ``shard``'s host batches (each one batch's corpus indices)."""
        if self._pool is None:
            return
        key = (corpus, tuple(shard), batch_tokens, shaped)
        work = self._pool.submit(_host_batches, corpus, list(shard), batch_tokens, shaped)
        self._ahead = (key, work)

    def take(
        self, corpus: Corpus, shard: Sequence[np.ndarray], batch_tokens: int, shaped: bool
    ) -> list[Batch]:
        """``shard``'s host batches: those handed ahead if they are these (the same corpus
        and index arrays), else made now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and _same(ahead[0], (corpus, tuple(shard), batch_tokens, shaped)):
            return ahead[1].result()
        return _host_batches(corpus, list(shard), batch_tokens, shaped)

    def close(self) -> None:
        """Stop the thread (after the batch it is making, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None


def _host_batches(
    corpus: Corpus, shard: list[np.ndarray], batch_tokens: int, shaped: bool
) -> list[Batch]:
    return [host_batch(corpus, indices, batch_tokens, shaped) for indices in shard]


def _same(key: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    """Two keys of ``Prefetch`` (corpus, index arrays, batch_tokens, shaped): the same corpus
    and arrays, by identity (the epoch's own arrays, which the pending key holds, so that no
    other array can take their ids), and the same settings."""
    (corpus, shard, *settings), (other_corpus, other_shard, *other_settings) = key, other
    return (
        corpus is other_corpus
        and len(shard) == len(other_shard)
        and all(a is b for a, b in zip(shard, other_shard, strict=True))
        and settings == other_settings
    )
