"""Where training stands (``Progress``, saved in every checkpoint), the learning rate over the
run, and what each validation decides: the best score, the plateau halving and the count
towards early stopping."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from nmt.config import TrainingConfig

log = logging.getLogger("nmt")


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch used, over all ranks
    # whether this epoch's batches take CUDA graphs' static shapes (shaped_batches): a run
    # resumed on another device finishes the epoch with the batches it began it with
    shaped_epoch: bool = False
    best_score: float | None = None
    bad_validations: int = 0
    lr_scale: float = 1.0
    skipped_steps: int = 0  # updates skipped for any reason
    overflow_steps: int = 0  # of which the fp16 grad scaler skipped (normal, a few)
    bad_steps_in_a_row: int = 0  # non-finite losses or gradients in a row
    minutes: float = 0.0  # wall clock used (data preparation included, over every --resume)
    # as of the last update, the same on every rank: training.max_minutes counts it
    history: list[dict[str, float]] = field(default_factory=list)
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss, nll, tokens
    # summed since the last log line, so that a resumed run logs the same windows


def peak_rate(cfg: TrainingConfig, processes: int = 1) -> float:
    """training.learning_rate, or with ``lr_reference_tokens`` R the square-root rule for
    Adam (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms", section 4: a batch k times larger takes a rate sqrt(k) times larger):
    lr * sqrt(N / R), N = batch_tokens x accumulate x processes, the padded tokens an update
    may hold."""
    if cfg.lr_reference_tokens is None:
        return cfg.learning_rate
    tokens = cfg.batch_tokens * cfg.accumulate * processes
    return cfg.learning_rate * math.sqrt(tokens / cfg.lr_reference_tokens)


class Schedule:
    """Learning rate as a function of the step, plus halving on a dev plateau.

    Every schedule first ramps up linearly over ``warmup`` updates (lr * step / warmup); then
    ``constant`` and ``warmup`` stay at lr, ``inverse_sqrt`` decays as lr * sqrt(warmup / step)
    (Vaswani et al. 2017, eq. 3), and ``plateau`` halves lr after every ``patience``
    validations without improvement (``Progress.lr_scale``). ``linear`` and ``cosine`` decay
    from lr towards 0 over a budget: the updates after the warmup up to ``total``
    (training.max_steps) or to the end of the last epoch (``epochs`` times the updates of
    the epoch under way, ``epoch_updates``, which the loop sets at each epoch's start), the
    wall clock up to ``minutes`` (training.max_minutes), whichever runs out first. With p
    the fraction of the budget used, (step - warmup - 1) / (updates - warmup) for updates
    (the nearer of the two ends) and ``Progress.minutes`` / minutes for the clock (the larger
    of the two p), the rate is lr (1 - p) or lr (1 + cos(pi p)) / 2 (Loshchilov & Hutter
    2017, without restarts; over a time budget as in Li et al. 2020, "Budgeted Training");
    the last update still has a small positive rate. With ``hold`` h > 0 the rate stays at lr
    for the first h of the budget and decays over the rest, p being (p - h) / (1 - h) from
    there (warmup-stable-decay: Hu et al. 2024, MiniCPM; Hägele et al. 2024).
    """

    def __init__(
        self,
        kind: str,
        base_lr: float,
        warmup: int,
        patience: int,
        total: int | None = None,
        minutes: float | None = None,
        hold: float = 0.0,
        epochs: int | None = None,
    ):
        budget = (total is not None and total > warmup) or minutes or epochs
        if kind in ("linear", "cosine") and not budget:
            raise ValueError(f"{kind} decay needs updates above the warmup, epochs or minutes")
        self.kind, self.base_lr, self.warmup, self.patience = kind, base_lr, warmup, patience
        self.total = total if total is not None and total > warmup else None
        self.minutes = minutes
        self.hold = hold
        self.epochs = epochs
        self.epoch_updates = 0  # updates in the epoch under way: set by the loop

    @classmethod
    def from_config(cls, cfg: TrainingConfig, processes: int = 1) -> Schedule:
        """The schedule of the ``training`` section, its peak rate ``peak_rate`` (``processes``:
        the ranks, each with its own batches)."""
        return cls(
            cfg.schedule,
            peak_rate(cfg, processes),
            cfg.warmup_steps,
            cfg.plateau_patience,
            total=cfg.max_steps,
            minutes=cfg.max_minutes,
            hold=cfg.decay_hold,
            epochs=cfg.epochs,
        )

    def updates(self) -> int | None:
        """The update the decay ends at: max_steps or the end of the last epoch, the nearer
        one above the warmup (None: neither)."""
        ends = [self.total] if self.total is not None else []
        if self.epochs and self.epochs * self.epoch_updates > self.warmup:
            ends.append(self.epochs * self.epoch_updates)
        return min(ends) if ends else None

    def lr(self, step: int, progress: Progress) -> float:
        step = max(step, 1)
        scale = 1.0
        if step < self.warmup:
            scale = step / self.warmup
        elif self.kind == "inverse_sqrt":
            scale = math.sqrt(max(self.warmup, 1) / step)
        elif self.kind in ("linear", "cosine"):
            done, total = 0.0, self.updates()
            if total is not None:
                done = max(step - self.warmup - 1, 0) / (total - self.warmup)
            if self.minutes:
                done = max(done, progress.minutes / self.minutes)
            done = min(max(done - self.hold, 0.0) / (1.0 - self.hold), 1.0)
            scale = 1 - done if self.kind == "linear" else (1 + math.cos(math.pi * done)) / 2
        return self.base_lr * scale * progress.lr_scale


def _better(score: float, best: float | None, metric: str) -> bool:
    if best is None:
        return True
    return score > best if metric == "bleu" else score < best


def record_validation(
    progress: Progress, metrics: dict[str, float], metric: str, schedule: Schedule
) -> bool:
    """Best score, validations without improvement and the plateau scale; True if improved."""
    score = metrics[metric]
    improved = _better(score, progress.best_score, metric)
    if improved:
        progress.best_score = score
        progress.bad_validations = 0
    else:
        progress.bad_validations += 1
        if schedule.kind == "plateau" and progress.bad_validations % schedule.patience == 0:
            progress.lr_scale *= 0.5
            log.info(
                "dev %s has not improved for %d validations: learning rate halved",
                metric,
                schedule.patience,
            )
    progress.history.append({"step": progress.step, **metrics})
    return improved
