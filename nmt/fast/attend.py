"""Search's attention by a dot-product score (Luong's dot and general, the scaled dot) in one
compiled kernel: the energies, the mask, the softmax and the context in one pass over each
sentence's memory (kernels.c's ``nmt_attend_f32``), where torch's two batched products, the
mask and the softmax each go through the memory or the energies again. A step of a search
attends with one query row per hypothesis, a product of tens of rows by a few dozen
positions, which a batched matmul library runs at a small part of its rate.

``KernelProducts`` is the memory's ``Products`` in a search on a CPU with the compiled
kernels (``FastPaths.search_products``); its plain products stay for what the kernel does
not take (gradients, tracing for export, other dtypes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.fast import compiled
from nmt.fast.sinks import Products


class KernelProducts(Products):
    """The plain products, and ``attend`` through the compiled kernel where it can run: no
    gradient wanted, not under a tracer, float32 contiguous CPU tensors."""

    def attend(
        self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        if not query.is_cpu or query.dim() != 3 or torch.jit.is_tracing():
            return None
        if torch.is_grad_enabled() and (
            query.requires_grad
            or keys.requires_grad
            or values.requires_grad
            or (scale is not None and scale.requires_grad)
        ):
            return None  # (before the scale is read: on a GPU that would wait on the device)
        rows, steps, width = query.shape
        found = compiled.attend(
            query.reshape(rows * steps, width),
            keys,
            values,
            mask,
            1.0 if scale is None else float(scale),
        )
        if found is None:
            return None
        context, alphas = found
        return context.view(rows, steps, -1), alphas.view(rows, steps, -1)


KERNEL_PRODUCTS = KernelProducts()
