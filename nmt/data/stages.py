"""Preparation's stages: each one timed for the log, and a progress bar with an ETA on stderr
while it runs (on a terminal only; gone when done)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def on_terminal() -> bool:
    return sys.stderr.isatty()


class Stages:
    """Seconds per stage (``stage``), and progress bars (``bar``) when ``show``."""

    def __init__(self, show: bool):
        self.show = show
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open stage: the seconds of stages inside it

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; a stage inside another counts for itself only, not twice."""
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            own = elapsed - self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + own
            if self._inner:
                self._inner[-1] += elapsed

    @contextmanager
    def bar(self, description: str, total: int) -> Iterator[Callable[[int], None] | None]:
        """A bar over ``total`` bytes; yields ``advance(n)``, or None when not shown."""
        if not self.show or total <= 0:
            yield None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (
            description,
            BarColumn(),
            DownloadColumn(),
            TimeElapsedColumn(),
            "eta",
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda n: progress.advance(task, n)

    def summary(self) -> str:
        """``read 1.2s, tokenizer 3.4s, ...`` in the order the stages ran."""
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.seconds.items())
