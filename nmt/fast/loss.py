"""The output layer and its label-smoothed cross-entropy over all target tokens of a batch:
the plain logits and ``F.cross_entropy`` (the reference), and nmt's fused function that never
keeps a float32 (N, V) tensor and forms the gradient at the logits in the forward pass."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.fast import compiled as compiled_kernels
from nmt.runtime import compute_dtype


def output_layer_loss(
    features: Tensor,
    weight: Tensor,
    target: Tensor,
    eps: float,
    fused: bool,
    compiled: bool,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """features (N, O), output weight W (V, O), targets (N,) -> the label-smoothed
    cross-entropy of softmax(features W^T) summed over the N rows, and the plain NLL sum (for
    perplexity, not differentiable). ``rows`` (N,) bool: the sums over these rows alone, the
    others (a static batch's padding) adding nothing to either sum or to a gradient.
    ``fused``: through ``OutputLayerLoss`` (with ``compiled``, its compiled kernel); else the
    plain logits and ``F.cross_entropy``."""
    if not fused:
        logits = F.linear(features, weight)  # (N, V), at least float32:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if rows is None:
            loss = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
            nll = F.cross_entropy(logits.detach(), target, reduction="sum")
            return loss, nll
        loss = F.cross_entropy(logits, target, label_smoothing=eps, reduction="none")
        nll = F.cross_entropy(logits.detach(), target, reduction="none")
        return (loss * rows).sum(), (nll * rows).sum()
    dtype = compute_dtype(features.device, torch.promote_types(features.dtype, weight.dtype))
    keep_grad = torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad)
    return OutputLayerLoss.apply(features, weight, target, eps, dtype, keep_grad, compiled, rows)


# Logit rows whose softmax statistics are computed at once in float32: a (rows, V) float32
# temporary of about 4 MiB, so that the passes over it stay in cache and a (B*T, V) float32
# tensor is never materialised. The output layer's matmul covers LOSS_MATMUL_CHUNKS of them.
LOSS_CHUNK_ELEMENTS = 1 << 20
LOSS_MATMUL_CHUNKS = 8
LOG2_E = math.log2(math.e)


class OutputLayerLoss(torch.autograd.Function):
    """The output layer and its label-smoothed cross-entropy summed over rows, fused with the
    gradient.

    logits = features W^T (N, V); loss = sum_n (1 - eps) * (-log p_n[y_n]) + eps * mean_v(-log
    p_n[v]), the same as ``F.cross_entropy(logits, y, label_smoothing=eps, reduction="sum")``.
    Also returns the plain NLL sum (not differentiable) for perplexity.

    The loss's gradient at the logits, G = softmax - (1 - eps) * onehot(y) - eps / V, does not
    depend on the incoming gradient g (a scalar), so forward computes it chunk by chunk in
    float32 and stores it in the logits' own buffer, in the matmul dtype (bf16 under autocast,
    as the logits were). Backward is two matmuls with no pass over (N, V): d features = g G W
    and d W = g G^T features. With ``counted`` (N,) bool, only those rows count: the others'
    terms and rows of G are zero. With ``compiled`` (CPU training), nmt.fast.compiled's kernel computes a
    whole matmul block's statistics and G in three passes instead of the chunked torch ops.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        features: Tensor,
        weight: Tensor,
        target: Tensor,
        eps: float,
        dtype: torch.dtype,
        keep_grad: bool,
        compiled: bool,
        counted: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        rows, vocab = features.size(0), weight.size(0)
        chunk = max(1, LOSS_CHUNK_ELEMENTS // vocab)
        block = chunk * LOSS_MATMUL_CHUNKS
        stats = features.new_empty(3, rows, dtype=torch.promote_types(dtype, torch.float32))
        with torch.autocast(features.device.type, enabled=False):
            x, w = features.to(dtype), weight.to(dtype)  # (N, O), (V, O)
            # G for every row when it is needed, else one block's logits at a time
            buffer = x.new_empty(rows if keep_grad else min(rows, block), vocab)  # (N, V)
            for start in range(0, rows, block):
                stop = min(rows, start + block)
                logits = buffer[start:stop] if keep_grad else buffer[: stop - start]
                torch.mm(x[start:stop], w.t(), out=logits)  # (n, V)
                compiled = compiled and compiled_kernels.softmax_xent(
                    logits, target[start:stop], stats[:, start:stop], eps, keep_grad
                )
                for first in range(start, stop, chunk) if not compiled else ():
                    last = min(stop, first + chunk)
                    _softmax_rows(
                        logits[first - start : last - start],
                        target[first:last, None],
                        stats[:, first:last],
                        eps if keep_grad else None,
                    )
            nll, smooth, p_target = stats  # (N,) each
            if keep_grad and not compiled:  # G at the targets, in float32 before the rounding
                positions = torch.arange(rows, device=x.device) * vocab + target
                at_target = p_target - (1.0 - eps) - eps / vocab
                buffer.view(-1)[positions] = at_target.to(dtype)
            if counted is not None:  # rows outside the sums: no loss, no gradient
                stats.mul_(counted)
                if keep_grad:
                    buffer.mul_(counted[:, None])
            if keep_grad:
                ctx.save_for_backward(buffer, x, w)
        ctx.dtypes = features.dtype, weight.dtype
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return ((1.0 - eps) * nll + eps * smooth).sum(), nll_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: Tensor, grad_nll: Tensor
    ) -> tuple[Tensor | None, ...]:
        grad, x, w = ctx.saved_tensors  # (N, V), (N, O), (V, O)
        grad_features = grad_weight = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_features = torch.mm(grad, w).to(ctx.dtypes[0]).mul_(grad_loss)
            if ctx.needs_input_grad[1]:
                grad_weight = torch.mm(grad.t(), x).to(ctx.dtypes[1]).mul_(grad_loss)
        return grad_features, grad_weight, None, None, None, None, None, None


def _softmax_rows(logits: Tensor, target: Tensor, stats: Tensor, eps: float | None) -> None:
    """One chunk of logits (n, V) and targets (n, 1) -> -log p[y], -mean_v log p[v] and p[y]
    into stats (3, n); with eps, also overwrites the logits with softmax - eps / V.

    The exponential is evaluated as 2^(x log2 e): torch's CPU float32 ``exp`` is several times
    slower than its ``exp2``.
    """
    z = logits.to(stats.dtype)  # (n, V); the logits themselves when already float32
    top = z.amax(-1, keepdim=True)  # (n, 1)
    mean = z.mean(-1)  # (n,)
    at_target = z.gather(1, target).squeeze(1)  # (n,)
    z.sub_(top).mul_(LOG2_E).exp2_()  # exp(logit - max)
    total = z.sum(-1, keepdim=True)  # (n, 1)
    log_z = total.log().add_(top).squeeze(1)  # log partition
    torch.sub(log_z, at_target, out=stats[0])
    torch.sub(log_z, mean, out=stats[1])
    if eps is None:
        return
    z.mul_(total.reciprocal_())  # softmax
    stats[2].copy_(z.gather(1, target).squeeze(1))
    if eps:
        z.sub_(eps / z.size(-1))
    logits.copy_(z)
