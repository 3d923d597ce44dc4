"""Where and how a process computes: devices, precision, seeding, threads, CPU facts.

Shared by training and decoding; the torchrun process group is ``nmt.training.distributed``.
"""

from __future__ import annotations

import contextlib
import platform
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from nmt.errors import ConfigError


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
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device {name!r}: expected auto, cpu or cuda")
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


def allow_tf32(device: torch.device, precision: str) -> None:
    """fp32 on a CUDA GPU: TensorFloat-32 matmuls and cuDNN RNNs (10 mantissa bits in the
    products, float32 sums), as autocast-free training on Ampere and later GPUs usually runs."""
    if device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast context for bf16/fp16; a no-op for fp32 and int8 (onnxruntime's graphs with
    int8 weights, which torch does not run)."""
    if precision in ("fp32", "int8"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


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


def _cpuinfo() -> list[str]:
    """/proc/cpuinfo's lines (Linux), else none."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is often
    empty), else what the platform module knows."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``; Linux), else none."""
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_description() -> str:
    """The CPU's model and feature flags (Linux), else the platform's machine name: what a
    binary compiled for this CPU depends on."""
    keep = [line for line in _cpuinfo() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep))) or platform.machine()
