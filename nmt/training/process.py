"""The training process's settings, made once before it trains: oneDNN's kernel cache, glibc's
malloc (``nmt.allocator`` says why) and torch's threads. ``nmt train`` and
scripts/bench.py's training processes both start here."""

from __future__ import annotations

import os

from nmt import allocator
from nmt.config import Config
from nmt.runtime import choose_device, set_threads


def setup_process(config: Config, restart: bool = False) -> None:
    """Cap oneDNN's kernel cache, set torch's threads (``run.threads``) and, for CPU training
    with ``run.fast_kernels``, malloc's settings.

    With ``restart`` (a process that has written nothing and started nothing yet: the `nmt`
    command, a benchmark's training subprocess) such a process first starts itself again
    with glibc's tcache off, which can only be set as a process starts.
    """
    allocator.limit_kernel_cache()
    device = choose_device(config.run.device, int(os.environ.get("LOCAL_RANK", "0")))
    if restart and allocator.wants_malloc_tunables(device.type, config.run.fast_kernels):
        allocator.restart_with_malloc_tunables()
    set_threads(config.run.threads)
    if config.run.fast_kernels and device.type == "cpu":
        allocator.tune_allocator()
