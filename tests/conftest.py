"""Shared test setup: one torch thread per test process.

The suite runs on small CPUs (often two cores, with pytest-xdist using both): more threads
than cores makes OpenMP spin and tiny models run far slower, so every test process, and every
`nmt` subprocess a test starts, uses a single thread.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# The command-line fixtures (a tiny corpus, a tiny trained run, a previous output), for every
# test module that names them.
pytest_plugins = ["clirun"]
