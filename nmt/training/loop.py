"""The training loop, written out: epochs of batches, each update a ``train_step`` (forward,
backward, clip, step; ``step.py``), validation and checkpoints at their intervals, and the
reasons to stop. The run it works on is assembled by ``Run.build`` (``run.py``).

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
import time
from pathlib import Path

import numpy as np
import torch

from nmt.config import Config
from nmt.data.batching import padding_fraction
from nmt.data.corpus import check_files
from nmt.data.store import TokenizedCorpus
from nmt.errors import NMTError, WriteError
from nmt.training.batches import epoch_batches, to_device
from nmt.training.distributed import Distributed, init_distributed, shutdown_distributed
from nmt.training.finetune import Initial, check_initial_weights, read_initial
from nmt.training.process import setup_process
from nmt.training.run import Pending, Run
from nmt.training.rundir import (
    RunLock,
    check_run_dir,
    epoch_corpus_in_turn,
    prepare_run_dir,
)
from nmt.training.schedule import record_validation
from nmt.training.step import PendingStep, StepResult, StopFlag, backward, queue_update, train_step
from nmt.training.tracking import ProgressBar, setup_logging
from nmt.training.validation import agree, validate

log = logging.getLogger("nmt")

MAX_BAD_STEPS = 10  # consecutive non-finite steps before training stops


def train(
    config: Config,
    run_dir: Path | None = None,
    resume: bool = False,
    quiet: bool = False,
    *,
    restart: bool = False,
) -> Path:
    """Train a model as configured (one process, or one rank under torchrun); returns the
    run directory. ``restart``: the process may start itself again first
    (``setup_process``), as the `nmt` command does."""
    setup_process(config, restart)
    check_files(config)  # before anything is written
    initial = None if resume else read_initial(config)
    if initial is not None:
        check_initial_weights(config, initial)
    run_dir = Path(run_dir or config.run.dir)
    check_run_dir(run_dir, resume)
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
    initial: Initial | None,
) -> None:
    """The training run proper, with the run directory locked; ``initial``: the checkpoint
    a fine-tuning run starts from (not when resuming)."""
    resume_from = prepare_run_dir(run_dir, resume)
    setup_logging(run_dir if place.is_main else None, quiet=quiet or not place.is_main)
    run = Run.build(config, run_dir, place, device, resume_from=resume_from, initial=initial)
    try:
        with StopFlag() as stop, ProgressBar(enabled=not quiet and place.is_main) as bar:
            _loop(run, stop, bar)
    except WriteError as exc:
        run.tracker.close(failed=True)
        raise _stopped_by(exc, run) from exc
    except BaseException:
        run.tracker.close(failed=True)
        raise
    finally:
        run.close()
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


# ----------------------------------------------------------------------------- the loop


def _loop(run: Run, stop: StopFlag, bar: ProgressBar) -> None:
    """Epochs of bucketed batches; validate and checkpoint at the interval and at the end."""
    cfg, progress, world = run.config.training, run.progress, run.place.world_size
    run.updater.model.train()
    reason = _stop_reason(run, None)
    while reason is None and progress.epoch < cfg.epochs:
        corpus = epoch_corpus_in_turn(run.corpora, progress.epoch, run.place)  # its pairs
        _begin_epoch(run)
        shaped = progress.shaped_epoch
        batches = epoch_batches(corpus, cfg.batch_tokens, cfg.seed, progress.epoch, shaped)
        _log_epoch(run, corpus, batches)
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
            shard = _shard(batches, progress.batch_in_epoch, per_update, world)
            progress.batch_in_epoch += len(shard)
            following = _shard(batches, progress.batch_in_epoch, per_update, world)
            result = _update(run, corpus, shard, following, bar, stop)
            if result is None:  # queued, none read yet (training.deferred_reads)
                continue
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


def _shard(batches: list[np.ndarray], start: int, per_update: int, world: int) -> list[np.ndarray]:
    """The batches of the update that starts at batch ``start`` of the epoch: world x
    accumulate of them, or at the epoch's end what is left in whole rounds of one batch per
    rank (none: the epoch is done)."""
    left = (len(batches) - start) // world * world
    return batches[start : start + min(per_update, left)]


def _shaped(run: Run) -> bool:
    """Whether a new epoch's batches take static shapes: the model captures CUDA graphs."""
    return run.updater.model.graphs is not None


def _begin_epoch(run: Run) -> None:
    """Decide the epoch's kind of batches (``Progress.shaped_epoch``): at its start, as the
    model wants them; an epoch resumed part-way keeps the kind it began with, and where the
    model's CUDA graphs would want the other kind, they rest until the epoch ends."""
    progress, graphs = run.progress, run.updater.model.graphs
    if progress.batch_in_epoch == 0:
        progress.shaped_epoch = _shaped(run)
    elif progress.shaped_epoch != _shaped(run):
        log.info(
            "epoch %d resumes with the %s batches it began with",
            progress.epoch + 1,
            "static-shape" if progress.shaped_epoch else "bucketed",
        )
    if graphs is not None:
        graphs.paused = not progress.shaped_epoch  # no static shapes: no graphs to replay


