"""Dropout (Srivastava et al. 2014) with a cheaper mask on the CPU.

torch's CPU dropout draws one Bernoulli sample per element, a visible part of a training
step. Here each element gets 16 random
bits instead (four per 64-bit draw of torch's generator, so seeding and checkpointed RNG
state work as before) and is kept when they reach a threshold: the drop probability is p
rounded to a multiple of 2^-16 (off by at most 7.7e-6), and kept elements are scaled by the
inverse of the exact keep probability, so the expectation is unchanged. On other devices
``F.dropout`` (a fused kernel there) runs, and ``nn.Dropout`` is the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LEVELS = 1 << 16  # random values per element


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[Tensor, float]:
    """A boolean mask of ``shape`` that is True with probability 1 - p' (p' = p rounded to
    a multiple of 2^-16), and the scale 1 / (1 - p') for kept elements."""
    dropped = round(p * LEVELS)  # values (of 65,536) that drop an element
    count = shape.numel()
    draws = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    draws.random_(-(2**63), None)  # all 64 bits uniform
    bits = draws.view(torch.int16)[:count].view(shape)  # uniform on [-32768, 32767]
    mask = bits >= dropped - LEVELS // 2
    return mask, LEVELS / (LEVELS - dropped)


class _MaskedScale(torch.autograd.Function):
    """x * mask * scale, saving only the boolean mask for the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:  # type: ignore[override]
        mask, scale = keep_mask(x.shape, p, x.device)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad.mul(mask).mul_(ctx.scale), None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p);
    16-bit masks for CPU tensors."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training)
    return _MaskedScale.apply(x, p)


class FastDropout(nn.Module):
    """Drop-in replacement for ``nn.Dropout`` (same ``p``, same train/eval behaviour)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
