"""The best tokens of each row of a step's log-probabilities, as search asks for them: the k
largest (``top_k``, beam search) and the largest (``row_max``, greedy search).

On a CPU, ``torch.topk`` and ``Tensor.max(dim)`` over a (N, V) row cost several times the
output layer's log-softmax: they copy every element with its index before they compare.
With ``native`` (the stepper's ``FastPaths.native_kernels``) a float32 CPU tensor of at
least ``NATIVE_MIN`` values goes through nmt's compiled kernel instead
(``fast.compiled.top_k``): one pass over each row that compares blocks of 64 values with the
k-th best so far at once, and looks into a block only where one of its values beats it. Its
values are the row's own, bit for bit; among equal values the first comes first, so
``row_max`` returns ``Tensor.max``'s index (``torch.topk``'s order for ties is
unspecified). A NaN is taken only where a row has fewer than k other values, not as
``torch.topk`` ranks it (highest). Elsewhere the torch ops run as they are.
"""

from __future__ import annotations

from torch import Tensor

from nmt.fast import compiled

NATIVE_MIN = 4096  # fewer values: torch's op costs less than the kernel's call (1 x 648:
# 8 against 15 us for the row maximum); the kernel from 5 x 8,000 on (21 against 50 us)


def top_k(values: Tensor, k: int, native: bool = False) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of ``values`` (N, V) and their indices, each (N, k),
    largest first."""
    if native and values.numel() >= NATIVE_MIN and (found := compiled.top_k(values, k)):
        return found
    return values.topk(k, dim=-1)


def row_max(values: Tensor, native: bool = False) -> tuple[Tensor, Tensor]:
    """The largest value of each row of ``values`` (N, V) and its first index, each (N,):
    ``values.max(dim=-1)``."""
    if native and values.numel() >= NATIVE_MIN and (found := compiled.top_k(values, 1)):
        return found[0][:, 0], found[1][:, 0]
    return values.max(dim=-1)