def _log_epoch(run: Run, corpus: TokenizedCorpus, batches: list[np.ndarray]) -> None:
    if run.progress.batch_in_epoch == 0:
        world, graphs = run.place.world_size, run.updater.model.graphs
        shaped = run.config.training.batch_tokens if run.progress.shaped_epoch else None
        log.info(
            "epoch %d: %d batches, %.1f%% padding%s%s",
            run.progress.epoch + 1,
            len(batches),
            100 * padding_fraction(batches, corpus.src_lengths, corpus.trg_lengths, shaped),
            f"; {len(batches) // world} steps of {world} batches" if world > 1 else "",
            ""
            if graphs is None or graphs.paused
            else f"; static shapes for CUDA graphs ({len(graphs)} captured so far, "
            f"{graphs.capture_seconds:.1f} s)",
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


def _stop_on_signal(run: Run, stop: StopFlag) -> None:
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
        run.clock.minutes(),
        run.run_dir,
    )


def _update(
    run: Run,
    corpus: TokenizedCorpus,
    shard: list[np.ndarray],
    following: list[np.ndarray],
    bar: ProgressBar,
    stop: StopFlag,
) -> StepResult | None:
    """One optimiser update on this rank's batches of the shard (every world-th, from its
    rank on: one, or training.accumulate), with its bookkeeping; ``following``: the next
    update's shard (none at the epoch's end), whose batches are made meanwhile where
    training.prefetch is on.

    With training.deferred_reads (``Updater.defers``) the update is queued, and the one
    before it read while it runs: -> the result read here, that one's (None: none was
    queued). An update after which the loop validates, saves or stops is read at once
    (``_read_now``), so that no later forward has run when it does."""
    progress, updater = run.progress, run.updater
    rank, world = run.place.rank, run.place.world_size
    shaped, budget = progress.shaped_epoch, run.config.training.batch_tokens
    host = run.prefetch.take(corpus, shard[rank::world], budget, shaped)
    if following:
        run.prefetch.ahead(corpus, following[rank::world], budget, shaped)
    batches = [to_device(batch, updater.device) for batch in host]
    tokens = sum(int(corpus.trg_lengths[indices].sum()) for indices in shard)  # all ranks'
    if not updater.defers:
        lr = _set_lr(run)
        result = train_step(updater, batches, tokens, run.clock, stop)
        _account(run, result, tokens, lr, bar)
        return result
    sums = backward(updater, batches, tokens)
    earlier = None
    if run.pending is not None:  # the update before, read while this one's backward runs
        pending, run.pending = run.pending, None
        earlier = pending.step.read()
        _account(run, earlier, pending.tokens, pending.lr, bar)
    lr = _set_lr(run)
    queued = queue_update(updater, sums, run.clock, stop)
    if _read_now(run, queued, following):
        result = queued.read()
        _account(run, result, tokens, lr, bar)
        return result
    run.pending = Pending(queued, tokens, lr)
    return earlier


def _set_lr(run: Run) -> float:
    """The learning rate of the next update, set on the optimiser."""
    lr = run.schedule.lr(run.progress.step + 1, run.progress)
    for group in run.updater.optimizer.param_groups:
        group["lr"] = lr
    return lr


def _read_now(run: Run, queued: PendingStep, following: list[np.ndarray]) -> bool:
    """Whether the loop validates, saves or stops after this update, were it applied (its
    step, since the one before has been read): the epoch's last update, a validation or save
    step, max_steps, a signal or the time limit."""
    cfg, step = run.config.training, run.progress.step + 1
    return (
        not following
        or queued.signalled
        or queued.out_of_time
        or step % cfg.validate_every == 0
        or bool(cfg.save_every and step % cfg.save_every == 0)
        or (cfg.max_steps is not None and step >= cfg.max_steps)
    )


def _account(run: Run, result: StepResult, tokens: int, lr: float, bar: ProgressBar) -> None:
    """An update's bookkeeping, once read: the step count, the window, the bar and the log."""
    progress, window = run.progress, run.window
    progress.minutes = result.minutes  # agreed by every rank: the clock's share of the lr
    if result.status != "applied":
        _skipped(run, result)
        return
    progress.bad_steps_in_a_row = 0
    progress.step += 1
    window.loss += result.loss
    window.nll += result.nll
    window.tokens += tokens
    bar.update(result.loss / tokens, window.tokens / max(time.time() - window.started, 1e-9))
    if progress.step % run.config.training.log_every == 0:
        _log_window(run, lr, result.grad_norm)


def _skipped(run: Run, result: StepResult) -> None:
    """Count a skipped update; stop when the losses stay non-finite."""
    progress = run.progress
    progress.skipped_steps += 1
    if result.status == "overflow":  # the scaler lowered its scale: not a divergence
        progress.overflow_steps += 1
        log.info(
            "step %d: fp16 gradients overflowed, update skipped; loss scale now %g",
            progress.step + 1,
            run.updater.scaler.get_scale(),
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


def _log_window(run: Run, lr: float, grad_norm: float) -> None:
    window, progress, scaler = run.window, run.progress, run.updater.scaler
    elapsed = max(time.time() - window.started, 1e-9)
    tokens = max(window.tokens, 1)
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
    if scaler is not None:
        metrics["loss_scale"] = scaler.get_scale()
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
    metrics = agree(validate(run), run.place, run.updater.device)
    improved = record_validation(
        run.progress, metrics, run.config.training.best_metric, run.schedule
    )
    run.save(improved)
    run.updater.model.train()
