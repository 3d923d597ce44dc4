"""The loop of a search (``run_steps``: ``nmt.decoding.search``'s greedy and beam loops) and
its step replayed on a GPU: in fixed shapes, captured once as a CUDA graph (``capture``),
its inputs written back in place (``write_back``), and kept for later batches of the same
static shape.

A capture costs tens of milliseconds, as much as a batch's replays, so a captured step is
kept (``kept_graphs``: each thread's own, its last ``GRAPH_CACHE``): with graphs
(``captures``), a batch is padded to a static shape (``shaped_batch``: ``decoding.batch_size``
sentences, the source and the output to a length class), and a later batch of that shape
copies its own tensors into the kept step's and replays it (``run_steps``). A kept step is
keyed by the shapes and types of everything it reads and writes, the search's settings, the
precision and the addresses of the weights it reads (``kept_key``); a shortlisted batch,
whose output layer is its own, is captured for itself alone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmt.config import DecodingConfig
from nmt.decoding.ensemble import EnsembleState, Stepper
from nmt.decoding.finished import DoneFlag
from nmt.fast.graphs import uncached_autocast
from nmt.fast.trees import flatten, write_back
from nmt.vocab import EOS_ID, PAD_ID

log = logging.getLogger("nmt")

EAGER_STEPS = 2  # steps run as they are before a capture: the state's shape settles in the
# first (coverage appears), and the second warms the kernels up on a side stream
_FAILED: list[str] = []  # why a capture failed in this process, whose later batches then
# run without graphs instead of failing again
GRAPH_CACHE = 8  # captured steps kept for later batches, the least recently used dropped
LENGTH_CLASSES = (32, 64, 128, 256, 512)  # a static batch's source and output lengths
# (longer: the next multiple of 256): few, since a GPU's search step waits on its kernels'
# launches, not on the attention over a longer padded source


class SearchStopped(Exception):
    """A search ended before its output because its caller asked it to (``run_steps``'s
    ``stop``): it has no result."""


@dataclass
class _Kept:
    """A captured step kept for later batches: its replay and the tensors it reads and
    writes (the batch it was captured for), into which a later batch copies its own."""

    replay: Callable[[], None]
    inputs: Any


_CAPTURE_LOCK = threading.Lock()  # one capture at a time in a process
_THREAD = threading.local()  # each thread's kept steps: batches decoded side by side on a
# GPU (decoding.workers) each replay their own, on their own stream


def kept_graphs() -> OrderedDict[tuple[Any, ...], _Kept]:
    """This thread's kept steps, the least recently used first (at most GRAPH_CACHE)."""
    graphs = getattr(_THREAD, "graphs", None)
    if graphs is None:
        graphs = _THREAD.graphs = OrderedDict()
    return graphs


def static_batch(
    src: Tensor, src_lengths: Tensor, limits: list[int], decoding: DecodingConfig
) -> tuple[Tensor, Tensor, list[int], int]:
    """The batch padded to a static shape, so that a captured step serves later batches: at
    least ``decoding.batch_size`` sentences (an added one is a source of EOS alone, whose
    only output is EOS: limit 1) and the source to its length class (``LENGTH_CLASSES``;
    the positions past each sentence's length are masked, as they are in any batch) ->
    (src, src_lengths, limits, the output length class of the longest limit)."""
    batch, width = src.size(0), src.size(1)
    rows, columns = max(batch, decoding.batch_size), length_class(width)
    padded = src.new_full((rows, columns), PAD_ID)
    padded[:batch, :width] = src
    padded[batch:, 0] = EOS_ID
    lengths = src_lengths.new_ones(rows)
    lengths[:batch] = src_lengths
    return padded, lengths, limits + [1] * (rows - batch), length_class(max(limits))


def shaped_batch(
    graphs: bool,
    scorer: Stepper[Any],
    src: Tensor,
    src_lengths: Tensor,
    limits: list[int],
    decoding: DecodingConfig,
) -> tuple[Tensor, Tensor, list[int], int]:
    """The batch a search steps: padded to a static shape (``static_batch``) where its
    steps are captured and may be kept (``static_shapes``), else as it is -> (src,
    src_lengths, limits, the output length its tensors hold)."""
    if static_shapes(graphs, scorer):
        return static_batch(src, src_lengths, limits, decoding)
    return src, src_lengths, limits, max(limits)


def static_shapes(graphs: bool, scorer: Stepper[Any]) -> bool:
    """Whether a batch is padded to a static shape: where its steps are captured and may
    be kept (not over a shortlist, whose columns and rows are the batch's own)."""
    return graphs and shortlisted(scorer) is None


def shortlisted(scorer: Stepper[Any]) -> Tensor | None:
    """A stepper's shortlist columns (``Ensemble.restricted``), or None."""
    return getattr(scorer, "columns", None)


