"""The training loop, written out: forward, backward, clip, step, validate, checkpoint.

One process trains on one device, a GPU when there is one. Several GPUs, on one machine or
several, train one model with PyTorch DistributedDataParallel when torchrun starts the
processes (``nmt`` reads WORLD_SIZE, RANK and LOCAL_RANK from the environment)::

    torchrun --nproc-per-node 4 -m nmt train CONFIG.yaml
    # two machines with 4 GPUs each; run on both, with the address of the first:
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m nmt train CONFIG.yaml

Every rank builds the same seeded batch list for an epoch; global step k trains rank r on
batch k*W + r (W ranks; the last len % W batches of an epoch are dropped), and each rank's loss
sum is scaled by W / (target tokens of all W batches), which DDP's gradient averaging turns
into exactly the update of one process on the union of the W batches. Only rank 0 writes the
log, tensorboard, metrics.jsonl, the tokenizer and checkpoints. To resume, the run directory
must be on a filesystem all machines share.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nmt.config import Config
from nmt.data.batching import Batch, bucket_batches, padding_fraction
from nmt.data.corpus import check_files
from nmt.data.prepare import Corpora
from nmt.data.store import TokenizedCorpus
from nmt.data.tokenizer import Tokenizer
from nmt.errors import CheckpointError, NMTError, WriteError
from nmt.fast import FastPaths
from nmt.fast.allocator import limit_kernel_cache, tune_allocator
from nmt.fast.precision import Precision, choose_precision
from nmt.files import human_size
from nmt.model import Seq2Seq, build_model, count_parameters
from nmt.runtime import allow_tf32, seed_everything, set_threads
from nmt.training.distributed import (
    Distributed,
    all_reduce,
    broadcast_object,
    gather_objects,
    init_distributed,
    shutdown_distributed,
)
from nmt.training.finetune import (
    Initial,
    check_initial_weights,
    freeze,
    load_initial_weights,
    read_initial,
)
from nmt.training.resume import read_checkpoint, restore, restore_rng, rng_state, save_checkpoints
from nmt.training.rundir import (
    RunLock,
    check_run_dir,
    epoch_corpus_in_turn,
    load_corpora_in_turn,
    prepare_run_dir,
    write_run_info,
)
from nmt.training.schedule import Progress, Schedule, record_validation
from nmt.training.step import (
    apply_update,
    build_optimizer,
    forward_backward,
    grad_scaler,
    loss_for_training,
)
from nmt.training.tracking import ProgressBar, Tracker, setup_logging
from nmt.training.validation import DevAlignment, agree, load_dev_alignment, validate

log = logging.getLogger("nmt")

MAX_BAD_STEPS = 10  # consecutive non-finite steps before training stops


class _StopFlag:
    """Ctrl-C / SIGTERM set a flag; the loop saves a checkpoint at the next step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
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
class _Window:
    """Training statistics since the last log line."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0
    started: float = field(default_factory=time.time)


@dataclass
class Run:
    """Everything one training run works on: a plain bundle, passed to small functions."""

    config: Config
    run_dir: Path
    model: Seq2Seq
    loss_module: nn.Module  # TrainingLoss(model), inside DDP when distributed
    optimizer: torch.optim.Optimizer
    scaler: Any
    progress: Progress
    tokenizer: Tokenizer
    corpora: Corpora
    tracker: Tracker
    device: torch.device
    precision: str
    schedule: Schedule
    place: Distributed
    started: float
    window: _Window = field(default_factory=_Window)
    saved_step: int | None = None  # the step of the run's last.pt, once it has one
    train: TokenizedCorpus | None = None  # this epoch's training pairs (Corpora.for_epoch)
    dev_alignment: DevAlignment | None = None  # data.dev_alignment, checked before training

    @property
    def corpus(self) -> TokenizedCorpus:
        assert self.train is not None, "set at the start of each epoch"
        return self.train

    def save(self, is_best: bool) -> None:
        """Every rank hands in its random state; rank 0 writes the checkpoints."""
        self.progress.window = [self.window.loss, self.window.nll, float(self.window.tokens)]
        rng_by_rank = gather_objects(rng_state(), self.place)
        if not self.place.is_main:
            return
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": asdict(self.progress),
            "config": self.config.model_dump(mode="json"),
            "tokenizer": self.tokenizer.state_dict(),
            "rng": rng_by_rank[0],
        }
        if self.place.enabled:
            state["rng_by_rank"] = rng_by_rank
        try:
            save_checkpoints(self.run_dir, state, self.config.training.keep_last, is_best)
        except WriteError as exc:
            if Path(str(exc.path)).name.startswith("step-"):  # best.pt and last.pt went first
                self.saved_step = self.progress.step
            exc.needed = f"a checkpoint takes about {human_size(checkpoint_bytes(state))}"
            raise
        self.saved_step = self.progress.step


def train(
    config: Config, run_dir: Path | None = None, resume: bool = False, quiet: bool = False
) -> Path:
    """Train a model as configured (one process, or one rank under torchrun); returns the
    run directory."""
    check_files(config)  # before anything is written
    initial = None if resume else read_initial(config)
    if initial is not None:
        check_initial_weights(config, initial)
    limit_kernel_cache()
    run_dir = Path(run_dir or config.run.dir)
    check_run_dir(run_dir)
    place, device = init_distributed(config.run.device)
    finished = False
    try:
        lock = RunLock(run_dir) if place.is_main else contextlib.nullcontext()
        with lock:
            _train_locked(config, run_dir, resume, quiet, place, device, initial)
        finished = True
    finally:
        shutdown_distributed(place, wait_for_all=finished)
    return run_dir


def _train_locked(
    config: Config,
    run_dir: Path,
    resume: bool,
    quiet: bool,
    place: Distributed,
    device: torch.device,
    initial: Initial | None = None,
) -> None:
    """The training run proper, with the run directory locked; ``initial``: the checkpoint
    a fine-tuning run starts from (not when resuming)."""
    resume_from = prepare_run_dir(run_dir, resume)
    setup_logging(run_dir if place.is_main else None, quiet=quiet or not place.is_main)
    set_threads(config.run.threads)
    fast = FastPaths(cpu_kernels=config.run.fast_kernels)
    if fast.cpu_kernels and device.type == "cpu":
        tune_allocator()
    started = time.time()
    saved, tokenizer = read_checkpoint(resume_from, config)
    if saved is None and initial is not None:
        tokenizer = initial.tokenizer
    seed_everything(config.training.seed)
    corpora, tokenizer = load_corpora_in_turn(config, run_dir, tokenizer, place)
    dev_alignment = load_dev_alignment(config, corpora)
    run = _build_run(config, run_dir, tokenizer, corpora, saved, place, device, fast, initial)
    run.dev_alignment = dev_alignment
    run.saved_step = run.progress.step if saved is not None else None
    # training.max_minutes counts data preparation too, and the minutes of earlier invocations
    run.started = started - 60 * run.progress.minutes
    try:
        with _StopFlag() as stop, ProgressBar(enabled=not quiet and place.is_main) as bar:
            _loop(run, stop, bar)
    except WriteError as exc:
        run.tracker.close(failed=True)
        raise _stopped_by(exc, run) from exc
    except BaseException:
        run.tracker.close(failed=True)
        raise
    run.tracker.close()


def _stopped_by(exc: WriteError, run: Run) -> WriteError:
    """A write that failed mid-run (a full disk): the file, the error, the space, and how to
    continue; the checkpoints written before are intact (atomic writes)."""
    known = [f for f in (f"{exc.free} free there" if exc.free else "", exc.needed) if f]
    room = f"; {', and '.join(known)}" if known else ""
    if run.saved_step is None:
        then = "nmt train --resume starts the run afresh (it has no checkpoint yet)"
    else:
        then = f"nmt train --resume continues from step {run.saved_step} (last.pt)"
    fix = "free some space" if exc.free is not None else "fix that"
    message = (
        f"{exc.path}: cannot write it ({exc.reason}){room}; training stopped at step "
        f"{run.progress.step}: {fix}, then {then}"
    )
    return WriteError(message, exc.path, exc.reason, exc.free)


def checkpoint_bytes(state: Any) -> int:
    """The bytes of the tensors in a checkpoint's state (what its file is mostly made of)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(checkpoint_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(checkpoint_bytes(v) for v in state)
    return 0


