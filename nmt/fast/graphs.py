"""CUDA graphs of a training loss, forward and backward: the whole loss, or a step-by-step
decoder's teacher-forced unroll.

On a GPU a training step launches its kernels one by one and waits on the launches, not on
arithmetic: a step-by-step decoder (Bahdanau's, Luong's with input feeding) runs a few small
kernels per target position, forward and backward, and every step launches hundreds more
around it (the encoder, the output layer's chunks, the loss). ``StepGraphs`` captures a
call for a batch shape once, as two CUDA graphs (``torch.cuda.make_graphed_callables``: the
forward, and the backward of its inputs and the owner's parameters), and replays them for
every later batch of that shape: one launch each instead of thousands. The call is the
model's whole training loss (``Seq2Seq.static_loss``, for a GRU encoder, whose lengths it
counts on the device and whose RNN it runs unpacked), or, with an LSTM encoder or
``training.cuda_graphs_scope: unroll``, the decoder's unroll alone, the encoder's packed RNN
and the loss's selection of real target tokens then running as before. A whole loss that
cannot be captured falls back to the unroll (``CaptureError``).

A graph holds fixed shapes, so the training loop pads its batches to a few static shapes
(``nmt.data.batching.shaped_batches``); the decoder steps its RNN through matmuls
(``nmt.fast.cells``), which a capture holds. Dropout inside a graph draws from CUDA's
generator through the graph's own offsets, so every replay draws new masks.

Each shape's graphs keep their own memory (the activations the backward reads). Arguments are
trees of tensors (``nmt.fast.trees``: the attention memory, the decoder state); their other
values are part of the shape's key.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from nmt.errors import NMTError
from nmt.fast.trees import flatten, rebuild

log = logging.getLogger("nmt")

WARMUP_ITERATIONS = 3  # eager passes on a side stream before a capture (torch's default)


class CaptureError(NMTError):
    """A call torch could not capture as a CUDA graph (an operation a graph cannot hold)."""

    def __init__(self, what: str, reason: str):
        super().__init__(
            f"training.cuda_graphs: {what} could not be captured ({reason}); "
            f"set training.cuda_graphs: false"
        )
        self.what = what
        self.reason = reason


class _Call(nn.Module):
    """``function(*args)`` over flat tensors, the arguments rebuilt around them from their
    ``structure`` (``trees.flatten``'s): the module ``make_graphed_callables`` graphs;
    ``owner``'s parameters are its own, so their gradients come out of the graph."""

    def __init__(self, owner: nn.Module, function: Callable[..., Any], structure: Hashable):
        super().__init__()
        self.owner = owner
        self.function = function
        self.structure = structure

    def forward(self, *flat: Tensor) -> Any:
        return self.function(*rebuild(self.structure, iter(flat)))


class StepGraphs:
    """Captured graphs of calls, one per signature (the owner, its mode, the tensors' shapes,
    dtypes and grad flags, the other fields, autocast's state); see the module docstring."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[Any, ...], nn.Module] = {}
        self.paused = False  # call eagerly (e.g. while counting FLOPs)
        self._storages: dict[int, tuple[int, ...]] = {}  # the parameters' memory at capture
        self.capture_seconds = 0.0

    def __deepcopy__(self, memo: dict[int, Any]) -> StepGraphs:
        return StepGraphs()  # graphs belong to one module's parameters

    def __len__(self) -> int:
        return len(self.graphs)

    def __call__(
        self,
        owner: nn.Module,
        function: Callable[..., Any],
        *args: Any,
        what: str = "the decoder's unroll",
    ) -> Any:
        """``function(*args)``, through the graph of this signature (captured now if new);
        ``CaptureError`` (naming ``what`` was captured) where torch cannot capture it."""
        if self.paused:
            return function(*args)
        flat: list[Tensor] = []
        structure = flatten(args, flat)
        key = (
            id(owner),
            owner.training,
            structure,
            tuple((t.shape, t.dtype, t.requires_grad) for t in flat),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
        )
        storages = tuple(p.data_ptr() for p in owner.parameters())
        if self._storages.get(id(owner), storages) != storages:
            # the parameters were given new memory (a GPU RNN's weights re-packed by a move,
            # a load into new tensors): the graphs read the old; capture again
            self.graphs = {k: g for k, g in self.graphs.items() if k[0] != id(owner)}
            log.debug("the decoder's parameters moved: its graphs are captured again")
        self._storages[id(owner)] = storages
        graphed = self.graphs.get(key)
        if graphed is None:
            try:
                graphed = self._capture(owner, function, structure, flat)
            except RuntimeError as exc:  # an op a graph cannot hold
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise CaptureError(what, reason) from exc
            self.graphs[key] = graphed
        return graphed(*flat)

    def _capture(
        self,
        owner: nn.Module,
        function: Callable[..., Any],
        structure: Hashable,
        flat: list[Tensor],
    ) -> nn.Module:
        started = time.perf_counter()
        gc.collect()  # an eager step's graph left for the collector would hold its params'
        # gradient nodes on the default stream, which a capture on another stream cannot wait on
        call = _Call(owner, function, structure)
        # fresh leaves as the sample inputs: the graphs keep them as their input buffers
        samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in flat)
        # the warm-up passes draw dropout masks: the run's random numbers stay as they were,
        # so that a resumed run draws what the uninterrupted one drew
        rng = torch.cuda.get_rng_state()
        try:
            with uncached_autocast():
                graphed = torch.cuda.make_graphed_callables(
                    call, samples, num_warmup_iters=WARMUP_ITERATIONS, allow_unused_input=True
                )
        finally:
            torch.cuda.set_rng_state(rng)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        shapes = " ".join("x".join(map(str, t.shape)) for t in flat[:2])
        log.debug("captured the decoder's graphs for %s in %.2f s", shapes, seconds)
        assert isinstance(graphed, nn.Module)
        return graphed


def uncached_autocast() -> torch.autocast:
    """CUDA autocast as it is now (on or off, its dtype) with its cache off, for a capture
    (training's graphs, search's step): a cached cast copy of a weight is made outside the
    graph, which would read it as it was, and after autocast frees it."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    return torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False)
