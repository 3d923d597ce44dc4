"""Seeding, device and precision choice, thread count, and the distributed process group.

Under ``torchrun`` every process finds WORLD_SIZE, RANK and LOCAL_RANK in its environment;
``init_distributed`` joins the process group (NCCL on CUDA, gloo on CPU) and picks the GPU of
the local rank. Without them training is a single process and no process group exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from nmt import ONEDNN_CACHE_CAPACITY
from nmt.errors import ConfigError

# oneDNN (the CPU matmul library) caches a compiled kernel for every matmul shape it meets,
# 1,024 by default. Length-bucketed batches bring new shapes almost every step, and the cache
# grew a CPU training run's memory by 0.4-1 GiB (docs/benchmarks.md). 32 kernels hold the
# shapes that a step meets again and again, so step-by-step decoders do not rebuild kernels
# within a batch (a cache of 8 once cost them ~12% of their speed), and hold 0.1-0.2 GiB less
# than 64 after an epoch's first 120 steps; it is read when the first kernel is made.


def limit_kernel_cache() -> None:
    """Cap oneDNN's kernel cache unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)


# nmt's own CPU paths in training: the recurrence (nmt.rnn), dropout (nmt.dropout), the additive
# score's recomputed layer (nmt.attention) and the malloc settings below. On by default;
# ``run.fast_kernels: false`` runs torch's nn.GRU/nn.LSTM (packed), nn.Dropout and plain
# autograd instead, which the benchmark uses for its before/after figures. GPUs always use
# torch's (cuDNN RNNs, fused dropout).
_fast_kernels = True


def set_fast_kernels(enabled: bool) -> None:
    global _fast_kernels
    _fast_kernels = enabled


def fast_kernels(device: torch.device) -> bool:
    """Whether nmt's CPU kernels run for tensors on ``device``: in training only, since
    their gain is in the backward pass, and torch's RNN loop (in C++) is quicker for the few
    sentences of a search batch."""
    return _fast_kernels and device.type == "cpu" and torch.is_grad_enabled()


# glibc's per-thread cache (tcache) keeps up to 7 freed chunks of each small size aside, where
# they cannot merge with the free space beside them. torch asks for 64-byte-aligned blocks
# (posix_memalign), and glibc frees the bytes in front of each aligned block as a small chunk
# of its own: cached, it soon goes to a small allocation that may live for many steps, and
# when the big block beside it is freed, the two holes around that small chunk cannot join.
# Over an epoch the heap fragments: in `luong-nofeed` training the live memory stayed at 0.6
# GiB between steps, while the free memory held in the heap grew to 1.3 GiB in 180 steps.
# Without the tcache these chunks go to glibc's fast bins, which are merged back before the
# next large allocation: over 243 steps the benchmark's configs peak at 1.43-1.76 GiB RSS
# instead of 2.13-2.49, at the same speed within the noise (docs/benchmarks.md). The tcache
# can only be switched off as a process starts, so `nmt train` on a CPU starts itself again
# with it off, before it has written anything.
MALLOC_TUNABLES = "glibc.malloc.tcache_count=0"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is often
    empty), else what the platform module knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # not a glibc system: the name is unknown
        return False


def wants_malloc_tunables(device: torch.device, fast: bool) -> bool:
    """Whether a training process on ``device`` should run with MALLOC_TUNABLES: CPU runs with
    ``run.fast_kernels`` on glibc, unless the user set GLIBC_TUNABLES (even to nothing)."""
    return device.type == "cpu" and fast and _glibc() and "GLIBC_TUNABLES" not in os.environ


def restart_with_malloc_tunables() -> None:
    """Replace this process (same pid, arguments and environment) by a fresh start of itself
    with GLIBC_TUNABLES=MALLOC_TUNABLES. For the `nmt` command only: nothing may have been
    written or started (threads, process groups) yet."""
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES})


