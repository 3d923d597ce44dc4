"""The training loop, written out: forward, backward, clip, step, validate, checkpoint."""

from __future__ import annotations

import json
import logging
import math
import platform
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt import __version__, checkpoint, evaluate
from nmt.config import Config, changed_keys, from_dict, to_yaml
from nmt.data import (
    TokenizedCorpus,
    bucket_batches,
    drop_empty,
    drop_long,
    padding_fraction,
    read_pairs,
    tokenize,
)
from nmt.errors import CheckpointError, ConfigError, NMTError
from nmt.model import Seq2Seq, build_model, count_parameters
from nmt.runtime import (
    autocast,
    choose_device,
    choose_precision,
    eval_mode,
    seed_everything,
    set_threads,
)
from nmt.tokenizer import Tokenizer, load_model_file, train_sentencepiece
from nmt.tracking import ProgressBar, Tracker, setup_logging
from nmt.translate import Translator

log = logging.getLogger("nmt")

MAX_BAD_STEPS = 10  # consecutive non-finite steps before training stops


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_score: float | None = None
    bad_validations: int = 0
    lr_scale: float = 1.0
    skipped_steps: int = 0
    bad_steps_in_a_row: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class Schedule:
    """Learning rate as a function of the step, plus halving on a dev plateau."""

    def __init__(self, kind: str, base_lr: float, warmup: int, patience: int):
        self.kind, self.base_lr, self.warmup, self.patience = kind, base_lr, warmup, patience

    def lr(self, step: int, progress: Progress) -> float:
        step = max(step, 1)
        scale = 1.0
        if self.warmup and step < self.warmup and self.kind != "plateau":
            scale = step / self.warmup
        if self.kind == "inverse_sqrt" and step >= max(self.warmup, 1):
            scale = math.sqrt(max(self.warmup, 1) / step)
        return self.base_lr * scale * progress.lr_scale


def _better(score: float, best: float | None, metric: str) -> bool:
    if best is None:
        return True
    return score > best if metric == "bleu" else score < best


# ----------------------------------------------------------------------------- run directory


