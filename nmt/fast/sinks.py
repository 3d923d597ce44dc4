"""Gradients formed once per batch for what a step-by-step decoder multiplies at every target
step in training: the attention memory's keys and values (``GradientSink`` behind
``SinkProducts``) and Luong's W_c under input feeding (``WeightSink``); on the graph-ready
unroll a GPU captures (``FastPaths.graphs``) also Bahdanau's W_q (``SinkProducts.linear``)
and the decoder RNN's W_ih and W_hh with their biases (``fast.cells.teacher_steps``).

Through plain autograd each step's product adds its own gradient to the shared tensor: a
(B, S, F) batched matmul for the memory, an (O x B)(B x I) matmul for W, each reducing over
the batch's few sentences only, and under autocast also a cast of the tensor and of each
step's gradient between float32 and the autocast dtype. Here the tensor is cast to the compute
dtype once per batch (``SinkCast``); each step's product records its other factor and its
output gradient in backward, and when the backward pass reaches the cast, the gradient is one
matmul over all recorded steps. ``Products`` is the plain path, the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from nmt.runtime import compute_dtype


class Products:
    """The attention memory's two products, by plain autograd: q K^T and alphas V."""

    def with_keys(self, query: Tensor, keys: Tensor) -> Tensor:
        """(B, T, X) @ keys^T, keys (B, S, X) -> (B, T, S)."""
        return torch.bmm(query.to(keys.dtype), keys.transpose(1, 2))

    def with_values(self, alphas: Tensor, values: Tensor) -> Tensor:
        """(B, T, S) @ values (B, S, F) -> (B, T, F)."""
        return torch.bmm(alphas.to(values.dtype), values)

    def linear(self, role: str, layer: nn.Linear, x: Tensor) -> Tensor:
        """``layer``'s product x W^T + b at a step (Bahdanau's query projection W_q);
        ``role`` names the weight among a batch's."""
        return layer(x)  # type: ignore[no-any-return]

    def attend(
        self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """A dot-product score's whole attention in one step, where these products have
        one (``nmt.fast.attend``): query (B*R, T, A), keys (B, S, A), values (B, S, F),
        mask (B, S), scale g or None (1) -> context (B*R, T, F), alphas (B*R, T, S) of
        softmax_s(g q^T k_s); None here: the score multiplies through the two products."""
        return None


PLAIN_PRODUCTS = Products()


class SinkProducts(Products):
    """The same products for the steps of one training batch, each shared tensor behind a
    ``GradientSink`` made at its first product (where it needs a gradient); with
    ``weights`` (the graph-ready unroll, ``FastPaths.graphs``), each step's ``linear`` too,
    behind a ``WeightSink`` per role."""

    def __init__(self, weights: bool = False) -> None:
        self.sinks: dict[str, GradientSink | None] = {}
        self.weights = weights
        self.weight_sinks: dict[str, WeightSink] = {}

    def linear(self, role: str, layer: nn.Linear, x: Tensor) -> Tensor:
        if not self.weights or not layer.weight.requires_grad:
            return layer(x)  # type: ignore[no-any-return]
        if role not in self.weight_sinks:
            self.weight_sinks[role] = WeightSink(layer.weight, layer.bias)
        return self.weight_sinks[role].linear(x)

    def _sink(self, role: str, tensor: Tensor) -> GradientSink | None:
        if role not in self.sinks:
            self.sinks[role] = GradientSink(tensor) if tensor.requires_grad else None
        return self.sinks[role]

    def with_keys(self, query: Tensor, keys: Tensor) -> Tensor:
        sink = self._sink("keys", keys)
        if sink is None:
            return super().with_keys(query, keys)
        return _SinkProduct.apply(query, sink.tensor, sink, True)

    def with_values(self, alphas: Tensor, values: Tensor) -> Tensor:
        sink = self._sink("values", values)
        if sink is None:
            return super().with_values(alphas, values)
        return _SinkProduct.apply(alphas, sink.tensor, sink, False)


class GradientSink:
    """A memory tensor (B, S, F) that every step multiplies with: ``tensor`` is its copy in the
    compute dtype, whose gradient is one batched matmul over the recorded steps."""

    def __init__(self, tensor: Tensor):
        self.records: list[tuple[Tensor, Tensor, bool]] = []  # (factor, gradient, transposed)
        dtype = compute_dtype(tensor.device, tensor.dtype)
        self.tensor: Tensor = SinkCast.apply(tensor, self, dtype)

    def gradient(self) -> Tensor | None:
        """sum over steps of a^T g (out = a M) or g^T a (out = a M^T): (B, S, F)."""
        total = None
        for transposed in (False, True):
            factors = [(a, g) for a, g, t in self.records if t == transposed]
            if not factors:
                continue
            a = torch.cat([f[0] for f in factors], dim=1)  # (B, T, S) or (B, T, F)
            g = torch.cat([f[1] for f in factors], dim=1)  # (B, T, F) or (B, T, S)
            part = (
                torch.bmm(g.transpose(1, 2), a) if transposed else torch.bmm(a.transpose(1, 2), g)
            )
            total = part if total is None else total + part
        self.records.clear()
        return total


class _SinkProduct(torch.autograd.Function):
    """a @ M (or a @ M^T) for M a sink's tensor: the gradient of a now, M's recorded."""

    @staticmethod
    def forward(ctx, a: Tensor, m: Tensor, sink: GradientSink, transposed: bool) -> Tensor:  # type: ignore[override]
        a_cast = a.to(m.dtype)
        ctx.save_for_backward(a_cast, m)
        ctx.sink, ctx.transposed, ctx.dtype = sink, transposed, a.dtype
        return torch.bmm(a_cast, m.transpose(1, 2) if transposed else m)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        a, m = ctx.saved_tensors
        grad = grad.to(m.dtype)
        ctx.sink.records.append((a, grad, ctx.transposed))
        grad_a = torch.bmm(grad, m if ctx.transposed else m.transpose(1, 2))
        return grad_a.to(ctx.dtype), None, None, None


class WeightSink:
    """A weight (O, I), and its bias (O,) where given, for ``linear`` at every step of one
    batch; see the module docstring. The bias is added in its own dtype (float32 under
    autocast, as the step's gates are summed), and its gradient, the sum over every
    recorded step's rows of dL/dy as it came, is formed with the weight's."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.records: list[tuple[Tensor, Tensor]] = []  # (x (N, I), dL/dy (N, O)) per step
        self.bias_records: list[Tensor] = []  # dL/dy (N, O) per step, in the output's dtype
        self.formed: dict[str, Tensor] = {}  # gradients formed, not yet taken
        dtype = compute_dtype(weight.device, weight.dtype)
        self.weight: Tensor = SinkCast.apply(weight, _Part(self, "weight"), dtype)
        self.bias: Tensor | None = None
        if bias is not None:
            self.bias = SinkCast.apply(bias, _Part(self, "bias"), bias.dtype)

    def linear(self, x: Tensor) -> Tensor:
        """x (..., I) -> x W^T (..., O) in the compute dtype; x W^T + b in b's dtype where
        the sink has a bias."""
        return _SinkLinear.apply(x, self.weight, self.bias, self)

    def gradient(self) -> Tensor | None:
        """sum over the recorded steps of dL/dy^T x: (O, I); None before any step."""
        return self.take("weight")

    def take(self, part: str) -> Tensor | None:
        """The weight's or the bias's gradient over the recorded steps, both formed at the
        first take (the backward pass reaches the two casts in either order); None before
        any step."""
        if self.records:
            inputs = torch.cat([x for x, _ in self.records])  # (T*B, I)
            grads = torch.cat([g for _, g in self.records])  # (T*B, O)
            self.formed["weight"] = grads.t() @ inputs
            if self.bias_records:
                self.formed["bias"] = torch.cat(self.bias_records).sum(0)
            self.records.clear()
            self.bias_records.clear()
        return self.formed.pop(part, None)


class _Part:
    """One of a ``WeightSink``'s two gradients, for the cast that takes it."""

    def __init__(self, sink: WeightSink, part: str):
        self.sink, self.part = sink, part

    def gradient(self) -> Tensor | None:
        return self.sink.take(self.part)


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
        ctx.sink = None  # the sink holds this node's output: free the cycle now, not at gc
        if recorded is None:
            return (grad.to(ctx.dtype) if grad is not None else None), None, None
        total = recorded.to(ctx.dtype)
        return (total + grad if grad is not None else total), None, None


class _SinkLinear(torch.autograd.Function):
    """x W^T (+ b) for W (and b) a sink's: x's gradient now, W's (and b's) recorded."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, sink: WeightSink
    ) -> Tensor:
        rows = x.reshape(-1, x.size(-1)).to(weight.dtype)  # (N, I)
        ctx.save_for_backward(rows, weight)
        ctx.sink, ctx.shape, ctx.dtype = sink, x.shape, x.dtype
        if bias is None:
            out = rows @ weight.t()
        elif bias.dtype == weight.dtype:
            out = torch.addmm(bias, rows, weight.t())  # the bias in the matmul's own pass
        else:
            out = torch.add(rows @ weight.t(), bias)  # one pass, in the bias's dtype
        return out.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        grad = grad.reshape(-1, weight.size(0))  # (N, O)
        if ctx.sink.bias is not None:
            ctx.sink.bias_records.append(grad)
        grad = grad.to(weight.dtype)
        ctx.sink.records.append((rows, grad))
        return (grad @ weight).view(ctx.shape).to(ctx.dtype), None, None, None
