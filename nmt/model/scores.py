"""Content scores: the energy of one query q (a decoder state) and one key k (an encoder state).

Each reads as its paper's equation and takes its config names by ``register_score``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from nmt.fast import FastPaths
from nmt.model.attention import Attention, Memory, masked_softmax, register_score, wide
from nmt.model.coverage import Coverage

if TYPE_CHECKING:
    from nmt.config import AttentionConfig


@register_score("additive", "concat", "mlp")
class AdditiveAttention(Attention):
    """Bahdanau et al. (2015), eq. 6 / appendix A.1.2: e = v^T tanh(W_q q + W_k k + b); Luong
    et al. (2015), eq. 8 'concat'. With ``coverage`` (Tu et al. 2016, eq. 5), the term
    W_c C_{t-1,j} joins the sum inside tanh and the queries are attended one after another
    (``nmt.model.coverage``)."""

    content = covers = True

    def __init__(
        self,
        query_size: int,
        key_size: int,
        hidden_size: int,
        fast: FastPaths,
        coverage: Coverage | None = None,
    ):
        super().__init__(query_size, key_size)
        self.fast = fast
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)  # W_q
        self.key_proj = nn.Linear(key_size, hidden_size, bias=True)  # W_k, b
        self.v = nn.Linear(hidden_size, 1, bias=False)
        self.coverage = coverage  # registered last: its weights come last in the state dict

    @classmethod
    def from_config(
        cls, cfg: AttentionConfig, query_size: int, key_size: int, fast: FastPaths
    ) -> Attention:
        hidden_size = cfg.hidden_size or query_size  # A
        coverage = None
        if cfg.coverage != "none":  # drawn before W_q, W_k and v
            sizes = (query_size, key_size, hidden_size, cfg.coverage_size)
            coverage = Coverage(cfg.coverage, *sizes, cfg.fertility_max)
        return cls(query_size, key_size, hidden_size, fast, coverage)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.key_proj(values)  # (B, S, A)

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        memory = super().prepare(values, mask)
        if self.coverage is None:
            return memory
        return replace(memory, coverage_terms=self.coverage.terms(values))

    def energies(self, query: Tensor, memory: Memory, keys: Tensor | None = None) -> Tensor:
        q = memory.products.linear("query", self.query_proj, query)  # (B, T, A)
        keys = memory.keys if keys is None else keys
        # v^T tanh(q_t + k_s) for every pair: (B, T, S)
        return self.fast.additive_energies(q, keys, self.v.weight, self.training)

    def attend(
        self, query: Tensor, memory: Memory, positions: Tensor, coverage: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.coverage is None:
            return super().attend(query, memory, positions, coverage)
        if coverage is None:
            coverage = self.coverage.initial(memory)  # C_0 = 0
        steps = []
        for t in range(query.size(1)):
            q = query[:, t : t + 1]  # (B, 1, Hq)
            keys = self.coverage.keys(memory, coverage)  # W_k h_j + b + W_c C_{t-1,j}
            alphas = masked_softmax(self.energies(q, memory, keys), memory.mask)  # (B, 1, S)
            coverage = self.coverage.update(coverage, alphas.squeeze(1), q.squeeze(1), memory)
            steps.append(alphas)
        alphas = torch.cat(steps, dim=1)  # (B, T, S)
        return memory.with_values(alphas), alphas, coverage


def _scale(kind: str, size: int) -> tuple[float, nn.Parameter | None]:
    """``model.attention.scale``: the fixed factor (1 or 1/sqrt(size)) and the learned scalar
    (initialised to 1, as Keras' ``use_scale``) or None."""
    fixed = 1.0 / math.sqrt(size) if kind == "fixed" else 1.0
    return fixed, (nn.Parameter(torch.ones(())) if kind == "learned" else None)


@register_score("dot")
class DotAttention(Attention):
    """Luong et al. (2015), eq. 8 'dot': e = g q^T k.

    ``scale``: none (g = 1); fixed (g = 1/sqrt(d), Vaswani et al. 2017, eq. 1); learned (a
    scalar g initialised to 1). A fixed scale is folded into the keys once per batch.
    """

    content = equal_sizes = scalable = shares_beams = True
    config_keys: ClassVar[tuple[str, ...]] = ("scale",)
    kernel = "dot"

    def __init__(self, query_size: int, key_size: int, scale: str = "none"):
        super().__init__(query_size, key_size)
        self.fixed_scale, self.scale = _scale(scale, query_size)

    def project_keys(self, values: Tensor) -> Tensor:
        return values * self.fixed_scale if self.fixed_scale != 1.0 else values

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        energies = memory.with_keys(query)  # (B, T, S)
        return energies * self.scale if self.scale is not None else energies

    def forward(
        self, query: Tensor, memory: Memory, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``Attention.forward``; in one compiled step where the class declares the dot
        kernel and the memory's products have it (a search on a CPU: ``nmt.fast.attend``)."""
        if self.kernel == "dot":
            products = memory.products
            fused = products.attend(query, memory.keys, memory.values, memory.mask, self.scale)
            if fused is not None:
                return fused
        return super().forward(query, memory, positions)


@register_score("general", "bilinear", "multiplicative")
class GeneralAttention(DotAttention):
    """Luong et al. (2015), eq. 8 'general' (bilinear): e = g q^T W_a k, the dot score of the
    keys W_a k, precomputed.

    ``scale`` as for :class:`DotAttention`, with d the query size.
    """

    equal_sizes = False
    kernel = "dot"  # of the keys W_a k

    def __init__(self, query_size: int, key_size: int, scale: str = "none"):
        super().__init__(query_size, key_size, scale)
        self.key_proj = nn.Linear(key_size, query_size, bias=False)  # W_a

    def project_keys(self, values: Tensor) -> Tensor:
        return super().project_keys(self.key_proj(values))  # (B, S, Hq)


@register_score("scaled_dot")
class ScaledDotAttention(DotAttention):
    """Vaswani et al. (2017), eq. 1: e = q^T k / sqrt(d), d the query size."""

    prescaled = True
    config_keys = ()
    kernel = "dot"  # the fixed scale is in the keys

    def __init__(self, query_size: int, key_size: int):
        super().__init__(query_size, key_size, "fixed")


def _unit(x: Tensor, eps: float) -> Tensor:
    """x / max(||x||, eps) along the last axis, the norm in float32 (fp16 would underflow)."""
    w = wide(x)
    return (w / torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp(min=eps)).to(x.dtype)


@register_score("cosine")
class CosineAttention(Attention):
    """Content-based addressing of Neural Turing Machines (Graves et al. 2014, eq. 5-6):
    e = beta * cos(q, k) = beta * q^T k / (||q|| ||k||), each norm clamped below at ``eps``
    so that a zero vector scores 0 instead of NaN.

    cos is bounded by 1, so beta sets how peaked the weights can get; it is fixed or, with
    ``learn_beta``, a scalar parameter initialised to ``beta``. Keys are normalised once per
    batch.
    """

    content = equal_sizes = shares_beams = True
    config_keys = ("beta", "learn_beta")

    def __init__(
        self,
        query_size: int,
        key_size: int,
        beta: float = 5.0,
        learn_beta: bool = False,
        eps: float = 1e-8,
    ):
        super().__init__(query_size, key_size)
        self.beta: Tensor | float = nn.Parameter(torch.tensor(float(beta))) if learn_beta else beta
        self.eps = eps

    def project_keys(self, values: Tensor) -> Tensor:
        return _unit(values, self.eps)  # (B, S, Hk) unit rows

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        return self.beta * memory.with_keys(_unit(query, self.eps))  # (B, T, S)
