"""Which precision a process computes in: ``auto`` decided by the hardware, and said why.

``choose_precision`` turns what the config (``training.precision``) or the command
(``--precision``) asks for into the precision autocast runs, with its reason (a CPU search's
``auto`` is decided by timing the search instead: ``nmt.decoding.search_precision``):

- **CUDA**: ``auto`` is bf16 where the GPU has it natively (compute capability 8.0 and
  later), else fp16 with the grad scaler (a T4 or V100 emulates bf16 slowly but has fast fp16).
- **CPU**: ``auto`` is bf16 only where the CPU has native bf16 instructions (``avx512_bf16``
  or AMX on x86, ``bf16`` on Arm) *and* a short probe of the model's own matmul shapes finds
  bf16 autocast faster than fp32 (some CPUs with native bf16 still run fp32 matmuls faster);
  otherwise fp32. The probe's verdict is cached beside the compiled kernels
  (``nmt.fast.compiled.cache_dir()``), one file per CPU, torch version, thread count, oneDNN
  ISA cap and set of shapes, so it runs once per machine and again when any of those change.
- An explicit ``bf16`` on a CPU where bf16 is slower (emulated: a CPU without native bf16, or
  ``ONEDNN_MAX_CPU_ISA`` capping oneDNN below it) is kept, with one warning that gives the
  measured slowdown and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nmt.fast.compiled import cache_dir
from nmt.files import atomic_write_text
from nmt.runtime import cpu_description, cpu_flags

log = logging.getLogger("nmt")

CHOICES = ("auto", "fp32", "bf16", "fp16")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86, x86 AMX, Arm
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN's instruction-set caps
PROBE_ROWS = 512  # rows of the probe's matmuls at most (a batch's tokens, capped: a short probe)
PROBE_SHAPES = 3  # the model's largest weight shapes that the probe times
PROBE_REPEATS = 5
MIN_WEIGHT = (
    1 << 16
)  # a model whose largest weight is smaller: bf16's casts cost more than it saves
SPEEDUP_NEEDED = 1.1  # bf16 must beat fp32 by this much: it also costs precision
SCREEN = (64, 256, 1024)  # a quick first matmul that tells emulated bf16 apart in milliseconds
EMULATED = 0.25  # bf16 at under this fraction of fp32's speed in the screen: emulated

_warned: set[str] = set()


@dataclass(frozen=True)
class Probe:
    """Seconds for one forward and backward of the probed matmuls, in fp32 and bf16 autocast."""

    fp32_s: float
    bf16_s: float
    shapes: list[list[int]]  # [rows, in, out] of each probed matmul
    screen_only: bool  # bf16 was so slow in the screen that the full probe did not run

    @property
    def speedup(self) -> float:
        """bf16's speed relative to fp32's (above 1: bf16 is faster)."""
        return self.fp32_s / self.bf16_s


@dataclass(frozen=True)
class Precision:
    """What autocast runs (fp32, bf16 or fp16) and why; ``probe`` where a CPU probe ran."""

    name: str
    reason: str
    probe: Probe | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"

    def record(self) -> dict[str, Any]:
        """For environment.json and reports."""
        return {
            "precision": self.name,
            "precision_reason": self.reason,
            "precision_probe": None if self.probe is None else asdict(self.probe),
        }


def choose_precision(
    asked: str,
    device: torch.device,
    model: nn.Module | None = None,
    rows: int = PROBE_ROWS,
    source: str = "training.precision",
) -> Precision:
    """The precision to run ``model`` in on ``device`` (see the module docstring); ``rows``:
    the rows of its matmuls (a batch's target tokens, or sentences x beams); ``source`` names
    the setting in messages."""
    if asked not in CHOICES:
        raise ValueError(f"precision {asked!r}: expected one of {', '.join(CHOICES)}")
    if device.type == "cuda":
        return _cuda(asked, device)
    if device.type != "cpu" or asked in ("fp32", "fp16"):
        return Precision("fp32" if asked == "auto" else asked, f"{source}: {asked}")
    shapes = probe_shapes(model, rows) if model is not None else []
    if asked == "bf16":
        return _asked_bf16(shapes, source)
    if not has_native_bf16():
        return Precision("fp32", "auto: this CPU has no native bf16")
    if not shapes:
        return Precision("fp32", "auto: the model's matmuls are too small for bf16 to pay")
    probe, cached = cached_probe(shapes)
    measured = f"{probe.speedup:.2f}x fp32's speed in a {'cached ' if cached else ''}probe"
    if probe.speedup >= SPEEDUP_NEEDED:
        return Precision("bf16", f"auto: native bf16 ran at {measured}", probe)
    return Precision("fp32", f"auto: {_slower(True, probe)}: bf16 ran at {measured}", probe)


def _cuda(asked: str, device: torch.device) -> Precision:
    if asked != "auto":
        return Precision(asked, f"asked for: {asked}")
    name = torch.cuda.get_device_name(device)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return Precision("bf16", f"auto: {name} has native bf16")
    return Precision("fp16", f"auto: {name} has no native bf16; fp16 with loss scaling")


def _asked_bf16(shapes: list[list[int]], source: str) -> Precision:
    """bf16 as asked; where it is slower than fp32 here, one warning with the figure and the fix."""
    native = has_native_bf16()
    probe, _ = cached_probe(shapes or [list(SCREEN)])
    if native and probe.speedup >= 1.0:
        return Precision("bf16", f"{source}: bf16", probe)
    slowdown = f"{1 / probe.speedup:.1f}x slower than fp32 here ({_slower(native, probe)})"
    message = f"{source}: bf16 runs {slowdown}; set {source} to auto (or fp32) to run at full speed"
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
    return Precision("bf16", f"{source}: bf16, {slowdown}", probe)


def _slower(native: bool, probe: Probe) -> str:
    """Why bf16 is slower than fp32 on this CPU."""
    if not native:
        return "this CPU has no native bf16"
    if probe.screen_only or probe.speedup < EMULATED:
        return f"its bf16 matmuls are emulated{_isa_cap()}"
    return f"this CPU has native bf16 but runs fp32 matmuls faster{_isa_cap()}"


def _isa_cap() -> str:
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return f", oneDNN capped by {', '.join(caps)}" if caps else ""


def has_native_bf16() -> bool:
    """The CPU lists bf16 instructions among its flags (Linux; elsewhere: False)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def probe_shapes(model: nn.Module, rows: int) -> list[list[int]]:
    """[rows, in, out] of the model's largest matmul weights (linear layers, the RNNs' input
    and recurrent weights, a tied output layer; not embedding look-ups): empty where even the
    largest has fewer than MIN_WEIGHT elements."""
    shapes: set[tuple[int, int]] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for weight in module.parameters(recurse=False):
            if weight.dim() == 2:
                out_features, in_features = weight.shape
                shapes.add((int(in_features), int(out_features)))
    largest = sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)[:PROBE_SHAPES]
    if not largest or largest[0][0] * largest[0][1] < MIN_WEIGHT:
        return []
    return [[min(rows, PROBE_ROWS), i, o] for i, o in largest]