def _build_run(
    config: Config,
    run_dir: Path,
    tokenizer: Tokenizer,
    corpora: Corpora,
    saved: dict[str, Any] | None,
    place: Distributed,
    device: torch.device,
    fast: FastPaths,
    initial: Initial | None = None,
) -> Run:
    """Model, optimiser and scaler, fresh, fine-tuned from ``initial`` or restored; the loss
    module DDP wraps. The precision is chosen for the model (``training.precision``), said in
    the log and recorded in environment.json."""
    cfg = config.training
    model = _allocate_model(config, tokenizer, fast, device)
    chosen = _choose_precision(config, model, device, place)
    precision = chosen.name
    allow_tf32(device, precision)
    log.info("precision: %s", chosen)
    if place.is_main:
        write_run_info(run_dir, config, device, chosen, place.world_size)
    if saved is None and initial is not None:
        load_initial_weights(model, initial)
    freeze(model, cfg.freeze)
    optimizer = build_optimizer(config, model)
    scaler = grad_scaler(precision, device)
    if saved is not None:
        progress = restore(saved, model, optimizer, scaler)
        restore_rng(saved, place, cfg.seed)
    else:
        progress = Progress()
        if place.rank:  # same initial weights everywhere, different dropout masks
            seed_everything(cfg.seed + place.rank)
    _check_same_start(progress, place, device)
    log.info(
        "model: %s decoder, %s attention, %d parameters; %s, %s%s",
        config.model.decoder.style,
        config.model.attention.score,
        count_parameters(model),
        device,
        precision,
        f", {place.world_size} ranks" if place.enabled else "",
    )
    guide_weight = cfg.guided_alignment_weight if cfg.guided_alignment else 0.0
    loss_module = loss_for_training(model, cfg.label_smoothing, place, guide_weight)
    schedule = Schedule(
        cfg.schedule,
        cfg.learning_rate,
        cfg.warmup_steps,
        cfg.plateau_patience,
        cfg.max_steps,
        cfg.max_minutes,
        cfg.decay_hold,
        cfg.epochs,
    )
    # a resumed run's logs forget what the killed run logged after its checkpoint
    tracker = Tracker(run_dir, place.is_main, progress.step if saved is not None else None)
    loss, nll, tokens = progress.window
    return Run(
        config,
        run_dir,
        model,
        loss_module,
        optimizer,
        scaler,
        progress,
        tokenizer,
        corpora,
        tracker,
        device,
        precision,
        schedule,
        place,
        time.time(),
        _Window(loss, nll, int(tokens)),
    )


