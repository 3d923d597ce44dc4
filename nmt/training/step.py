"""One optimiser update, written out: the loss module, forward and backward (split on
out-of-memory), what the ranks agree on, unscale, clip and step; the optimiser and the fp16
gradient scaler. ``train_step`` is the one step of ``nmt train`` and of scripts/bench.py."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from nmt.config import Config, TrainingConfig
from nmt.data.batching import Batch
from nmt.errors import NMTError
from nmt.model import Seq2Seq
from nmt.model.seq2seq import Guide
from nmt.runtime import autocast
from nmt.training.distributed import Distributed, all_reduce
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
        rows = batch.target_rows
        if batch.guide is None or self.guide_weight == 0:
            return self.model.loss(*batch.tensors(), self.label_smoothing, target_rows=rows)
        guide = Guide(batch.guide, self.guide_weight)
        return self.model.loss(*batch.tensors(), self.label_smoothing, guide, target_rows=rows)


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
    """Adam or AdamW; the fused implementation (one kernel over all parameters instead of a
    loop over the tensors) wherever torch has it."""
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
) -> Tensor:
    """Forward and backward of ``batch`` (or of several: ``training.accumulate``), the
    gradient of ``scale * loss_sum`` accumulated into ``.grad``; returns the batches'
    (loss_sum, nll_sum) as a float64 tensor (2,) on the device, since reading it waits for
    the device (a step reads it once, with its gradient norms). Under DDP only the last
    backward all-reduces.

    On out-of-memory: an NMTError that describes the batch, or with ``oom_split`` a retry in
    2, 4, ... pieces, each scaled the same way, so the gradient is unchanged.
    """
    batches = [batch] if isinstance(batch, Batch) else list(batch)
    model = loss_module.module if isinstance(loss_module, DistributedDataParallel) else loss_module
    kept = getattr(getattr(model, "model", None), "graphs", None) is not None
    pieces = 1
    while True:
        in_sync: list[bool] = []  # set once the backward that all-reduces has begun
        split = [piece for whole in batches for piece in _split_batch(whole, pieces)]
        try:
            return _accumulate(loss_module, split, scale, device, precision, scaler, in_sync)
        except torch.OutOfMemoryError:
            pass  # leave the except block, so that the failed graph can be freed
        for param in loss_module.parameters():
            param.grad = None if param.grad is None or not kept else param.grad.zero_()
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
) -> Tensor:
    sums = None
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
        # in float64: the sums of the float32 pieces as a host's float would add them
        piece_sums = torch.stack([loss.detach().double(), nll.detach().double()])
        sums = piece_sums if sums is None else sums + piece_sums
    assert sums is not None
    return sums


def clear_gradients(optimizer: torch.optim.Optimizer, keep: bool) -> None:
    """Before a step: every gradient None, or with ``keep`` (a model with CUDA graphs) zeros
    in place. A captured backward returns the parameters' gradients in the graph's own
    memory, which autograd would make a parameter's ``.grad`` when it has none; the next
    replay (an accumulated batch, or a piece of a split one) would then overwrite it. Kept
    gradients take each replay's by addition instead."""
    if not keep:
        optimizer.zero_grad(set_to_none=True)
        return
    kept = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            else:
                kept.append(param.grad)
    if kept:
        torch._foreach_zero_(kept)  # one launch for them all, not one each


def _split_batch(batch: Batch, pieces: int) -> list[Batch]:
    """The batch's sentences in ``pieces`` consecutive groups, each trimmed of extra padding."""
    if pieces == 1:
        return [batch]
    out = []
    for rows in np.array_split(np.arange(batch.src.size(0)), pieces):
        index = torch.as_tensor(rows, device=batch.src.device)
        src_lengths = batch.src_lengths[torch.as_tensor(rows, device=batch.src_lengths.device)]
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
    norms = clip_gradients(model, optimizer, scaler, clip_grad_norm)
    return step_if_finite(norms.tolist(), optimizer, scaler)