def cached_probe(shapes: list[list[int]]) -> tuple[Probe, bool]:
    """The probe of ``shapes`` on this CPU, from the cache or run now (and cached); also
    whether it came from the cache."""
    return cached("precision", {"shapes": [list(s) for s in shapes]}, lambda: run_probe(shapes))


def cached(kind: str, facts: dict[str, Any], run: Callable[[], Probe]) -> tuple[Probe, bool]:
    """A probe of ``kind`` that depends on ``facts`` (and on this CPU, torch, the threads and
    oneDNN's cap), from the cache or ``run`` now (and cached); also whether it was cached."""
    path = cache_path(kind, facts)
    try:
        return Probe(**json.loads(path.read_text(encoding="utf-8"))), True
    except (OSError, ValueError, TypeError):
        pass  # none yet, or unreadable: probe again
    probe = run()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(probe)) + "\n")
    except OSError as exc:  # a read-only or full cache only costs a probe next time
        log.debug("cannot cache the precision probe in %s: %s", path, exc)
    return probe, False


def cache_path(kind: str, facts: dict[str, Any]) -> Path:
    """The cache file of a probe: named by everything its verdict depends on."""
    key = json.dumps(
        {
            "cpu": cpu_description(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "isa_caps": {name: os.environ.get(name) for name in ISA_CAPS},
            **facts,
        },
        sort_keys=True,
    )
    return cache_dir() / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def emulated_bf16() -> bool:
    """A screen (cached) finds this CPU's bf16 matmuls emulated: oneDNN capped below its
    native bf16, or none to begin with."""
    if not has_native_bf16():
        return True
    probe, _ = cached_probe([list(SCREEN)])
    return probe.screen_only or probe.speedup < EMULATED


def run_probe(shapes: list[list[int]]) -> Probe:
    """Time ``shapes`` in fp32 and under bf16 autocast; a screen first, so that emulated
    bf16 (hundreds of times slower) costs milliseconds, not minutes."""
    screen = [list(SCREEN)]
    fp32_s, bf16_s = _time_both(screen, repeats=3)
    if bf16_s * EMULATED > fp32_s:
        return Probe(fp32_s, bf16_s, screen, screen_only=True)
    fp32_s, bf16_s = _time_both(shapes, PROBE_REPEATS)
    return Probe(fp32_s, bf16_s, shapes, screen_only=False)


def _time_both(shapes: list[list[int]], repeats: int) -> tuple[float, float]:
    """Median seconds of forward and backward of every shape, fp32 then bf16, interleaved."""
    generator = torch.Generator().manual_seed(0)
    work = []
    for rows, in_features, out_features in shapes:
        x = torch.randn(rows, in_features, generator=generator, requires_grad=True)
        w = torch.randn(out_features, in_features, generator=generator, requires_grad=True)
        work.append((x, w, torch.randn(rows, out_features, generator=generator)))
    return time_both(_timer(work, None), _timer(work, torch.bfloat16), repeats)


def time_both(
    fp32: Callable[[], object], bf16: Callable[[], object], repeats: int, give_up: float = math.inf
) -> tuple[float, float]:
    """Median seconds of ``fp32()`` and of ``bf16()`` over ``repeats`` interleaved runs, each
    after a warm-up run (oneDNN builds its kernels on first use); cut short once bf16 takes
    ``give_up`` times fp32's time (it cannot win)."""
    fp32(), bf16()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for run, out in ((fp32, times[0]), (bf16, times[1])):
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
        if times[1][-1] > give_up * times[0][-1]:
            break
    return statistics.median(times[0]), statistics.median(times[1])


def _timer(
    work: Iterable[tuple[torch.Tensor, ...]], dtype: torch.dtype | None
) -> Callable[[], None]:
    def run() -> None:
        for x, w, grad in work:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = F.linear(x, w)
            y.backward(grad)

    return run
