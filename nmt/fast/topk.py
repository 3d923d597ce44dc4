"""The best tokens of each row of a step's log-probabilities, as search asks for them: the k
largest (``top_k``, beam search) and the largest (``row_max``, greedy search).

On a CPU, ``torch.topk`` and ``Tensor.max(dim)`` over a (N, V) row cost several times the
output layer's log-softmax: they copy every element with its index before they compare.
The CPU path reads each row once in chunks of ``CHUNK`` values, keeping only each chunk's
maximum (a vectorised ``amax``), and looks at the elements of the k best chunks alone:
every one of the row's k largest values lies in one of them (a chunk with k chunks above it
has k larger values outside it). The values are the row's own, bit for bit; among equal
values the indices may differ from ``torch.topk``'s, whose order for ties is unspecified.
``row_max`` returns what ``Tensor.max(dim=-1)`` returns, ties included (the first maximum:
the first chunk that holds it, and its first place there). Elsewhere (a GPU) the torch ops
run as they are, and so they do for a few rows (``MIN_ROWS``).

With ``native`` (the stepper's ``FastPaths.native_kernels``) a float32 CPU tensor of at
least ``NATIVE_MIN`` values goes through nmt's compiled kernel instead
(``fast.compiled.top_k``): one pass over each row that compares blocks of 64 values with the
k-th best so far at once, and looks into a block only where one of its values beats it. Its values are the row's own too; among equal values the
first comes first, so ``row_max`` still returns ``Tensor.max``'s index. A NaN is taken only
where a row has fewer than k other values, not as ``torch.topk`` ranks it (highest).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmt.fast import compiled

CHUNK = 64  # values per chunk: amax over them vectorises, and a row of 8,000 has 125
MIN_ROWS = 16  # fewer rows: the torch op's one call costs less than the chunked path's five
NATIVE_MIN = 4096  # fewer values: torch's op costs less than the kernel's call (1 x 648:
# 8 against 15 us for the row maximum); the kernel from 5 x 8,000 on (21 against 50 us)


def top_k(values: Tensor, k: int, native: bool = False) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of ``values`` (N, V) and their indices, each (N, k),
    largest first."""
    if native and values.numel() >= NATIVE_MIN and (found := compiled.top_k(values, k)):
        return found
    rows, width = values.shape
    full = width // CHUNK * CHUNK  # the chunked part; the rest (under CHUNK) joins as it is
    if values.device.type != "cpu" or rows < MIN_ROWS or full // CHUNK < k:
        return values.topk(k, dim=-1)
    chunks = values[:, :full].view(rows, -1, CHUNK)  # (N, V/C, C)
    best = chunks.amax(dim=-1).topk(k, dim=-1).indices  # (N, k) the k best chunks
    picked = chunks.gather(1, best.unsqueeze(-1).expand(rows, k, CHUNK))  # (N, k, C)
    candidates = torch.cat([picked.view(rows, k * CHUNK), values[:, full:]], dim=1)
    top, place = candidates.topk(k, dim=-1)  # (N, k)
    inside = place < k * CHUNK
    chunked = best.gather(1, (place // CHUNK).clamp(max=k - 1)) * CHUNK + place % CHUNK
    return top, torch.where(inside, chunked, full + place - k * CHUNK)


def row_max(values: Tensor, native: bool = False) -> tuple[Tensor, Tensor]:
    """The largest value of each row of ``values`` (N, V) and its first index, each (N,):
    ``values.max(dim=-1)``."""
    if native and values.numel() >= NATIVE_MIN and (found := compiled.top_k(values, 1)):
        return found[0][:, 0], found[1][:, 0]
    rows, width = values.shape
    if values.device.type != "cpu" or rows < MIN_ROWS or width % CHUNK:
        return values.max(dim=-1)
    chunks = values.view(rows, -1, CHUNK)  # (N, V/C, C)
    chunk = chunks.amax(dim=-1).argmax(dim=-1)  # (N,) the first chunk holding the maximum
    top, inside = chunks[torch.arange(rows, device=values.device), chunk].max(dim=-1)
    return top, chunk * CHUNK + inside