# glibc's malloc hands a freed block above its mmap threshold (128 KiB at first, raised up to
# 32 MiB as blocks are freed) back to the system, and the next allocation of that size faults
# its pages in again, zero-filled: 21,000-26,000 page faults per Luong (input feeding) training
# step at the benchmark sizes. Serving every block from the heap (no mmap; the threshold is
# set too, for a C library that ignores the count) and keeping freed heap memory for reuse cut
# that to about 4,400 and made the step-by-step decoders' steps 3-10% faster at the same peak
# RSS; the RNN's buffers of over 32 MiB, mapped afresh each batch, had cost another 2-3%
# (docs/benchmarks.md).
_MALLOC_SETTINGS = {  # M_MMAP_THRESHOLD, M_MMAP_MAX, M_TRIM_THRESHOLD
    -3: 32 << 20,
    -4: 0,
    -1: (1 << 31) - 1,
}
_MALLOC_ENVIRONMENT = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)


def _users_malloc_settings() -> bool:
    """Whether the user set malloc's thresholds in the environment; nmt's own GLIBC_TUNABLES
    (MALLOC_TUNABLES, set by its restart) is not the user's."""
    own = os.environ.get("GLIBC_TUNABLES") == MALLOC_TUNABLES
    return any(k in os.environ for k in _MALLOC_ENVIRONMENT if not (own and k == "GLIBC_TUNABLES"))


def tune_allocator() -> bool:
    """Apply the malloc settings above (CPU training, glibc on Linux); False where they do
    not apply: another platform, or the user set malloc's thresholds in the environment."""
    if not sys.platform.startswith("linux") or _users_malloc_settings():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already uses
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = True
    for option, value in _MALLOC_SETTINGS.items():
        applied = mallopt(option, value) == 1 and applied  # 1: taken (glibc's convention)
    return applied


def choose_fast_paths(enabled: bool, device: torch.device) -> None:
    """``run.fast_kernels`` for a run on ``device``: nmt's CPU kernels on or off, and on a CPU
    with them on, the malloc settings too (``nmt train`` and the benchmark)."""
    set_fast_kernels(enabled)
    if enabled and device.type == "cpu":
        tune_allocator()


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in: autocast's on ``device`` when it is on, else ``dtype``."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def choose_device(name: str, local_rank: int = 0) -> torch.device:
    """The device to train on; under torchrun each local rank takes its own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: 'cuda' was asked for but no CUDA device is available")
    if name == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"run.device: local rank {local_rank} needs GPU {local_rank} but only "
                f"{torch.cuda.device_count()} are visible; lower torchrun --nproc-per-node"
            )
        return torch.device("cuda", local_rank)
    return torch.device(name)


def choose_precision(name: str, device: torch.device) -> str:
    """'auto' is bf16 on a GPU that supports it, else fp32. fp16 works on CPU too (slowly)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    return name


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast context for bf16/fp16; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device, init_scale: float) -> Any:
    """A GradScaler on the run's device type for fp16; None for fp32 and bf16."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=init_scale)


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Switch to eval mode for the block and restore the previous mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # this process created the process group and destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ConfigError(f"environment: {name}={value!r} is not an integer") from None


def init_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group if there is one; returns (place, device)."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    device = choose_device(device_name, local_rank if world_size > 1 else 0)
    if world_size == 1:
        return Distributed(), device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = not torch_dist.is_initialized()
    if owns:
        if not torch_dist.is_available():
            raise ConfigError("torchrun: this build of torch has no torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend, rank=rank, world_size=world_size)
    return Distributed(rank, local_rank, world_size, owns), device


def shutdown_distributed(place: Distributed, wait_for_all: bool = False) -> None:
    """Leave the process group. After a normal end every rank first waits for the others:
    a rank that tears down its connections while rank 0 still writes the last checkpoint can
    abort the job (gloo's threads are destroyed while still joinable)."""
    if place.owns_group and torch_dist.is_initialized():
        if wait_for_all:
            torch_dist.barrier()
        torch_dist.destroy_process_group()


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all ranks; every rank gets the same result."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(
        tensor, torch_dist.ReduceOp.MAX if op == "max" else torch_dist.ReduceOp.SUM
    )
    return tensor.tolist()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable object, on every rank."""
    holder = [obj]
    torch_dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(obj: Any, place: Distributed) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank."""
    if not place.enabled:
        return [obj]
    out: list[Any] = [None] * place.world_size
    torch_dist.all_gather_object(out, obj)
    return out
