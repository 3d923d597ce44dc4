"""The additive score's energies e = v^T tanh(q_t + k_s) for every (query, key) pair
(Bahdanau et al. 2015, eq. 6): the plain broadcast, and nmt's CPU training path that keeps no
(B, T, S, A) layer for the backward pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.runtime import compute_dtype


def additive_energies(q: Tensor, keys: Tensor, v: Tensor, recompute: bool) -> Tensor:
    """q = W_q q_t (B, T, A), keys = W_k k_s + b (B, S, A), v (1, A) -> energies (B, T, S);
    with ``recompute``, through ``RecomputedEnergies``."""
    if recompute:
        return RecomputedEnergies.apply(q, keys, v)
    hidden = torch.tanh(q[:, :, None, :] + keys[:, None, :, :])  # (B, T, S, A)
    return F.linear(hidden, v).squeeze(-1)  # (B, T, S)


class RecomputedEnergies(torch.autograd.Function):
    """e = v^T tanh(q + k) for every (query, key) pair, keeping only q, k and v for the
    backward pass, which recomputes the (B, T, S, A) layer: kept, that layer is a large part
    of a step-by-step decoder's peak memory (one per target step); recomputed, it costs an add
    and a sigmoid per step.

    The layer is formed as s = sigmoid(2 (q + k)), since tanh(x) = 2 sigmoid(2x) - 1 and
    torch's CPU sigmoid is several times faster than its tanh: e = (2 v)^T s - sum(v), and in
    backward 1 - tanh^2 = 4 s (1 - s), so no pass over the layer is added. Runs in the
    autocast dtype when autocast is on, like the modules it replaces."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.dtypes = (q.dtype, keys.dtype, v.dtype)  # of the gradients backward returns
        dtype = compute_dtype(q.device, v.dtype)
        q, keys, v_cast = q.to(dtype), keys.to(dtype), v.to(dtype)
        ctx.save_for_backward(q, keys, v_cast)
        with torch.autocast(q.device.type, enabled=False):
            layer = _sigmoid_layer(q, keys)  # (B, T, S, A)
            energies = torch.matmul(layer, 2 * v_cast.squeeze(0))  # (B, T, S)
            return energies.sub_(v_cast.sum())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        q, keys, v = ctx.saved_tensors
        q_dtype, keys_dtype, v_dtype = ctx.dtypes
        grad = grad.to(v.dtype)
        layer = _sigmoid_layer(q, keys)  # (B, T, S, A)
        size = layer.size(-1)
        # d e / d v = tanh = 2 s - 1
        grad_v = grad.reshape(1, -1).mm(layer.view(-1, size)).mul_(2).sub_(grad.sum())  # (1, A)
        grad_layer = grad.reshape(-1, 1).mm(4 * v).view_as(layer)  # 4 g v^T at every (t, s)
        grad_pre = torch.ops.aten.sigmoid_backward(grad_layer, layer)  # * s (1 - s)
        # a step-by-step decoder has T = 1, where sum(1) would copy the whole layer
        grad_keys = grad_pre.squeeze(1) if grad_pre.size(1) == 1 else grad_pre.sum(1)
        return grad_pre.sum(2).to(q_dtype), grad_keys.to(keys_dtype), grad_v.to(v_dtype)


def _sigmoid_layer(q: Tensor, keys: Tensor) -> Tensor:
    """sigmoid(2 (q_t + k_s)): (B, T, A), (B, S, A) -> (B, T, S, A)."""
    return torch.add(2 * q[:, :, None, :], keys[:, None, :, :], alpha=2).sigmoid_()
