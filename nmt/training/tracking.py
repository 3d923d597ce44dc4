"""Metrics to tensorboard and metrics.jsonl; human log lines to train.log and stderr."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nmt.errors import WriteError
from nmt.files import atomic_write_text, os_error, write_error

log = logging.getLogger("nmt")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time, so a live progress bar can sit below."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _LogFile(logging.FileHandler):
    """train.log; a line it cannot write (a full disk) is dropped without logging's traceback
    on stderr: the run's next checkpoint or metrics write meets the same disk and stops it
    with one line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def setup_logging(run_dir: Path | None, quiet: bool = False) -> None:
    """Log lines to stderr and, when given, to run_dir/train.log (appending on resume)."""
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    if not quiet:
        stream = _StderrHandler()
        stream.setFormatter(formatter)
        log.addHandler(stream)
    if run_dir is not None:
        file = _LogFile(run_dir / "train.log", encoding="utf-8")
        file.setFormatter(formatter)
        log.addHandler(file)


def _quiet_tensorboard_thread() -> None:
    """tensorboard writes its event file from a thread of its own; a write that fails there (a
    full disk) is raised again by the writer's next call in the training thread, where it
    becomes the run's one-line error. Python would also print the thread's traceback: not
    for that thread's OSError."""
    previous = threading.excepthook
    if getattr(previous, "nmt_quiet", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == (
            "_AsyncWriterThread"
        ):
            return
        previous(args)

    hook.nmt_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Tracker:
    """Writes scalars to metrics.jsonl and, with ``tensorboard`` (``run.tensorboard``), scalars
    and images to tensorboard; a no-op off rank 0.

    ``resumed_at``: the step of the checkpoint a resumed run starts from. What the killed run
    logged after it is dropped from metrics.jsonl and hidden from tensorboard (its
    ``purge_step``), so that both show one history, the same as an uninterrupted run's.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool = True,
        resumed_at: int | None = None,
        tensorboard: bool = True,
    ):
        self.enabled = enabled
        self.metrics_path = run_dir / "metrics.jsonl"
        self.tensorboard = run_dir / "tensorboard"
        self.writer: Any = None
        if enabled:
            purge = None
            if resumed_at is not None:
                _truncate_metrics(self.metrics_path, resumed_at)
                purge = resumed_at + 1
            else:
                self._start_afresh()
            if not tensorboard:
                return
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            with self._writing(self.tensorboard):
                self.writer = SummaryWriter(log_dir=str(self.tensorboard), purge_step=purge)

    def _start_afresh(self) -> None:
        """A run without a checkpoint starts its history afresh: what a run killed before its
        first checkpoint logged in this directory goes (metrics.jsonl, tensorboard's events)."""
        stale = [self.metrics_path] if self.metrics_path.exists() else []
        stale += sorted(self.tensorboard.glob("events.out.tfevents.*"))
        if not stale:
            return
        log.info(
            "no checkpoint here: the history of an earlier start is removed (%d files)", len(stale)
        )
        for path in stale:
            path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """An OS error while writing ``path`` (a full disk) is a WriteError naming it;
        tensorboard's writer thread hands its error to the next call, or wraps it."""
        try:
            yield
        except WriteError:
            raise
        except Exception as exc:
            cause = os_error(exc)
            if cause is None:
                raise
            raise write_error(path, cause) from exc

    @property
    def images(self) -> bool:
        """Whether images are kept (tensorboard is written): the caller draws them only then."""
        return self.writer is not None

    def scalars(self, step: int, values: dict[str, float], split: str) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            with self._writing(self.tensorboard):
                for name, value in values.items():
                    self.writer.add_scalar(f"{split}/{name}", value, step)
        record = {"split": split, "step": step, "time": round(time.time(), 3), **values}
        with self._writing(self.metrics_path), self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def image(self, step: int, name: str, rgb: np.ndarray) -> None:
        if self.images:
            with self._writing(self.tensorboard):
                self.writer.add_image(name, rgb, step, dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        """Flush and close tensorboard; after a failure (``failed``) an error here is not
        raised over the first one."""
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        try:
            with self._writing(self.tensorboard):
                writer.flush()
                writer.close()
        except OSError:
            if not failed:
                raise


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps up to ``last_step`` (a line cut off by a crash goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step <= last_step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


class ProgressBar:
    """A progress bar for the epoch on stderr with loss and target tokens/s; only on a terminal."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TextColumn("{task.fields[speed]:,.0f} tok/s"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.bar.__enter__()
        return self

    def start_epoch(self, epoch: int, total: int, done: int) -> None:
        if self.bar is None:
            return
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(
            "train", total=total, completed=done, epoch=epoch, loss=0.0, speed=0.0
        )

    def update(self, loss: float, speed: float) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=1, loss=loss, speed=speed)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
