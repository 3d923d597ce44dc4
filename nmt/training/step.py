"""One optimiser update, written out: the loss module, forward and backward (split on
out-of-memory), unscale, clip and step; the optimiser and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from nmt.config import Config
from nmt.data.batching import Batch
from nmt.errors import NMTError
from nmt.model import Seq2Seq
from nmt.runtime import autocast
from nmt.training.distributed import Distributed
from nmt.vocab import PAD_ID

log = logging.getLogger("nmt")

INITIAL_LOSS_SCALE = 2.0**16  # fp16 GradScaler's first scale (PyTorch's default)


class TrainingLoss(nn.Module):
    """The model's training loss as a module whose forward returns it, so that
    DistributedDataParallel (which hooks ``forward``) can wrap it; the weights stay those of
    ``model``."""

    def __init__(self, model: Seq2Seq, label_smoothing: float, guide_weight: float = 0.0):
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing
        self.guide_weight = guide_weight  # training.guided_alignment_weight

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """-> (loss_sum, nll_sum), scalars summed over the batch's target tokens; with
        attention targets, the loss adds their weighted cross-entropy (summed over rows)."""
        if batch.guide is None or self.guide_weight == 0:
            return self.model.loss(*batch.tensors(), self.label_smoothing)
        return self.model.loss(
            *batch.tensors(),
            self.label_smoothing,
            guide=batch.guide,
            guide_weight=self.guide_weight,
        )


def loss_for_training(
    model: Seq2Seq, label_smoothing: float, place: Distributed, guide_weight: float = 0.0
) -> nn.Module:
    """The module whose forward gives the loss sums; DDP-wrapped when there are several ranks
    (its construction broadcasts rank 0's weights; every parameter is used in every step)."""
    loss_module = TrainingLoss(model, label_smoothing, guide_weight)
    if not place.enabled:
        return loss_module
    return DistributedDataParallel(loss_module, broadcast_buffers=False)


def build_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    """Adam or AdamW; the fused implementation (one kernel over all parameters, several times
    faster than the per-tensor loop on the CPU) wherever torch has it."""
    cfg = config.training
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    params = [p for p in model.parameters() if p.requires_grad]  # training.freeze: not these
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return cls(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused)


def grad_scaler(precision: str, device: torch.device, init_scale: float | None = None) -> Any:
    """A GradScaler on the run's device type for fp16; None for fp32 and bf16."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=init_scale or INITIAL_LOSS_SCALE)


def forward_backward(
    loss_module: nn.Module,
    batch: Batch | Sequence[Batch],
    scale: float,
    device: torch.device,
    precision: str,
    scaler: Any = None,
    oom_split: bool = False,
    batch_tokens: int | None = None,
) -> tuple[float, float]:
    """Forward and backward of ``batch`` (or of several: ``training.accumulate``), the
    gradient of ``scale * loss_sum`` accumulated into ``.grad``; returns the batches'
    (loss_sum, nll_sum). Under DDP only the last backward all-reduces.

    On out-of-memory: an NMTError that describes the batch, or with ``oom_split`` a retry in
    2, 4, ... pieces, each scaled the same way, so the gradient is unchanged.
    """
    batches = [batch] if isinstance(batch, Batch) else list(batch)
    pieces = 1
    while True:
        in_sync: list[bool] = []  # set once the backward that all-reduces has begun
        split = [piece for whole in batches for piece in _split_batch(whole, pieces)]
        try:
            return _accumulate(loss_module, split, scale, device, precision, scaler, in_sync)
        except torch.OutOfMemoryError:
            pass  # leave the except block, so that the failed graph can be freed
        for param in loss_module.parameters():
            param.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        batch = max(batches, key=lambda b: b.src.numel() + b.trg_in.numel())
        sentences = min(b.src.size(0) for b in batches)
        if not oom_split or pieces >= sentences or in_sync:
            raise NMTError(_oom_message(batch, pieces, oom_split, bool(in_sync), batch_tokens))
        pieces = min(2 * pieces, sentences)
        log.info(
            "out of memory on a batch of %d sentences (%d x %d padded tokens): "
            "retrying it in %d pieces",
            sentences,
            sentences,
            max(batch.src.size(1), batch.trg_in.size(1)),
            pieces,
        )


def _accumulate(
    loss_module: nn.Module,
    pieces: list[Batch],
    scale: float,
    device: torch.device,
    precision: str,
    scaler: Any,
    in_sync: list[bool],
) -> tuple[float, float]:
    loss_sum = nll_sum = 0.0
    ddp = loss_module if isinstance(loss_module, DistributedDataParallel) else None
    for number, piece in enumerate(pieces, start=1):
        last = number == len(pieces)
        # DDP all-reduces the gradients in the last piece's backward only
        with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
            with autocast(device, precision):
                loss, nll = loss_module(piece)
            scaled = loss * scale
            if ddp is not None and last:
                in_sync.append(True)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += float(loss.detach())
        nll_sum += float(nll)
    return loss_sum, nll_sum


def _split_batch(batch: Batch, pieces: int) -> list[Batch]:
    """The batch's sentences in ``pieces`` consecutive groups, each trimmed of extra padding."""
    if pieces == 1:
        return [batch]
    out = []
    for rows in np.array_split(np.arange(batch.src.size(0)), pieces):
        index = torch.as_tensor(rows, device=batch.src.device)
        src_lengths = batch.src_lengths[index]
        trg_out = batch.trg_out[index]
        src_len = int(src_lengths.max())
        trg_len = int((trg_out != PAD_ID).sum(dim=1).max())
        out.append(
            Batch(
                batch.src[index, :src_len],
                src_lengths,
                batch.trg_in[index, :trg_len],
                trg_out[:, :trg_len],
                batch.indices[rows],
                None if batch.guide is None else batch.guide[index, :trg_len, :src_len],
            )
        )
    return out


def _oom_message(
    batch: Batch, pieces: int, oom_split: bool, in_sync: bool, batch_tokens: int | None
) -> str:
    sentences = batch.src.size(0)
    message = (
        f"out of memory on a training batch of {sentences} sentences, "
        f"{sentences * batch.src.size(1)} padded source and {sentences * batch.trg_in.size(1)} "
        f"padded target tokens"
    )
    if pieces > 1:
        message += f", even split in {pieces} pieces"
    if in_sync:
        message += " (in the gradient all-reduce, where torchrun runs cannot retry)"
    message += f"; lower training.batch_tokens (now {batch_tokens})"
    return message + ("" if oom_split else " or set training.oom_split: true")


def apply_update(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, clip_grad_norm: float | None
) -> tuple[float, bool]:
    """Unscale, clip and step; returns (gradient norm, applied).

    With fp16 the GradScaler skips the step when the gradients overflowed and halves its
    scale; without a scaler a non-finite gradient skips the step. An alignment head's
    gradients are clipped by their own norm, so that they never scale the translation
    model's; the norm returned is the translation model's.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = clip_grad_norm if clip_grad_norm is not None else float("inf")
    translation: list[nn.Parameter] = []
    head: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        (head if name.startswith("aligner.") else translation).append(parameter)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(translation, max_norm))
    if head:
        head_norm = float(torch.nn.utils.clip_grad_norm_(head, max_norm))
        grad_norm = grad_norm if math.isfinite(head_norm) else head_norm
    if scaler is None:
        applied = math.isfinite(grad_norm)
        if applied:
            optimizer.step()
        return grad_norm, applied
    scale = scaler.get_scale()
    scaler.step(optimizer)  # skips the update itself when gradients overflowed
    scaler.update()
    return grad_norm, scaler.get_scale() >= scale
