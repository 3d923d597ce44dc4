"""The CPU training process's memory: oneDNN's kernel cache and glibc's malloc.

Three settings:

- oneDNN (torch's CPU matmul library) caches a compiled kernel for every matmul shape it meets,
  1,024 by default. Length-bucketed batches bring new shapes almost every step, so the cache
  grows a training run's memory; ``KERNEL_CACHE_CAPACITY`` kernels still hold the shapes a step
  meets again and again (a step-by-step decoder's), so nothing is rebuilt within a batch.
  oneDNN reads the variable when it makes its first kernel.
- glibc hands a freed block above its mmap threshold back to the system, and the next
  allocation of that size faults its pages in again, zero-filled, every batch. ``tune_allocator``
  serves every block from the heap and keeps freed heap memory for reuse.
- glibc's per-thread cache (tcache) keeps freed small chunks aside, where they cannot merge with
  the free space beside them. torch asks for 64-byte-aligned blocks, and glibc frees the bytes in
  front of each as a small chunk of its own: cached, it soon goes to a small allocation that
  may live for many steps, and the holes around it cannot join when the big block beside it is
  freed, so the heap fragments over an epoch. Without the tcache these chunks go to the fast
  bins, which are merged before the next large allocation. The tcache can only be switched off
  as a process starts, so `nmt train` on a CPU starts itself again with it off
  (``restart_with_malloc_tunables``), before it has written anything.

Each setting the user made in the environment is kept. This module imports no torch, so the
command line can use it before anything else.
"""

from __future__ import annotations

import ctypes
import os
import sys

KERNEL_CACHE_CAPACITY = "32"
KERNEL_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
MALLOC_TUNABLES = "glibc.malloc.tcache_count=0"

_MALLOC_SETTINGS = {  # mallopt's M_MMAP_THRESHOLD, M_MMAP_MAX, M_TRIM_THRESHOLD
    -3: 32 << 20,  # the threshold too, for a C library that ignores the count
    -4: 0,
    -1: (1 << 31) - 1,
}
_MALLOC_ENVIRONMENT = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)


def limit_kernel_cache() -> None:
    """Cap oneDNN's kernel cache unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault(KERNEL_CACHE_VARIABLE, KERNEL_CACHE_CAPACITY)


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # not a glibc system: the name is unknown
        return False


def wants_malloc_tunables(device_type: str, cpu_kernels: bool) -> bool:
    """Whether a training process on ``device_type`` should run with MALLOC_TUNABLES: CPU runs
    with ``run.fast_kernels`` on glibc, unless the user set GLIBC_TUNABLES (even to nothing)."""
    return device_type == "cpu" and cpu_kernels and _glibc() and "GLIBC_TUNABLES" not in os.environ


def restart_with_malloc_tunables() -> None:
    """Replace this process (same pid, arguments and environment) by a fresh start of itself
    with GLIBC_TUNABLES=MALLOC_TUNABLES. For the `nmt` command only: nothing may have been
    written or started (threads, process groups) yet."""
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]
    os.execve(sys.executable, argv, {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES})


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
