"""The progress bar of the decoding commands (on stderr, gone when done)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled or total == 0:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("translating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("translate", total=total)
        yield lambda n: bar.advance(task, n)