def prepare_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """Create the run dir; return the checkpoint to resume from (or None)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} exists and is a file; choose another --run-dir")
    last = run_dir / "last.pt"
    if last.is_file():
        if not resume:
            raise ConfigError(
                f"run.dir: {run_dir} already holds a training run; pass --resume to continue it "
                f"or --run-dir to start a new one"
            )
        return last
    if resume:
        log.info("no checkpoint in %s; starting a new run", run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_run_info(run_dir: Path, config: Config, device: torch.device, precision: str) -> None:
    checkpoint.atomic_write_text(run_dir / "config.yaml", to_yaml(config))
    info = {
        "nmt_version": __version__,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "threads": torch.get_num_threads(),
        "precision": precision,
    }
    checkpoint.atomic_write_text(run_dir / "environment.json", json.dumps(info, indent=2) + "\n")


# ----------------------------------------------------------------------------- data


def build_tokenizer(config: Config, train_rows: Any) -> Tokenizer:
    cfg = config.tokenizer
    if cfg.model:
        proto = load_model_file(Path(cfg.model))
        return Tokenizer(proto, proto)
    args = (
        cfg.vocab_size,
        cfg.type,
        cfg.character_coverage,
        cfg.max_train_sentences,
        config.training.seed,
    )
    started = time.time()
    if cfg.joint:
        proto = train_sentencepiece([*train_rows["src"], *train_rows["trg"]], *args)
        tokenizer = Tokenizer(proto, proto)
    else:
        tokenizer = Tokenizer(
            train_sentencepiece(train_rows["src"], *args),
            train_sentencepiece(train_rows["trg"], *args),
        )
    log.info(
        "tokenizer: %s %s, vocab %d/%d, trained in %.1fs",
        cfg.type,
        "joint" if cfg.joint else "separate",
        tokenizer.src_vocab_size,
        tokenizer.trg_vocab_size,
        time.time() - started,
    )
    return tokenizer


@dataclass
class Corpora:
    train: TokenizedCorpus
    dev: TokenizedCorpus
    dev_src: list[str]
    dev_trg: list[str]
    dev_src_ids: list[list[int]]


def load_corpora(
    config: Config, run_dir: Path, tokenizer: Tokenizer | None
) -> tuple[Corpora, Tokenizer]:
    cache = run_dir / "cache"
    train_rows, empty = drop_empty(read_pairs(config.data, config.data.train, cache))
    if empty:
        log.info("train: dropped %d pairs with an empty side", empty)
    if len(train_rows) == 0:
        raise NMTError(f"data.train: {config.data.train} has no usable sentence pairs")
    tokenizer = tokenizer or build_tokenizer(config, train_rows)
    train_ids, long = drop_long(tokenize(train_rows, tokenizer), config.data.max_length)
    if long:
        log.info(
            "train: dropped %d pairs longer than data.max_length=%d", long, config.data.max_length
        )
    if len(train_ids) == 0:
        raise NMTError("data.max_length: every training pair is longer than this; raise it")
    dev_rows, _ = drop_empty(read_pairs(config.data, config.data.dev, cache))
    if len(dev_rows) == 0:
        raise NMTError(f"data.dev: {config.data.dev} has no usable sentence pairs")
    dev_ids = tokenize(dev_rows, tokenizer)
    limit = min(len(dev_rows), config.data.dev_max_sentences or len(dev_rows))
    dev_src, dev_trg = list(dev_rows["src"][:limit]), list(dev_rows["trg"][:limit])
    corpora = Corpora(
        train=TokenizedCorpus(train_ids),
        dev=TokenizedCorpus(dev_ids),
        dev_src=dev_src,
        dev_trg=dev_trg,
        dev_src_ids=[list(ids) for ids in dev_ids["src_ids"][:limit]],
    )
    log.info("data: %d training pairs, %d dev pairs", len(corpora.train), len(corpora.dev))
    return corpora, tokenizer


# ----------------------------------------------------------------------------- validation


@torch.no_grad()
def dev_loss(
    model: Seq2Seq, dev: TokenizedCorpus, batch_tokens: int, device: torch.device, precision: str
) -> float:
    total, tokens = 0.0, 0
    with eval_mode(model), autocast(device, precision):
        for indices in bucket_batches(dev.src_lengths, dev.trg_lengths, batch_tokens, 0, 0):
            batch = dev.batch(indices).to(device)
            _, nll = model.loss(batch)
            total += float(nll)
            tokens += batch.n_target_tokens
    return total / max(tokens, 1)


def validate(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    config: Config,
    corpora: Corpora,
    device: torch.device,
    precision: str,
    tracker: Tracker,
    step: int,
) -> dict[str, float]:
    """Dev loss and perplexity (teacher forcing), BLEU and chrF of greedy translations."""
    started = time.time()
    loss = dev_loss(model, corpora.dev, config.training.batch_tokens, device, precision)
    translator = Translator(model, tokenizer, config, device, precision)
    greedy = config.decoding.model_copy(update={"beam_size": 1})
    hyps = translator.decode_ids(corpora.dev_src_ids, greedy)
    hyp_lines = [translator.detokenize(h[0]) for h in hyps]
    report = evaluate.score({"dev": hyp_lines}, [corpora.dev_trg], metrics=("bleu", "chrf"))
    scores = report.systems[0]
    metrics = {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "bleu": float(scores.bleu or 0.0),
        "chrf": float(scores.chrf or 0.0),
    }
    tracker.scalars(step, metrics, "dev")
    _attention_image(translator, corpora, tracker, step)
    log.info(
        "validation at step %d: dev loss %.3f ppl %.2f BLEU %.2f chrF %.2f (%.1fs) | %s -> %s",
        step,
        metrics["loss"],
        metrics["ppl"],
        metrics["bleu"],
        metrics["chrf"],
        time.time() - started,
        corpora.dev_src[0][:60],
        hyp_lines[0][:60],
    )
    return metrics


def _attention_image(translator: Translator, corpora: Corpora, tracker: Tracker, step: int) -> None:
    if not tracker.enabled:
        return
    from nmt.plots import attention_figure_array

    greedy = translator.config.decoding.model_copy(update={"beam_size": 1})
    hyp = translator.decode_ids(corpora.dev_src_ids[:1], greedy, return_attention=True)[0][0]
    if hyp.alphas is None or not hyp.tokens:
        return
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(corpora.dev_src_ids[0])
    trg = [*tokenizer.trg_pieces(hyp.tokens), "</s>"]
    tracker.image(step, "dev/attention", attention_figure_array(src, trg, hyp.alphas.numpy()))


# ----------------------------------------------------------------------------- checkpoints


def _state(
    model: Seq2Seq,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    progress: Progress,
    config: Config,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "progress": asdict(progress),
        "config": config.model_dump(mode="json"),
        "tokenizer": tokenizer.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
        },
    }


def save_checkpoints(run_dir: Path, state: dict[str, Any], keep_last: int, is_best: bool) -> None:
    step = state["progress"]["step"]
    checkpoint.save(run_dir / "last.pt", state)
    if is_best:
        checkpoint.save(run_dir / "best.pt", state)
    if keep_last > 1:
        checkpoint.save(run_dir / f"step-{step:08d}.pt", state)
        for old in sorted(run_dir.glob("step-*.pt"))[: -(keep_last - 1)]:
            old.unlink()


def check_resume_config(saved: Config, new: Config) -> None:
    changed = changed_keys(saved, new)
    if not changed:
        return
    log.info("config changed since the checkpoint: %s", ", ".join(changed))
    frozen = [k for k in changed if k.startswith(("model.", "tokenizer."))]
    if frozen:
        raise ConfigError(
            f"{frozen[0]}: changed since the checkpoint and cannot apply to the saved model "
            f"(changed: {', '.join(frozen)}); restore it or start a new --run-dir"
        )


# ----------------------------------------------------------------------------- the loop


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
class Run:
    """Everything one training run works on: a plain bundle, passed to small functions."""

    config: Config
    run_dir: Path
    model: Seq2Seq
    optimizer: torch.optim.Optimizer
    scaler: Any
    progress: Progress
    tokenizer: Tokenizer
    corpora: Corpora
    tracker: Tracker
    device: torch.device
    precision: str
    schedule: Schedule
    started: float

    def save(self, is_best: bool) -> None:
        state = _state(
            self.model, self.optimizer, self.scaler, self.progress, self.config, self.tokenizer
        )
        save_checkpoints(self.run_dir, state, self.config.training.keep_last, is_best)


def train(
    config: Config, run_dir: Path | None = None, resume: bool = False, quiet: bool = False
) -> Path:
    """Train a model as configured; returns the run directory."""
    run_dir = Path(run_dir or config.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} exists and is a file; choose another --run-dir")
    with checkpoint.RunLock(run_dir):
        return _train_locked(config, run_dir, resume, quiet)


def _train_locked(
    config: Config, run_dir: Path | None = None, resume: bool = False, quiet: bool = False
) -> Path:
    """The training run proper, with the run directory locked."""
    run_dir = Path(run_dir or config.run.dir)
    resume_from = prepare_run_dir(run_dir, resume)
    setup_logging(run_dir, quiet=quiet)
    set_threads(config.run.threads)
    device = choose_device(config.run.device)
    precision = choose_precision(config.training.precision, device)
    started = time.time()

    saved: dict[str, Any] | None = None
    tokenizer: Tokenizer | None = None
    if resume_from is not None:
        saved = checkpoint.load(resume_from)
        check_resume_config(from_dict(saved["config"], f"{resume_from} (saved config)"), config)
        tokenizer = Tokenizer.from_state_dict(saved["tokenizer"])
        log.info("resuming from %s (step %d)", resume_from, saved["progress"]["step"])
    seed_everything(config.training.seed)
    corpora, tokenizer = load_corpora(config, run_dir, tokenizer)
    tokenizer.save(run_dir)
    write_run_info(run_dir, config, device, precision)

    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size).to(device)
    optimizer = _optimizer(config, model)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    progress = _restore(saved, model, optimizer, scaler) if saved is not None else Progress()
    log.info(
        "model: %s decoder, %s attention, %d parameters; %s, %s",
        config.model.decoder.style,
        config.model.attention.score,
        count_parameters(model),
        device,
        precision,
    )
    cfg = config.training
    schedule = Schedule(cfg.schedule, cfg.learning_rate, cfg.warmup_steps, cfg.plateau_patience)
    tracker = Tracker(run_dir)
    run = Run(
        config,
        run_dir,
        model,
        optimizer,
        scaler,
        progress,
        tokenizer,
        corpora,
        tracker,
        device,
        precision,
        schedule,
        started,
    )
    try:
        with _StopFlag() as stop, ProgressBar(enabled=not quiet) as bar:
            _loop(run, stop, bar)
    finally:
        tracker.close()
    return run_dir


def _optimizer(config: Config, model: Seq2Seq) -> torch.optim.Optimizer:
    cfg = config.training
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


def _restore(
    saved: dict[str, Any], model: Seq2Seq, optimizer: torch.optim.Optimizer, scaler: Any
) -> Progress:
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint does not fit the configured model: {exc}") from None
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    rng = saved["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    return Progress(**saved["progress"])


@dataclass
class _Window:
    """Training statistics since the last log line."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0
    started: float = field(default_factory=time.time)


