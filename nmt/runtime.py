"""Seeding, device and precision choice, thread count."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from nmt.errors import ConfigError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def choose_precision(name: str, device: torch.device) -> str:
    """'auto' is bf16 on a GPU that supports it, else fp32."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ConfigError("training.precision: 'fp16' needs a CUDA device; use bf16 or fp32 on CPU")
    return name


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast context for bf16/fp16; a no-op for fp32."""
    if precision == "fp32":
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