def _choose_precision(
    config: Config, model: nn.Module, device: torch.device, place: Distributed
) -> Precision:
    """``training.precision`` for this model on this device (``auto`` probes a CPU with
    native bf16, with a batch's target tokens as the matmuls' rows); under torchrun every rank
    takes rank 0's choice."""
    rows = config.training.batch_tokens // 2  # about a batch's target tokens
    if not place.enabled:
        return choose_precision(config.training.precision, device, model, rows)
    mine = (
        choose_precision(config.training.precision, device, model, rows) if place.is_main else None
    )
    return broadcast_object(mine)


def _allocate_model(
    config: Config, tokenizer: Tokenizer, fast: FastPaths, device: torch.device
) -> Seq2Seq:
    """The model on ``device``; a model too large for its memory is an NMTError naming the
    sizes to lower, not an allocator's traceback."""
    try:
        return build_model(
            config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size, fast
        ).to(device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
            raise
    m = config.model
    sizes = (
        f"model.embedding_size={m.embedding_size}, model.encoder.hidden_size="
        f"{m.encoder.hidden_size}, model.encoder.layers={m.encoder.layers}, "
        f"model.decoder.hidden_size={m.decoder.hidden_size}, model.decoder.layers="
        f"{m.decoder.layers}, vocabulary {tokenizer.src_vocab_size}/{tokenizer.trg_vocab_size}"
    )
    raise NMTError(f"the model does not fit in the memory of {device} ({sizes}); lower them")


def _check_same_start(progress: Progress, place: Distributed, device: torch.device) -> None:
    """All ranks must start from the same step, or their collectives would not pair up."""
    if not place.enabled:
        return
    high, low = all_reduce([progress.step, -progress.step], device, op="max")
    if high != -low:
        raise CheckpointError(
            f"the ranks start from different steps ({-low:.0f} to {high:.0f}): each read its "
            f"own run directory; put it on a filesystem all machines share"
        )


# ----------------------------------------------------------------------------- the loop


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


def _loop(run: Run, stop: _StopFlag, bar: ProgressBar) -> None:
    """Epochs of bucketed batches; validate and checkpoint at the interval and at the end."""
    cfg, progress, world = run.config.training, run.progress, run.place.world_size
    window = run.window
    run.model.train()
    reason = _stop_reason(run, None)
    while reason is None and progress.epoch < cfg.epochs:
        run.train = corpus = epoch_corpus_in_turn(run.corpora, progress.epoch, run.place)
        batches = bucket_batches(
            corpus.src_lengths, corpus.trg_lengths, cfg.batch_tokens, cfg.seed, progress.epoch
        )
        _log_epoch(run, batches)
        per_update = world * cfg.accumulate
        run.schedule.epoch_updates = -(-(len(batches) // world) // cfg.accumulate)
        bar.start_epoch(
            progress.epoch + 1,
            run.schedule.epoch_updates,
            -(-(progress.batch_in_epoch // world) // cfg.accumulate),
        )
        while reason is None and progress.batch_in_epoch + world <= len(batches):
            # world x accumulate batches (the epoch's last update: what is left, in whole
            # rounds of one batch per rank)
            left = (len(batches) - progress.batch_in_epoch) // world * world
            taken = min(per_update, left)
            shard = batches[progress.batch_in_epoch : progress.batch_in_epoch + taken]
            progress.batch_in_epoch += taken
            result = _update(run, shard, window, bar, stop)
            reason = _stop_reason(run, result)
            applied = result.status == "applied"
            if reason or (applied and progress.step % cfg.validate_every == 0):
                _validate_and_save(run)  # before a signal's save, as the run would have
                reason = _stop_reason(run, result)
            elif applied and cfg.save_every and progress.step % cfg.save_every == 0:
                run.save(is_best=False)
            if result.signal and reason is None:
                _stop_on_signal(run, stop)
        if reason is None:
            progress.epoch += 1
            progress.batch_in_epoch = 0
    if not progress.history or progress.history[-1]["step"] != progress.step:
        _validate_and_save(run)
    _finish(run, reason or "training.epochs done")


def _log_epoch(run: Run, batches: list[np.ndarray]) -> None:
    if run.progress.batch_in_epoch == 0:
        corpus, world = run.corpus, run.place.world_size
        log.info(
            "epoch %d: %d batches, %.1f%% padding%s",
            run.progress.epoch + 1,
            len(batches),
            100 * padding_fraction(batches, corpus.src_lengths, corpus.trg_lengths),
            f"; {len(batches) // world} steps of {world} batches" if world > 1 else "",
        )


def _stop_reason(run: Run, result: StepResult | None) -> str | None:
    cfg, progress = run.config.training, run.progress
    if result is not None and result.out_of_time:
        return "training.max_minutes reached"
    if cfg.max_steps is not None and progress.step >= cfg.max_steps:
        return "training.max_steps reached"
    if cfg.patience is not None and progress.bad_validations >= cfg.patience:
        return f"early stopping: no better dev {cfg.best_metric} in {cfg.patience} validations"
    return None


def _stop_on_signal(run: Run, stop: _StopFlag) -> None:
    run.save(is_best=False)
    sent = f"signal {stop.signal}" if stop.signal else "a signal to another rank"
    log.info("stopped by %s at step %d; continue with --resume", sent, run.progress.step)
    raise KeyboardInterrupt


def _finish(run: Run, reason: str) -> None:
    log.info(
        "done: %d steps (%s), best dev %s %.3f, %.1f minutes; run dir %s",
        run.progress.step,
        reason,
        run.config.training.best_metric,
        run.progress.best_score or 0.0,
        (time.time() - run.started) / 60,
        run.run_dir,
    )


def _update(
    run: Run, shard: list[np.ndarray], window: _Window, bar: ProgressBar, stop: _StopFlag
) -> StepResult:
    """One optimiser update on this rank's batches of the shard (every world-th, from its
    rank on: one, or training.accumulate), with its bookkeeping."""
    progress = run.progress
    lr = run.schedule.lr(progress.step + 1, progress)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    corpus = run.corpus
    mine = shard[run.place.rank :: run.place.world_size]
    batches = [corpus.batch(indices).to(run.device) for indices in mine]
    tokens = sum(int(corpus.trg_lengths[indices].sum()) for indices in shard)  # all ranks'
    result = _train_step(run, batches, tokens, stop)
    progress.minutes = result.minutes  # agreed by every rank: the clock's share of the lr
    if result.status != "applied":
        _skipped(run, result)
        return result
    progress.bad_steps_in_a_row = 0
    progress.step += 1
    window.loss += result.loss
    window.nll += result.nll
    window.tokens += tokens
    bar.update(result.loss / tokens, window.tokens / max(time.time() - window.started, 1e-9))
    if progress.step % run.config.training.log_every == 0:
        _log_window(run, window, lr, result.grad_norm)
    return result


def _skipped(run: Run, result: StepResult) -> None:
    """Count a skipped update; stop when the losses stay non-finite."""
    progress = run.progress
    progress.skipped_steps += 1
    if result.status == "overflow":  # the scaler lowered its scale: not a divergence
        progress.overflow_steps += 1
        log.info(
            "step %d: fp16 gradients overflowed, update skipped; loss scale now %g",
            progress.step + 1,
            run.scaler.get_scale(),
        )
        return
    progress.bad_steps_in_a_row += 1
    log.info("step %d: non-finite loss or gradient, update skipped", progress.step + 1)
    if progress.bad_steps_in_a_row >= MAX_BAD_STEPS:
        raise NMTError(
            f"training diverged: {progress.bad_steps_in_a_row} non-finite steps in a row after "
            f"step {progress.step}; lower training.learning_rate or use precision fp32/bf16 "
            f"(the last good checkpoint is {run.run_dir / 'last.pt'})"
        )


def _train_step(run: Run, batches: list[Batch], global_tokens: int, stop: _StopFlag) -> StepResult:
    """Forward, backward, agree across ranks, clip, step."""
    cfg = run.config.training
    run.optimizer.zero_grad(set_to_none=True)
    loss, nll = forward_backward(
        run.loss_module,
        batches,
        run.place.world_size / global_tokens,
        run.device,
        run.precision,
        run.scaler,
        cfg.oom_split,
        cfg.batch_tokens,
    )
    flags = [loss, nll, not math.isfinite(loss), stop.signal is not None, _out_of_time(run)]
    flags.append(_minutes(run))
    if run.place.enabled:  # one small all-reduce: totals, and flags every rank must act on
        flags = all_reduce([float(f) for f in flags], run.device)
    loss, nll, minutes = flags[0], flags[1], flags[5] / run.place.world_size
    nonfinite, signalled, late = (bool(f) for f in flags[2:5])
    if nonfinite:
        return StepResult(loss, nll, math.nan, "nonfinite", signalled, late, minutes)
    grad_norm, applied = apply_update(run.model, run.optimizer, run.scaler, cfg.clip_grad_norm)
    status = "applied" if applied else "overflow" if run.scaler is not None else "nonfinite"
    return StepResult(loss, nll, grad_norm, status, signalled, late, minutes)


def _minutes(run: Run) -> float:
    """The run's wall clock so far: this invocation's, data preparation included, and the
    minutes of the invocations it resumes."""
    return (time.time() - run.started) / 60


def _out_of_time(run: Run) -> bool:
    limit = run.config.training.max_minutes
    return limit is not None and _minutes(run) >= limit


def _log_window(run: Run, window: _Window, lr: float, grad_norm: float) -> None:
    elapsed = max(time.time() - window.started, 1e-9)
    tokens = max(window.tokens, 1)
    progress = run.progress
    metrics = {
        "loss": window.loss / tokens,
        "nll": window.nll / tokens,
        "ppl": math.exp(min(window.nll / tokens, 50.0)),
        "lr": lr,
        "grad_norm": grad_norm,
        "target_tokens_per_s": window.tokens / elapsed,
        "skipped_steps": progress.skipped_steps,
        "overflow_steps": progress.overflow_steps,
    }
    if run.scaler is not None:
        metrics["loss_scale"] = run.scaler.get_scale()
    run.tracker.scalars(progress.step, metrics, "train")
    log.info(
        "epoch %d step %d: loss %.3f ppl %.2f lr %.2e |g| %.2f %.0f tok/s%s",
        progress.epoch + 1,
        progress.step,
        metrics["loss"],
        metrics["ppl"],
        lr,
        grad_norm,
        metrics["target_tokens_per_s"],
        f" skipped {progress.skipped_steps} ({progress.overflow_steps} fp16 overflow)"
        if progress.skipped_steps
        else "",
    )
    window.loss, window.nll, window.tokens, window.started = 0.0, 0.0, 0, time.time()


def _validate_and_save(run: Run) -> None:
    """Validate (the same on every rank), update best/plateau/patience, save checkpoints."""
    metrics = validate(
        run.model,
        run.tokenizer,
        run.config,
        run.corpora,
        run.device,
        run.precision,
        run.tracker,
        run.progress.step,
        run.dev_alignment,
    )
    metrics = agree(metrics, run.place, run.device)
    improved = record_validation(
        run.progress, metrics, run.config.training.best_metric, run.schedule
    )
    run.save(improved)
    run.model.train()