def clip_gradients(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, clip_grad_norm: float | None
) -> Tensor:
    """Unscale (fp16) and clip: -> the norms before clipping, (1,) the translation model's
    and (2,) the alignment head's after it, on the device (reading them waits for it)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = clip_grad_norm if clip_grad_norm is not None else float("inf")
    translation: list[nn.Parameter] = []
    head: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        (head if name.startswith("aligner.") else translation).append(parameter)
    norms = [torch.nn.utils.clip_grad_norm_(translation, max_norm)]
    if head:
        norms.append(torch.nn.utils.clip_grad_norm_(head, max_norm))
    return torch.stack([norm.double() for norm in norms])


def step_if_finite(
    norms: list[float], optimizer: torch.optim.Optimizer, scaler: Any
) -> tuple[float, bool]:
    """The optimiser step where the norms (``clip_gradients``'s, read) are finite, or the
    scaler's step: -> (the gradient norm, applied)."""
    grad_norm = _grad_norm(norms)
    if scaler is None:
        applied = math.isfinite(grad_norm)
        if applied:
            optimizer.step()
        return grad_norm, applied
    scale = scaler.get_scale()
    scaler.step(optimizer)  # skips the update itself when gradients overflowed
    scaler.update()
    return grad_norm, scaler.get_scale() >= scale


def _grad_norm(norms: list[float]) -> float:
    """The translation model's norm, or the alignment head's where that is not finite (the
    update is then skipped all the same)."""
    if len(norms) > 1 and not math.isfinite(norms[1]):
        return norms[1]
    return norms[0]


# ----------------------------------------------------------------------------- one step


@dataclass(kw_only=True)
class Updater:
    """What one update works on: the model, the module whose forward gives its loss (DDP
    wraps it under torchrun), the optimiser, the fp16 scaler (None otherwise), the precision,
    the device, this process's place among the ranks and the training section; ``defers``:
    whether an update is queued without being read (``training.deferred_reads``)."""

    model: Seq2Seq
    loss_module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    precision: str
    device: torch.device
    place: Distributed
    training: TrainingConfig
    defers: bool = False

    @classmethod
    def build(
        cls,
        config: Config,
        model: Seq2Seq,
        precision: str,
        device: torch.device,
        place: Distributed,
    ) -> Updater:
        """The optimiser, scaler and loss module of ``model`` as ``config.training`` says."""
        cfg = config.training
        guide_weight = cfg.guided_alignment_weight if cfg.guided_alignment else 0.0
        optimizer = build_optimizer(config, model)
        scaler = grad_scaler(precision, device)
        wanted = cfg.deferred_reads if cfg.deferred_reads is not None else device.type == "cuda"
        return cls(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            loss_module=loss_for_training(model, cfg.label_smoothing, place, guide_weight),
            precision=precision,
            device=device,
            place=place,
            training=cfg,
            # the skip decided on the device needs fused Adam; the ranks' agreement and
            # fp16's scaler read every step
            defers=wanted
            and optimizer.defaults.get("fused") is True
            and not place.enabled
            and scaler is None,
        )


class StopFlag:
    """Ctrl-C / SIGTERM set a flag; the loop saves a checkpoint at the next step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class Clock:
    """The run's wall clock: this invocation's, data preparation included, and the minutes of
    the invocations it resumes."""

    started: float  # time.time() at this invocation's start, less the earlier minutes
    limit: float | None = None  # training.max_minutes

    def minutes(self) -> float:
        return (time.time() - self.started) / 60

    def out_of_time(self) -> bool:
        return self.limit is not None and self.minutes() >= self.limit


class StepTotals(NamedTuple):
    """What every rank must know at a step's end, summed over the ranks by one all-reduce
    (packed in this order into one float64 tensor): the loss sums, the count of ranks with a
    non-finite loss, with a signal, out of time, and the sum of their clocks."""

    loss: float
    nll: float
    nonfinite: float
    signalled: float
    out_of_time: float
    minutes: float

    def summed(self, place: Distributed, device: torch.device) -> StepTotals:
        """The totals over all ranks (this rank's own without torchrun)."""
        if not place.enabled:
            return self
        return StepTotals(*all_reduce([float(value) for value in self], device))


@dataclass
class StepResult:
    """One step as every rank sees it: sums over all ranks' batches and agreed flags."""

    loss: float
    nll: float
    grad_norm: float
    status: str  # "applied", "overflow" (fp16 scaler skipped it) or "nonfinite"
    signal: bool  # some rank was sent SIGINT/SIGTERM
    out_of_time: bool  # some rank reached training.max_minutes
    minutes: float  # the run's wall clock so far (Progress.minutes), the mean over ranks


def train_step(
    updater: Updater,
    batches: list[Batch],
    global_tokens: int,
    clock: Clock | None = None,
    stop: StopFlag | None = None,
) -> StepResult:
    """Forward and backward of this rank's ``batches``, agree across ranks, clip, step.

    ``global_tokens``: the target tokens of all ranks' batches, by which the loss sums are
    divided; ``clock`` and ``stop`` (none in a benchmark): the run's clock and signal flag.
    """
    sums = backward(updater, batches, global_tokens)
    if updater.defers:
        return queue_update(updater, sums, clock, stop).read()
    cfg, place = updater.training, updater.place
    norms = None
    if not place.enabled and updater.scaler is None:
        # one process: clip before reading anything, so that the step waits for the device
        # once (a non-finite loss then skips the update of clipped gradients, which the next
        # step discards)
        clipped = clip_gradients(updater.model, updater.optimizer, None, cfg.clip_grad_norm)
        values = torch.cat([sums, clipped]).tolist()
        (loss, nll), norms = values[:2], values[2:]
    else:
        loss, nll = sums.tolist()
    mine = StepTotals(
        loss,
        nll,
        float(not math.isfinite(loss)),
        float(stop is not None and stop.signal is not None),
        float(clock is not None and clock.out_of_time()),
        clock.minutes() if clock is not None else 0.0,
    )
    totals = mine.summed(place, updater.device)
    minutes = totals.minutes / place.world_size
    signalled, late = bool(totals.signalled), bool(totals.out_of_time)
    if totals.nonfinite:
        return StepResult(totals.loss, totals.nll, math.nan, "nonfinite", signalled, late, minutes)
    if norms is not None:
        grad_norm, applied = step_if_finite(norms, updater.optimizer, None)
    else:
        grad_norm, applied = apply_update(
            updater.model, updater.optimizer, updater.scaler, cfg.clip_grad_norm
        )
    status = "applied" if applied else "overflow" if updater.scaler is not None else "nonfinite"
    return StepResult(totals.loss, totals.nll, grad_norm, status, signalled, late, minutes)


def backward(updater: Updater, batches: list[Batch], global_tokens: int) -> Tensor:
    """The gradients cleared, then forward and backward of ``batches``: -> the loss sums
    (loss_sum, nll_sum) on the device, unread (``forward_backward``)."""
    cfg, place = updater.training, updater.place
    clear_gradients(updater.optimizer, keep=updater.model.graphs is not None)
    return forward_backward(
        updater.loss_module,
        batches,
        place.world_size / global_tokens,
        updater.device,
        updater.precision,
        updater.scaler,
        cfg.oom_split,
        cfg.batch_tokens,
    )


@dataclass
class PendingStep:
    """An update queued on the device and not yet read (``training.deferred_reads``): its
    values (float64 on the device: loss_sum, nll_sum, the norms of ``clip_gradients``, and
    1 where the update was skipped), and the signal, clock and minutes as they were when it
    was queued."""

    values: Tensor
    signalled: bool
    out_of_time: bool
    minutes: float

    def read(self) -> StepResult:
        """Wait for the update and read it: the StepResult ``train_step`` gives."""
        loss, nll, *norms, skipped = self.values.tolist()
        flags = (self.signalled, self.out_of_time, self.minutes)
        if not math.isfinite(loss):
            return StepResult(loss, nll, math.nan, "nonfinite", *flags)
        grad_norm = _grad_norm(norms)
        assert bool(skipped) != math.isfinite(grad_norm)  # the device decided as the host would
        return StepResult(loss, nll, grad_norm, "nonfinite" if skipped else "applied", *flags)


def queue_update(
    updater: Updater, sums: Tensor, clock: Clock | None, stop: StopFlag | None
) -> PendingStep:
    """Clip and step without reading anything: the update is skipped on the device where the
    loss or a norm is not finite (fused Adam's ``found_inf``, bit for bit the update the host
    would have skipped), so that the host can queue the next forward before this one runs.
    One process, no fp16 loss scaling (``Updater.defers``)."""
    optimizer = updater.optimizer
    clipped = clip_gradients(updater.model, optimizer, None, updater.training.clip_grad_norm)
    values = torch.cat([sums, clipped])  # (2 + norms,) float64
    skipped = (~torch.isfinite(torch.cat([values[:1], clipped])).all()).to(torch.float32)
    optimizer.found_inf = skipped  # type: ignore[attr-defined]  # read by fused Adam's step
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = None  # type: ignore[attr-defined]
    return PendingStep(
        torch.cat([values, skipped.double().view(1)]),
        stop is not None and stop.signal is not None,
        clock is not None and clock.out_of_time(),
        clock.minutes() if clock is not None else 0.0,
    )
