"""Weight gradients formed once per batch for the layers a step-by-step decoder applies at
every target step (Luong's W_c under input feeding).

Through plain autograd each step's product x_t W^T adds its own (O x B)(B x I) matmul to W's
gradient, a matmul that reduces over the batch's few sentences only, and an accumulation. A
``WeightSink`` holds W cast to the compute dtype once per batch; each step's product records its
input and output gradient in backward, and when the backward pass reaches the cast, W's gradient
is one (O x T*B)(T*B x I) matmul over all recorded steps. (``nmt.attention.GradientSink`` does
the same for the attention memory.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmt.runtime import compute_dtype


class WeightSink:
    """A weight (O, I) for ``linear`` at every step of one batch; see the module docstring."""

    def __init__(self, weight: Tensor):
        self.records: list[tuple[Tensor, Tensor]] = []  # (x (N, I), dL/dy (N, O)) per step
        dtype = compute_dtype(weight.device, weight.dtype)
        self.weight: Tensor = SinkCast.apply(weight, self, dtype)

    def linear(self, x: Tensor) -> Tensor:
        """x (..., I) -> x W^T (..., O) in the compute dtype."""
        return _SinkLinear.apply(x, self.weight, self)

    def gradient(self) -> Tensor | None:
        """sum over the recorded steps of dL/dy^T x: (O, I); None before any step."""
        if not self.records:
            return None
        inputs = torch.cat([x for x, _ in self.records])  # (T*B, I)
        grads = torch.cat([g for _, g in self.records])  # (T*B, O)
        self.records.clear()
        return grads.t() @ inputs


class SinkCast(torch.autograd.Function):
    """A sink's tensor: a contiguous copy in the compute dtype, made once per batch, whose
    gradient is the sink's recorded one (``sink.gradient()``) plus any from elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, sink: Any, dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.sink, ctx.dtype = sink, tensor.dtype
        return tensor.to(dtype, memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        recorded = ctx.sink.gradient()
        if recorded is None:
            return (grad.to(ctx.dtype) if grad is not None else None), None, None
        total = recorded.to(ctx.dtype)
        return (total + grad if grad is not None else total), None, None


class _SinkLinear(torch.autograd.Function):
    """x W^T for W a sink's weight: x's gradient now, W's recorded."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, sink: WeightSink) -> Tensor:  # type: ignore[override]
        rows = x.reshape(-1, x.size(-1)).to(weight.dtype)  # (N, I)
        ctx.save_for_backward(rows, weight)
        ctx.sink, ctx.shape, ctx.dtype = sink, x.shape, x.dtype
        return (rows @ weight.t()).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        grad = grad.reshape(-1, weight.size(0)).to(weight.dtype)  # (N, O)
        ctx.sink.records.append((rows, grad))
        return (grad @ weight).view(ctx.shape).to(ctx.dtype), None, None
