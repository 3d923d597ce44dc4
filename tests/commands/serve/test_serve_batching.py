"""The batcher on its own (jobs that record how they were grouped, no model): groups by key up
to max_batch, the oldest job first, each job alone without batching, one decode thread, and a
failing group retried job by job."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from typing import Any

import pytest

from nmt.commands.serve.batching import Batcher, Batching, Done, Job, ShuttingDown


class Recorder:
    """A ``Job.run`` that records each group's items and the thread it ran on, and fails on
    an item "bad"."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.threads: set[str] = set()

    def __call__(self, items: list[str], stop: threading.Event) -> list[str]:
        self.groups.append(list(items))
        self.threads.add(threading.current_thread().name)
        if "bad" in items:
            raise ValueError("bad item")
        return [item.upper() for item in items]


def _run(
    batching: Batching, jobs: list[tuple[Hashable | None, int, str]]
) -> tuple[list[Any], Recorder]:
    """Submit ``jobs`` (key, size, item) at once; their outcomes (Done or the exception)."""
    recorder = Recorder()

    async def main() -> list[Any]:
        batcher = Batcher(batching)
        tasks = [batcher.submit(Job(key, size, item, recorder)) for key, size, item in jobs]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await batcher.close()
        return outcomes

    return asyncio.run(main()), recorder


AT_ONCE = Batching(batch_window_ms=0, max_batch=4)  # the jobs queued together are grouped


def test_jobs_of_a_key_are_grouped_the_oldest_first() -> None:
    jobs = [("a", 1, "x"), ("b", 1, "y"), ("a", 2, "z"), (None, 1, "s"), ("b", 1, "w")]
    outcomes, recorder = _run(AT_ONCE, jobs)
    assert recorder.groups[0] == ["x", "z"]  # the oldest job's key first, then in arrival order
    assert sorted(map(sorted, recorder.groups)) == [["s"], ["w", "y"], ["x", "z"]]
    assert [o.result for o in outcomes] == ["X", "Y", "Z", "S", "W"]
    assert [o.batched_with for o in outcomes] == [3, 2, 3, 1, 2]


def test_a_group_holds_at_most_max_batch_sentences() -> None:
    jobs = [("a", 2, "p"), ("a", 3, "q"), ("a", 2, "r"), ("a", 5, "t")]
    outcomes, recorder = _run(AT_ONCE, jobs)
    # p + r fit in 4; q alone; t (5 > 4) alone rather than never
    assert recorder.groups == [["p", "r"], ["q"], ["t"]]
    assert [o.batched_with for o in outcomes] == [4, 3, 4, 5]


def test_without_batching_each_job_is_decoded_alone_in_arrival_order() -> None:
    jobs = [("a", 1, "x"), ("a", 2, "y"), ("a", 1, "z")]
    outcomes, recorder = _run(Batching(no_batching=True), jobs)
    assert recorder.groups == [["x"], ["y"], ["z"]]
    assert [o.batched_with for o in outcomes] == [1, 2, 1]


def test_one_decode_thread() -> None:
    jobs = [(key, 1, "x") for key in ("a", "b", "c", None, None)]
    _, recorder = _run(AT_ONCE, jobs)
    assert len(recorder.groups) == 5 and len(recorder.threads) == 1
    assert recorder.threads.pop().startswith("nmt-decode")


def test_a_failing_group_is_retried_job_by_job() -> None:
    """Only the job that fails gets the exception; the batcher serves the next job."""
    outcomes, recorder = _run(AT_ONCE, [("a", 1, "x"), ("a", 1, "bad"), ("a", 1, "y")])
    assert recorder.groups == [["x", "bad", "y"], ["x"], ["bad"], ["y"]]
    assert isinstance(outcomes[1], ValueError)
    assert outcomes[0] == Done("X", 1) and outcomes[2] == Done("Y", 1)


@pytest.mark.parametrize("batching", [AT_ONCE, Batching(no_batching=True)])
def test_the_batcher_goes_on_after_a_failure(batching: Batching) -> None:
    outcomes, _ = _run(batching, [(None, 1, "bad"), ("a", 1, "x")])
    assert isinstance(outcomes[0], ValueError) and outcomes[1] == Done("X", 1)


def test_the_window_waits_for_more_until_the_group_is_full() -> None:
    """A job arriving within the first one's window joins its group; a full group is decoded
    at once, without waiting out the window."""
    recorder = Recorder()

    async def main() -> tuple[list[Any], float]:
        loop = asyncio.get_running_loop()
        batcher = Batcher(Batching(batch_window_ms=10_000, max_batch=2))
        started = loop.time()
        first = asyncio.ensure_future(batcher.submit(Job("a", 1, "x", recorder)))
        await asyncio.sleep(0.05)
        second = batcher.submit(Job("a", 1, "y", recorder))
        outcomes = await asyncio.gather(first, second)
        elapsed = loop.time() - started
        await batcher.close()
        return outcomes, elapsed

    outcomes, elapsed = asyncio.run(main())
    assert recorder.groups == [["x", "y"]] and [o.batched_with for o in outcomes] == [2, 2]
    assert elapsed < 5.0


def test_closing_fails_the_waiting_jobs_and_a_later_job_starts_it_again() -> None:
    recorder = Recorder()

    async def main() -> tuple[Any, Done]:
        batcher = Batcher(Batching(batch_window_ms=10_000, max_batch=8))
        waiting = asyncio.ensure_future(batcher.submit(Job("a", 1, "x", recorder)))
        await asyncio.sleep(0.05)  # in its window
        await batcher.close()
        (failed,) = await asyncio.gather(waiting, return_exceptions=True)
        again = await batcher.submit(Job(None, 1, "y", recorder))
        await batcher.close()
        return failed, again

    failed, again = asyncio.run(main())
    assert isinstance(failed, ShuttingDown)
    assert again == Done("Y", 1) and recorder.groups == [["y"]]


def test_closing_fails_the_job_decoding_and_stops_its_run_at_once() -> None:
    """The job in the thread gets ShuttingDown without waiting for its run, which is told
    to stop (its event set) and is not retried; a later job runs with a fresh event."""
    started, stops = threading.Event(), []

    def slow(items: list[str], stop: threading.Event) -> list[str]:
        stops.append(stop)
        started.set()
        if not stop.wait(10):
            return ["late" for _ in items]
        raise RuntimeError("stopped")

    async def main() -> tuple[Any, float, Done]:
        loop = asyncio.get_running_loop()
        batcher = Batcher(Batching(batch_window_ms=0))
        decoding = asyncio.ensure_future(batcher.submit(Job("a", 1, "x", slow)))
        other = asyncio.ensure_future(batcher.submit(Job("a", 1, "y", slow)))
        await loop.run_in_executor(None, started.wait, 10)
        begun = loop.time()
        await batcher.close()
        outcomes = await asyncio.gather(decoding, other, return_exceptions=True)
        took = loop.time() - begun
        again = await batcher.submit(Job(None, 1, "z", lambda items, stop: [stop.is_set()]))
        await batcher.close()
        return outcomes, took, again

    outcomes, took, again = asyncio.run(main())
    assert all(isinstance(outcome, ShuttingDown) for outcome in outcomes) and took < 1.0
    assert len(stops) == 1 and stops[0].is_set()  # the group was not run again job by job
    assert again == Done(False, 1)