def _loop(run: Run, stop: _StopFlag, bar: ProgressBar) -> None:
    """Epochs of bucketed batches; validate and checkpoint at the interval and at the end."""
    cfg, progress, corpora = run.config.training, run.progress, run.corpora
    window = _Window()
    validated_at = -1
    run.model.train()
    while progress.epoch < cfg.epochs:
        batches = bucket_batches(
            corpora.train.src_lengths,
            corpora.train.trg_lengths,
            cfg.batch_tokens,
            cfg.seed,
            progress.epoch,
        )
        _log_epoch(run, batches)
        bar.start_epoch(progress.epoch + 1, len(batches), progress.batch_in_epoch)
        while progress.batch_in_epoch < len(batches):
            batch = corpora.train.batch(batches[progress.batch_in_epoch]).to(run.device)
            progress.batch_in_epoch += 1
            if not _update(run, batch, window, bar):
                continue
            if stop.signal:
                run.save(is_best=False)
                log.info(
                    "stopped by signal %d at step %d; continue with --resume",
                    stop.signal,
                    progress.step,
                )
                raise KeyboardInterrupt
            reason = _stop_reason(run)
            if progress.step % cfg.validate_every == 0 or reason:
                _validate_and_save(run)
                validated_at = progress.step
                reason = reason or (
                    "early stopping" if _early_stop(progress, cfg.patience) else None
                )
            if reason:
                log.info("stopping at step %d (%s)", progress.step, reason)
                _finish(run)
                return
        progress.epoch += 1
        progress.batch_in_epoch = 0
    if validated_at != progress.step:
        _validate_and_save(run)
    _finish(run)


