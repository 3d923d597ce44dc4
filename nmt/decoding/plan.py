"""What a search runs, chosen once per request from the machine, the models and the request,
and said in one line: the decoding plan.

A Translator makes the plan (``Translator.plan``) before it decodes or scores, and its
runtime reads it instead of deciding again: the precision (chosen when the models were
loaded: ``nmt.fast.precision``, a CPU's auto by ``search_precision``), the kernels (nmt's
compiled C kernels on a CPU in float32 where every model's ``FastPaths.native_kernels``
says so and the library builds, ``nmt.fast.compiled``), the loop (``search.runs_on_device``;
scoring's forced pass), the batches decoded side by side (``workers.worker_count``), the
shortlist (``shortlist_used``) and the backend. The commands print ``line()`` on stderr and
record ``as_dict()`` in their JSON; the server's /api/models and the Python API carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch

from nmt.config import DecodingConfig
from nmt.decoding.options import Backend
from nmt.errors import ConfigError
from nmt.fast import compiled

Kernels = Literal["compiled", "torch", "onnxruntime"]
Loop = Literal["host", "device", "forced"]

_KERNELS = {
    "compiled": "compiled kernels",
    "torch": "torch ops",
    "onnxruntime": "onnxruntime graphs",
}
_LOOPS = {"host": "host loop", "device": "device loop", "forced": "forced pass"}


@dataclass(frozen=True)
class DecodingPlan:
    """One request's choices. ``workers``: the batches decoded at once (1 for a forced
    pass); ``shortlist``: each batch searches its shortlist's columns."""

    precision: str
    reason: str
    kernels: Kernels
    loop: Loop
    workers: int
    shortlist: bool
    backend: Backend

    def line(self) -> str:
        """``Decoding plan: fp32 (auto: ...), compiled kernels, host loop, 2 workers,
        shortlist off, torch``."""
        workers = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        parts = [
            f"{self.precision} ({self.reason})",
            _KERNELS[self.kernels],
            _LOOPS[self.loop],
            workers,
            f"shortlist {'on' if self.shortlist else 'off'}",
            self.backend,
        ]
        return "Decoding plan: " + ", ".join(parts)

    def as_dict(self) -> dict[str, object]:
        """The fields, and the line, for a JSON record."""
        return {**asdict(self), "line": self.line()}


def kernels_run(backend: Backend, device: torch.device, precision: str, native: bool) -> Kernels:
    """Which kernels a search's steps run: the exported graphs' under onnxruntime; nmt's
    compiled ones on a CPU in float32 where the models take them (``native``) and the
    library loads (built on a first run: here, once, not by each worker thread); else
    torch's ops."""
    if backend == "onnxruntime":
        return "onnxruntime"
    fits = device.type == "cpu" and precision == "fp32" and native
    return "compiled" if fits and compiled.library() is not None else "torch"


def shortlist_used(
    decoding: DecodingConfig, device: torch.device, backend: Backend, has_shortlists: bool
) -> bool:
    """Whether search runs over the models' shortlists under ``decoding.shortlist``: auto
    where the models have them, decode in torch and the device is a CPU; on insists (an
    error where it cannot). On a GPU the whole output layer is the faster."""
    if decoding.shortlist == "off":
        return False
    if decoding.shortlist == "on":
        if backend != "torch":
            raise ConfigError(
                "--shortlist on: the exported graphs compute the whole output layer; "
                "decode with --backend torch, or give --shortlist off"
            )
        if not has_shortlists:
            raise ConfigError(
                "--shortlist on: a model's checkpoint has no shortlist (runs trained "
                "before nmt built one with the run); give --shortlist off, or auto"
            )
        return True
    return device.type == "cpu" and backend == "torch" and has_shortlists
