"""Decoding batches side by side on a CPU (``decoding.workers``), as Marian's and
CTranslate2's CPU translators run several translation threads.

A search step is a chain of small products (a batch's tens of rows at a time) and of
elementwise ops on a few thousand values. Torch splits each across its threads, and at these
sizes the split costs much of what it saves, where two products side by side, one thread
each, overlap almost fully. The ops between products, and the
search's host-side steps, then overlap too (as far as Python's lock lets them). So each
worker thread decodes whole batches with its share of torch's threads, and takes the next
batch when it is done; the exported graphs under onnxruntime run with sessions of that share
(``ExportedModel.sessions``). Each batch's
search is the one search runs alone (its sentences, its rows, its round-off), so the outputs
do not depend on the number of workers.

On a GPU a search step is a few dozen small kernels, replayed as one CUDA graph
(``nmt.decoding.captured``), each using a small part of the chip. A GPU decodes one batch at
a time unless ``decoding.workers`` names a number: then each worker thread decodes on its
own CUDA stream (``worker_stream``), with its own kept steps, so that two batches' kernels
can run on the device side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Literal, TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

AUTO_WORKERS = 2  # auto's worker count (docs/guide/translating.md, "Batches side by side")
# auto's smallest batches, in sentences: below it a batch's step is mostly host-side work that
# holds Python's lock, for which two threads contend
AUTO_MIN_SENTENCES = 16


def worker_count(workers: int | Literal["auto"], device: torch.device, sizes: Sequence[int]) -> int:
    """How many of the batches of ``sizes`` sentences decode at once: 1 for a single batch,
    and never more than the batches. auto is 2 on a CPU where torch has 2 threads or more
    and the batches hold ``AUTO_MIN_SENTENCES`` sentences on average, else 1; 1 on a GPU,
    where a number given is taken (each worker on its own stream)."""
    if len(sizes) < 2:
        return 1
    if workers != "auto":
        return max(1, min(workers, len(sizes)))
    if device.type != "cpu":
        return 1
    if sum(sizes) < AUTO_MIN_SENTENCES * len(sizes):  # small batches
        return 1
    return max(1, min(AUTO_WORKERS, torch.get_num_threads(), len(sizes)))


def in_workers(
    items: Sequence[Item], run: Callable[[Item], Result], workers: int
) -> Iterator[tuple[Item, Result]]:
    """Each item with ``run``'s result, in the order they finish. ``workers`` threads take
    the items in the order given, each thread with an equal share of the caller's torch
    threads (at least one). A failure is raised here once the running items are done; the
    items not yet started are dropped."""
    threads = torch.get_num_threads()
    share = max(1, threads // workers)
    pool = ThreadPoolExecutor(
        workers,
        thread_name_prefix="nmt-decode",
        initializer=torch.set_num_threads,
        initargs=(share,),
    )
    try:
        futures = {pool.submit(run, item): item for item in items}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        # a thread's torch.set_num_threads also sets the count new threads start with
        torch.set_num_threads(threads)


_STREAM = threading.local()  # a worker thread's own CUDA stream


@contextlib.contextmanager
def worker_stream(device: torch.device, workers: int) -> Iterator[None]:
    """With ``workers`` side by side on a GPU: the calling thread's work on its own CUDA
    stream (made once per thread), waited for at the end, so that whatever the worker hands
    back is done whichever stream reads it; else nothing changes."""
    if device.type != "cuda" or workers < 2:
        yield
        return
    stream = getattr(_STREAM, "stream", None)
    if stream is None:
        stream = _STREAM.stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what the caller queued first
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