def _log_epoch(run: Run, batches: list[np.ndarray]) -> None:
    if run.progress.batch_in_epoch == 0:
        train = run.corpora.train
        log.info(
            "epoch %d: %d batches, %.1f%% padding",
            run.progress.epoch + 1,
            len(batches),
            100 * padding_fraction(batches, train.src_lengths, train.trg_lengths),
        )


def _stop_reason(run: Run) -> str | None:
    cfg = run.config.training
    if cfg.max_minutes is not None and (time.time() - run.started) / 60 >= cfg.max_minutes:
        return "training.max_minutes reached"
    if cfg.max_steps is not None and run.progress.step >= cfg.max_steps:
        return "training.max_steps reached"
    return None


def _finish(run: Run) -> None:
    log.info(
        "done: %d steps, best dev %s %.3f, %.1f minutes; run dir %s",
        run.progress.step,
        run.config.training.best_metric,
        run.progress.best_score or 0.0,
        (time.time() - run.started) / 60,
        run.run_dir,
    )


def _update(run: Run, batch: Any, window: _Window, bar: ProgressBar) -> bool:
    """One optimiser update with its bookkeeping; False when the step was skipped."""
    progress = run.progress
    lr = run.schedule.lr(progress.step + 1, progress)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss, nll, grad_norm, applied = _train_step(run, batch)
    if not applied:
        progress.skipped_steps += 1
        progress.bad_steps_in_a_row += 1
        log.info("step %d: non-finite loss or gradient, update skipped", progress.step + 1)
        if progress.bad_steps_in_a_row >= MAX_BAD_STEPS:
            raise NMTError(
                f"training diverged: {progress.bad_steps_in_a_row} non-finite steps in a row after "
                f"step {progress.step}; lower training.learning_rate or use precision fp32/bf16 "
                f"(the last good checkpoint is {run.run_dir / 'last.pt'})"
            )
        return False
    progress.bad_steps_in_a_row = 0
    progress.step += 1
    window.loss += loss
    window.nll += nll
    window.tokens += batch.n_target_tokens
    elapsed = max(time.time() - window.started, 1e-9)
    bar.update(loss / batch.n_target_tokens, window.tokens / elapsed)
    if progress.step % run.config.training.log_every == 0:
        _log_window(run, window, lr, grad_norm)
    return True


