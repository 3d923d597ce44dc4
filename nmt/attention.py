"""Attention score functions behind one call signature.

Every module turns a query (decoder state) and the encoder states into weights over source
positions and a context vector:

    alphas = softmax_s(score(q_t, k_s)) over real (non-padded) positions s
    context_t = sum_s alphas[t, s] * h_s

Keys are projected once per batch in ``prepare`` (not once per decoder step); ``forward``
takes any number of query steps T at once, so a decoder that does not need step-by-step
attention can attend for the whole target in one batched matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt.errors import ConfigError


@dataclass
class Memory:
    """Encoder states prepared for attention.

    values: (B, S, Hk) encoder outputs; keys: (B, S, A) projected keys; mask: (B, S) True at
    real positions.
    """

    values: Tensor
    keys: Tensor
    mask: Tensor

    def index_select(self, index: Tensor) -> Memory:
        return Memory(self.values[index], self.keys[index], self.mask[index])


def masked_softmax(energies: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis in float32; masked positions get exactly zero weight.

    energies: (B, T, S); mask: (B, S) True where real. The fill value is the float32 minimum,
    so no mask constant can overflow in fp16/bf16.
    """
    energies = energies.float().masked_fill(~mask[:, None, :], torch.finfo(torch.float32).min)
    return torch.softmax(energies, dim=-1)


class Attention(nn.Module):
    """Base class: subclasses define ``project_keys`` and ``energies``."""

    def __init__(self, query_size: int, key_size: int):
        super().__init__()
        self.query_size = query_size
        self.key_size = key_size

    def project_keys(self, values: Tensor) -> Tensor:
        """(B, S, Hk) -> (B, S, A); once per batch."""
        return values

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        return Memory(values, self.project_keys(values), mask)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        """(B, T, Hq) -> (B, T, S) unnormalised scores."""
        raise NotImplementedError

    def forward(self, query: Tensor, memory: Memory) -> tuple[Tensor, Tensor]:
        """query: (B, T, Hq) -> context (B, T, Hk), alphas (B, T, S) float32."""
        alphas = masked_softmax(self.energies(query, memory), memory.mask)  # (B, T, S)
        context = torch.bmm(alphas.to(memory.values.dtype), memory.values)  # (B, T, Hk)
        return context, alphas


class AdditiveAttention(Attention):
    """Bahdanau et al. (2015), eq. 6 / appendix A.1.2: e = v^T tanh(W_q q + W_k k)."""

    def __init__(self, query_size: int, key_size: int, hidden_size: int):
        super().__init__(query_size, key_size)
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)
        self.key_proj = nn.Linear(key_size, hidden_size, bias=True)
        self.v = nn.Linear(hidden_size, 1, bias=False)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.key_proj(values)  # (B, S, A)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        q = self.query_proj(query)  # (B, T, A)
        hidden = torch.tanh(q[:, :, None, :] + memory.keys[:, None, :, :])  # (B, T, S, A)
        return self.v(hidden).squeeze(-1)  # (B, T, S)


class DotAttention(Attention):
    """Luong et al. (2015), eq. 8 'dot': e = q^T k; with ``scale`` q^T k / sqrt(d)."""

    def __init__(self, query_size: int, key_size: int, scaled: bool = False):
        super().__init__(query_size, key_size)
        self.scale = 1.0 / math.sqrt(key_size) if scaled else 1.0

    def project_keys(self, values: Tensor) -> Tensor:
        return values * self.scale if self.scale != 1.0 else values

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        return torch.bmm(query, memory.keys.transpose(1, 2))  # (B, T, S)


class GeneralAttention(Attention):
    """Luong et al. (2015), eq. 8 'general' (bilinear): e = q^T W_a k, with W_a k precomputed."""

    def __init__(self, query_size: int, key_size: int):
        super().__init__(query_size, key_size)
        self.key_proj = nn.Linear(key_size, query_size, bias=False)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.key_proj(values)  # (B, S, Hq)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        return torch.bmm(query, memory.keys.transpose(1, 2))  # (B, T, S)


def build_attention(
    score: str, query_size: int, key_size: int, hidden_size: int | None = None
) -> Attention:
    """Map a config score name to its module; list the valid names on error."""
    if score in ("additive", "concat", "mlp"):
        return AdditiveAttention(query_size, key_size, hidden_size or query_size)
    if score in ("dot", "scaled_dot"):
        if query_size != key_size:
            raise ConfigError(
                f"model.attention.score: {score!r} needs equal query ({query_size}) and key "
                f"({key_size}) sizes; use 'general' or 'additive'"
            )
        return DotAttention(query_size, key_size, scaled=score == "scaled_dot")
    if score in ("general", "bilinear", "multiplicative"):
        return GeneralAttention(query_size, key_size)
    raise ConfigError(
        f"model.attention.score: {score!r} is not available; "
        f"expected one of additive, concat, mlp, dot, scaled_dot, general, bilinear, multiplicative"
    )
