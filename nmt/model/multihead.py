"""Multi-head attention over the encoder states (Vaswani et al. 2017)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import Tensor, nn

from nmt.model.attention import Attention, Memory, masked_softmax

if TYPE_CHECKING:
    pass


class MultiHeadAttention(Attention):
    """Vaswani et al. (2017), section 3.2.2: head_i = softmax(Q W^Q_i (K W^K_i)^T / sqrt(d_k))
    V W^V_i, output Concat(head_1..head_h) W^O; here K = V = the encoder states, Q the decoder
    state, d_k = key size / h, and W^O maps back to the key size so decoders keep their shapes.
    Keys and values are projected once per batch. The returned alphas (for plots) are the
    mean of the heads' weights; the context is not sum_s alphas h_s.
    """

    splits_keys = True
    config_keys = ("heads",)

    def __init__(self, query_size: int, key_size: int, heads: int):
        super().__init__(query_size, key_size)
        assert key_size % heads == 0, "the config schema checks that the heads divide the keys"
        self.heads = heads
        self.head_size = key_size // heads
        self.query_proj = nn.Linear(query_size, key_size, bias=False)  # W^Q_1..h stacked
        self.key_proj = nn.Linear(key_size, key_size, bias=False)  # W^K_1..h
        self.value_proj = nn.Linear(key_size, key_size, bias=False)  # W^V_1..h
        self.output_proj = nn.Linear(key_size, key_size, bias=False)  # W^O

    def _split(self, x: Tensor) -> Tensor:
        """(B, L, h*d) -> (B, h, L, d)."""
        return x.view(x.size(0), x.size(1), self.heads, self.head_size).transpose(1, 2)

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        keys = self._split(self.key_proj(values)) / math.sqrt(self.head_size)  # (B, h, S, d)
        return Memory(values, keys, mask, self._split(self.value_proj(values)))

    def forward(
        self, query: Tensor, memory: Memory, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """query: (B, T, Hq) -> context (B, T, Hk), alphas (B, T, S) mean over heads."""
        assert memory.projected_values is not None
        batch, steps = query.size(0), query.size(1)
        q = self._split(self.query_proj(query))  # (B, h, T, d)
        weights = masked_softmax(q @ memory.keys.transpose(2, 3), memory.mask)  # (B, h, T, S)
        heads = weights.to(memory.projected_values.dtype) @ memory.projected_values  # (B, h, T, d)
        concat = heads.transpose(1, 2).reshape(batch, steps, self.key_size)  # (B, T, Hk)
        return self.output_proj(concat), weights.mean(dim=1)
