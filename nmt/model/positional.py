"""Scores that place the attention by position: Luong's location score, which never looks at
the source content, and Luong's local attention, a window around a predicted or monotonic
position in which an inner content score decides."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from nmt.model.attention import Attention, Memory, masked_softmax

if TYPE_CHECKING:
    from nmt.config import AttentionConfig


class LocationAttention(Attention):
    """Luong et al. (2015), eq. 8 'location': a_t = softmax(W_a h_t), W_a with one row per
    source position up to ``max_source_length``, truncated to each sentence's length (the
    softmax runs over its real positions only). Positions at or beyond ``max_source_length``
    get no weight: the model cannot address them.
    """

    config_keys = ("max_source_length",)

    def __init__(self, query_size: int, key_size: int, max_source_length: int):
        super().__init__(query_size, key_size)
        self.max_source_length = max_source_length
        self.location_proj = nn.Linear(query_size, max_source_length, bias=False)  # W_a

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        width = memory.mask.size(1)
        energies = self.location_proj(query)  # (B, T, L)
        # L energies, then a zero for every position beyond them, cut to the S positions: one
        # path for every width, so that a traced graph (nmt export) serves every source length
        beyond = energies.new_zeros(*energies.shape[:-1], width)  # (B, T, S)
        energies = torch.cat([energies, beyond], dim=-1)[..., :width]  # (B, T, S)
        reachable = torch.arange(width, device=memory.mask.device) < self.max_source_length
        return masked_softmax(energies, memory.mask & reachable)  # (B, S) mask


class LocalAttention(Attention):
    """Luong et al. (2015), section 3.2: attend only inside the window [p_t - D, p_t + D].

    The alignment is the softmax of an inner content score over the real source positions s
    with |s - p_t| <= D (eq. 7 restricted to the window); outside it the weight is exactly 0.

    - ``local-m`` (monotonic): p_t = t, the target step, clamped to the last source word so that
      a target longer than its source keeps a non-empty window.
    - ``local-p`` (predictive): p_t = S * sigmoid(v_p^T tanh(W_p h_t)) (eq. 9), S the length of
      each sentence, and a_t(s) = align(h_t, h_s) exp(-(s - p_t)^2 / (2 sigma^2)), sigma = D/2
      (eq. 10). As in the paper the Gaussian is not renormalised: rows sum to at most 1.

    Source positions s are 0-based. The inner energies are computed for all S positions and
    masked, which is cheaper than gathering windows for the sentence lengths NMT sees.
    """

    windowed = True
    predictive: ClassVar[bool] = False

    def __init__(self, inner: Attention, query_size: int, window: int, hidden_size: int):
        super().__init__(query_size, inner.key_size)
        self.inner = inner
        self.window = window
        if self.predictive:
            self.position_proj = nn.Linear(query_size, hidden_size, bias=False)  # W_p
            self.position_v = nn.Linear(hidden_size, 1, bias=False)  # v_p

    @classmethod
    def around(cls, inner: Attention, cfg: AttentionConfig, query_size: int) -> Attention:
        """The window as configured around the content score ``inner``."""
        return cls(inner, query_size, cfg.window, cfg.hidden_size or query_size)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.inner.project_keys(values)

    def centres(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        """p_t: (B, T), in float32 (float64 for a float64 query)."""
        lengths = memory.mask.sum(dim=1)  # (B,)
        dtype = torch.promote_types(query.dtype, torch.float32)
        if self.predictive:
            logits = self.position_v(torch.tanh(self.position_proj(query))).squeeze(-1)  # (B, T)
            return lengths[:, None].to(dtype) * torch.sigmoid(logits.to(dtype))
        if positions is None:
            positions = torch.arange(query.size(1), device=query.device)
        steps = positions.to(query.device)[None, :]  # (1, T)
        return torch.minimum(steps, lengths[:, None] - 1).to(dtype)  # (B, T)

    def alignment(
        self, query: Tensor, memory: Memory, positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """-> window softmax align(h_t, h_s) (B, T, S), and s - p_t (B, T, S)."""
        centres = self.centres(query, memory, positions)  # (B, T)
        source = torch.arange(memory.mask.size(1), device=query.device)  # (S,)
        distance = source.to(centres.dtype) - centres[..., None]  # (B, T, S)
        inside = memory.mask[:, None, :] & (distance.abs() <= self.window)  # (B, T, S)
        return masked_softmax(self.inner.energies(query, memory), inside), distance

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        align, distance = self.alignment(query, memory, positions)  # (B, T, S) each
        if not self.predictive:
            return align
        sigma = self.window / 2
        return align * torch.exp(-distance.square() / (2 * sigma**2)).to(align.dtype)


class LocalMonotonicAttention(LocalAttention):
    """``local-m``: p_t = t (Luong et al. 2015, section 3.2)."""


class LocalPredictiveAttention(LocalAttention):
    """``local-p``: p_t = S sigmoid(v_p^T tanh(W_p h_t)), Gaussian-weighted (eq. 9-10)."""

    predictive = True
