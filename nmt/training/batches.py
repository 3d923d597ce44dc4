"""An epoch's batches as a model trains on them: bucketed by length (``bucket_batches``), or
with a few static shapes where the model captures CUDA graphs (``shaped_batches``), then
padded and copied to the device. ``nmt train`` and scripts/bench.py take them from here."""

from __future__ import annotations

from typing import Protocol

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
    """The padded batch of ``indices`` on ``device``; ``shaped``: padded to its static shape
    (``batch_shape``); its target rows found here (``Batch.target_rows``). A GPU's batch goes
    through page-locked memory, so that its copy does not wait for the GPU."""
    batch = corpus.batch(indices)
    if shaped:
        rows, length = batch_shape(
            corpus.src_lengths[indices], corpus.trg_lengths[indices], batch_tokens
        )
        batch = batch.padded(rows, length)
    batch = batch.with_target_rows()
    if device.type == "cuda":
        batch = batch.pin_memory()
    return batch.to(device)