def length_class(length: int) -> int:
    """The least of ``LENGTH_CLASSES`` that holds ``length``, else its next multiple of 256."""
    for size in LENGTH_CLASSES:
        if length <= size:
            return size
    return -(-length // 256) * 256


def kept_key(
    scorer: Stepper[Any], settings: tuple[Any, ...], graphs: bool
) -> tuple[Any, ...] | None:
    """The key under which a search's captured step is kept (``kept_graphs``): the
    search's ``settings`` and what the step reads besides its inputs (the precision, the
    weights' addresses), or None: nothing kept (no graphs, a shortlist's own output layer,
    a stepper without models)."""
    models = getattr(scorer, "models", None)
    if not graphs or not models or shortlisted(scorer) is not None:
        return None
    tables = getattr(scorer, "tables", [])
    weights = [t for m in models for t in (*m.parameters(), *m.buffers())]
    weights += [t for table in tables for t in table.weights()]
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    native = getattr(scorer, "native_kernels", None)
    addresses = tuple(w.data_ptr() for w in weights)
    return (settings, autocast, native, getattr(scorer, "average", None), addresses)


def run_steps(
    step: Callable[..., None],
    inputs: Any,
    done: Callable[[Any], Tensor],
    longest: int,
    graphs: bool,
    key: tuple[Any, ...] | None = None,
    after: Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
) -> Any:
    """At most ``longest`` steps of ``step(inputs)``, until every flag of ``done(inputs)`` (a
    flag the host never waits for) -> the inputs the steps ended in: ``inputs``, or a kept
    step's, into which they were copied. With ``graphs`` the step after the first
    EAGER_STEPS is captured, or, under ``key``, a kept one of the same shapes replayed,
    and the rest replay it. ``after(inputs)`` runs between steps (a loop that drops what
    has ended, never with ``graphs``); such a loop reads its flag at once. Once ``stop`` is
    set, the next step raises SearchStopped instead (a caller that no longer wants the
    result: a server shutting down)."""
    assert after is None or not graphs, "a captured step's shapes cannot change"
    flag = DoneFlag(done(inputs).device if after is None else torch.device("cpu"))
    replay: Callable[[], None] | None = None
    for index in range(longest):
        if stop is not None and stop.is_set():
            raise SearchStopped("the search was asked to stop")
        if replay is not None:
            replay()
        elif graphs and index == EAGER_STEPS:  # the warm-up before a capture is this step
            replay, inputs = _replayed(step, inputs, key)
        else:
            step(inputs)
        if flag.all_done(done(inputs)):
            break
        if after is not None:
            after(inputs)
    return inputs


def _replayed(
    step: Callable[..., None], inputs: Any, key: tuple[Any, ...] | None
) -> tuple[Callable[[], None] | None, Any]:
    """This step, run by the replay of a kept capture of the same shapes (``inputs``
    copied into its own), else captured (and kept under ``key``) -> the replay, or None
    (the capture failed), and the inputs the steps now use."""
    graphs = kept_graphs()
    full = None if key is None else (key, _signature(inputs))
    kept = graphs.get(full) if full is not None else None
    if kept is not None and full is not None:
        graphs.move_to_end(full)
        write_back(kept.inputs, inputs, strict=True)
        kept.replay()
        return kept.replay, kept.inputs
    replay = capture(lambda strict=False: step(inputs, strict))
    if replay is not None and full is not None:
        graphs[full] = _Kept(replay, inputs)
        while len(graphs) > GRAPH_CACHE:
            graphs.popitem(last=False)
    return replay, inputs


def _signature(inputs: Any) -> Any:
    """What a kept step's inputs must match: their structure (``trees.flatten``: the values
    of their plain fields) and their tensors' shapes, dtypes, devices and strides."""
    tensors: list[Tensor] = []
    structure = flatten(inputs, tensors)
    return structure, tuple((t.shape, t.dtype, t.device, t.stride()) for t in tensors)


def captures(decoding: DecodingConfig, device: torch.device) -> bool:
    """Whether the step is captured as a CUDA graph (``decoding.cuda_graphs``, on a GPU,
    unless a capture failed before in this process)."""
    return decoding.cuda_graphs and device.type == "cuda" and not _FAILED


def capture(step: Callable[..., None]) -> Callable[[], None] | None:
    """``step`` as a CUDA graph: warmed up once on a side stream (a real step), then
    captured there (recorded, not run; ``step(strict=True)``) under autocast without its
    cache, whose copies of the weights would otherwise live outside the graph; -> its
    replay, or None where the capture fails: one log line, and this batch's steps and every
    later batch's run as they are.

    Through ``CUDAGraph.capture_begin`` and ``capture_end`` rather than ``torch.cuda.graph``,
    whose entry waits for the whole device and empties the memory caches (device and pinned
    host) before every capture; one capture at a time in a process (``_CAPTURE_LOCK``, as
    torch requires), in ``thread_local`` mode, so that another worker's search goes on."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    graph = torch.cuda.CUDAGraph()
    try:
        with _CAPTURE_LOCK, uncached_autocast(), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                step(strict=True)
            finally:
                graph.capture_end()
    except (RuntimeError, ValueError) as error:
        _FAILED.append(str(error))
        log.warning(
            "search: its step could not be captured as a CUDA graph (%s); search runs "
            "without one from now on",
            error,
        )
        return None
    finally:
        torch.cuda.current_stream().wait_stream(side)  # the warm-up step, before what follows
    return graph.replay


def step_as_tensor(state: Any, device: torch.device) -> Any:
    """An ensemble's decoder states with their ``step`` a 0-d tensor (as an exported step's
    input), which a step then advances on the device; any other stepper's state as it is."""
    if not isinstance(state, EnsembleState):
        return state
    states = [
        dataclasses.replace(member, step=torch.tensor(int(member.step), device=device))
        for member in state.states
    ]
    return EnsembleState(state.memories, states, state.allowed)
