"""Shared test setup: one torch thread per test process.

The suite runs on small CPUs (often two cores, with pytest-xdist using both): more threads
than cores makes OpenMP spin and tiny models run far slower, so every test process, and every
`nmt` subprocess a test starts, uses a single thread.

Every `nmt` subprocess also starts with the malloc tunables that `nmt train` on a CPU would
otherwise restart itself to get (``nmt.allocator.MALLOC_TUNABLES``): the same settings,
without a second import of torch for each training command. The restart itself is tested in
tests/fast/test_allocator.py, which clears them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from nmt.allocator import MALLOC_TUNABLES  # noqa: E402

os.environ.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)  # read by the subprocesses' glibc

# The command-line fixtures (a tiny corpus, a tiny trained run, a previous output), for every
# test module that names them.
pytest_plugins = ["clirun"]