def _train_step(run: Run, batch: Any) -> tuple[float, float, float, bool]:
    """Forward, backward, clip, step; returns (loss sum, nll sum, grad norm, applied)."""
    cfg, model, optimizer, scaler = run.config.training, run.model, run.optimizer, run.scaler
    optimizer.zero_grad(set_to_none=True)
    with autocast(run.device, run.precision):
        loss_sum, nll_sum = model.loss(batch, cfg.label_smoothing)
    loss = loss_sum / batch.n_target_tokens
    if not torch.isfinite(loss):
        return float("nan"), float("nan"), float("nan"), False
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    max_norm = cfg.clip_grad_norm if cfg.clip_grad_norm is not None else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skips the update itself when gradients overflowed
        scaler.update()
        applied = scaler.get_scale() >= scale
    else:
        applied = math.isfinite(grad_norm)
        if applied:
            optimizer.step()
    return float(loss_sum.detach()), float(nll_sum), grad_norm, applied


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
    }
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
        f" skipped {progress.skipped_steps}" if progress.skipped_steps else "",
    )
    window.loss, window.nll, window.tokens, window.started = 0.0, 0.0, 0, time.time()


def _validate_and_save(run: Run) -> None:
    progress, metric = run.progress, run.config.training.best_metric
    metrics = validate(
        run.model,
        run.tokenizer,
        run.config,
        run.corpora,
        run.device,
        run.precision,
        run.tracker,
        progress.step,
    )
    score = metrics[metric]
    improved = _better(score, progress.best_score, metric)
    if improved:
        progress.best_score = score
        progress.bad_validations = 0
    else:
        progress.bad_validations += 1
        if run.schedule.kind == "plateau" and progress.bad_validations % run.schedule.patience == 0:
            progress.lr_scale *= 0.5
            log.info(
                "dev %s has not improved for %d validations: learning rate halved",
                metric,
                run.schedule.patience,
            )
    progress.history.append({"step": progress.step, **metrics})
    run.save(improved)
    run.model.train()


def _early_stop(progress: Progress, patience: int | None) -> bool:
    return patience is not None and progress.bad_validations >= patience
