"""Dynamic batching: the requests that arrive together are decoded together.

Each request becomes a ``Job`` on an asyncio queue. One collector task takes the oldest job,
waits at most ``batch_window_ms`` from its arrival for more, and hands the jobs with its key
(the same model and decoding options) to the one decode thread as one group, up to
``max_batch`` sentences; jobs of other keys wait for the next group, the oldest first. While
the thread decodes, new requests queue up, so the busier the server, the larger the groups:
throughput grows with load. Torch's decoding keeps the CPU busy by itself, so one thread per
process decodes, one group at a time.

An exception in a group's decoding is retried job by job, so that it reaches only the request
that causes it; the collector and the thread go on serving.

Closing the batcher (the server shutting down) fails every job still waiting or decoding with
``ShuttingDown`` at once and sets the stop event its group was handed, so that the search in
the thread ends at its next step rather than decoding to the end for no one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Batching:
    """How requests are grouped: the longest wait for more after the first arrives, the
    most sentences in one group, or (``no_batching``) each request alone in arrival order."""

    batch_window_ms: float = 5.0
    max_batch: int = 64
    no_batching: bool = False


class ShuttingDown(Exception):
    """The batcher was closed before the job's result: the server is shutting down."""


@dataclass
class Job:
    """One request's work: ``run(items, stop)`` decodes the items of the jobs grouped with
    it (all of ``key``, so all of one ``run``) and returns one result per item, or raises
    once the event ``stop`` is set (no one waits for the result any more); ``size``: its
    sentences. Jobs whose key is None are decoded alone."""

    key: Hashable | None
    size: int
    item: Any
    run: Callable[[list[Any], threading.Event], list[Any]]


@dataclass
class Done:
    """A job's result and how many sentences were decoded with it, its own included."""

    result: Any
    batched_with: int


@dataclass
class _Entry:
    job: Job
    future: asyncio.Future[Done]
    arrived: float  # the event loop's clock


class Batcher:
    """The queue of jobs, the collector that groups them and the one decode thread."""

    def __init__(self, batching: Batching = Batching()):
        self.batching = batching
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Entry] | None = None
        self._waiting: deque[_Entry] = deque()  # taken off the queue, not yet decoded
        self._decoding: list[_Entry] = []  # the group in the thread
        self._stop = threading.Event()  # handed to each group; set (and replaced) on close
        self._collector: asyncio.Task[None] | None = None
        self._thread: ThreadPoolExecutor | None = None  # started with the first group

    async def submit(self, job: Job) -> Done:
        """Queue the job and wait for its result (its exception, where decoding failed)."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:  # the first job of this event loop
            self._loop, self._queue, self._waiting = loop, asyncio.Queue(), deque()
        if self._collector is None or self._collector.done():
            self._collector = loop.create_task(self._collect())
        future: asyncio.Future[Done] = loop.create_future()
        self._queue.put_nowait(_Entry(job, future, loop.time()))
        return await future

    async def close(self) -> None:
        """Stop: every job waiting or decoding fails with ShuttingDown, the group in the
        thread is told to stop (its search ends at its next step) and the collector ends;
        a later job starts it again."""
        self._stop.set()
        self._stop = threading.Event()
        while self._queue is not None and not self._queue.empty():
            self._waiting.append(self._queue.get_nowait())
        for entry in [*self._decoding, *self._waiting]:
            if not entry.future.done():
                entry.future.set_exception(ShuttingDown())
        self._decoding = []
        self._waiting.clear()
        if self._collector is not None:
            self._collector.cancel()
            try:
                await self._collector
            except asyncio.CancelledError:
                pass
            self._collector = None
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    async def _collect(self) -> None:
        while True:
            group = await self._gather()
            if group:
                await self._decode(group)

    async def _gather(self) -> list[_Entry]:
        """The next group: the oldest job and, within its window, the jobs of its key."""
        assert self._queue is not None
        if not self._waiting:
            self._waiting.append(await self._queue.get())
        first = self._waiting[0]
        if self.batching.no_batching:
            return self._take([first])
        loop = asyncio.get_running_loop()
        deadline = first.arrived + self.batching.batch_window_ms / 1000.0
        while True:
            while not self._queue.empty():  # everything that has arrived
                self._waiting.append(self._queue.get_nowait())
            group = self._group(first.job.key)
            timeout = deadline - loop.time()
            full = sum(entry.job.size for entry in group) >= self.batching.max_batch
            if first.job.key is None or full or timeout <= 0:
                return self._take(group)
            try:
                self._waiting.append(await asyncio.wait_for(self._queue.get(), timeout))
            except asyncio.TimeoutError:
                pass

    def _group(self, key: Hashable | None) -> list[_Entry]:
        """The oldest waiting job and (a key) the later ones of its key that fit within
        ``max_batch`` sentences, in arrival order."""
        first = self._waiting[0]
        group, size = [first], first.job.size
        for entry in list(self._waiting)[1:]:
            fits = size + entry.job.size <= self.batching.max_batch
            if key is not None and entry.job.key == key and fits:
                group.append(entry)
                size += entry.job.size
        return group

    def _take(self, group: list[_Entry]) -> list[_Entry]:
        """The group off the waiting list, less the requests given up on (cancelled)."""
        taken = {id(entry) for entry in group}
        self._waiting = deque(entry for entry in self._waiting if id(entry) not in taken)
        return [entry for entry in group if not entry.future.done()]

    async def _decode(self, group: list[_Entry]) -> None:
        loop = asyncio.get_running_loop()
        jobs = [entry.job for entry in group]
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-decode")
        self._decoding = group
        try:
            outcomes = await loop.run_in_executor(self._thread, _run_group, jobs, self._stop)
        except Exception as exc:  # the thread could not run it at all
            outcomes = [(exc, job.size) for job in jobs]
        finally:
            self._decoding = []
        for entry, (outcome, together) in zip(group, outcomes, strict=True):
            if entry.future.done():
                continue
            if isinstance(outcome, BaseException):
                entry.future.set_exception(outcome)
            else:
                entry.future.set_result(Done(outcome, together))


def _run_group(jobs: Sequence[Job], stop: threading.Event) -> list[tuple[Any, int]]:
    """In the decode thread: the group's results (or exceptions) and the sentences each was
    decoded with; a group that fails is decoded again job by job, unless it was stopped."""
    size = sum(job.size for job in jobs)
    try:
        results = jobs[0].run([job.item for job in jobs], stop)
        return [(result, size) for result in results]
    except Exception as exc:
        if len(jobs) == 1 or stop.is_set():
            return [(exc, size) for _ in jobs]
    outcomes: list[tuple[Any, int]] = []
    for job in jobs:
        try:
            (result,) = job.run([job.item], stop)
            outcomes.append((result, job.size))
        except Exception as exc:
            outcomes.append((exc, job.size))
    return outcomes


def elapsed_ms(started: float) -> float:
    """Milliseconds since ``started`` (``time.perf_counter()``)."""
    return (time.perf_counter() - started) * 1000.0
