"""Coverage (Tu et al. 2016, "Modeling Coverage for Neural Machine Translation"): a vector per
source position that sums up how much attention the position has had, fed back into the
additive score so that the model can learn to attend where it has not been yet.

With C_{t-1,j} the coverage of source position j before target step t (C_0 = 0), the additive
energy becomes (Tu et al., eq. 5)

    e_{t,j} = v^T tanh(W_q q_t + W_k h_j + b + W_c C_{t-1,j})

and after the step the coverage is updated from the step's weights alpha_{t,j}:

- ``sum``:        C_{t,j} = C_{t-1,j} + alpha_{t,j}  (one unit; OpenNMT-py's coverage_attn,
                  Sockeye's "count")
- ``linguistic``: C_{t,j} = C_{t-1,j} + alpha_{t,j} / Phi_j,  Phi_j = N sigmoid(U_f h_j)
                  (eq. 6-7: each source word's fertility, at most N = fertility_max)
- ``neural``:     C_{t,j} = GRU(C_{t-1,j}, [alpha_{t,j}; h_j; q_t])  (eq. 8-9; d_c units)

q_t is the query the score read at step t: the previous decoder state s_{t-1} of a Bahdanau
decoder (Tu et al.'s t_{i-1}), the current h_t of a Luong decoder. The per-position terms that
depend on h_j alone (the fertility, the GRU's input projection of h_j) are computed once per
batch into ``Memory.coverage_terms``. Coverage is kept in float32 (float64 stays float64) and
is zero at padded positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.model.attention import Memory, wide

KINDS = ("none", "sum", "linguistic", "neural")


class Coverage(nn.Module):
    """The coverage vector's projection into the score (W_c) and its update rule."""

    def __init__(
        self,
        kind: str,
        query_size: int,
        key_size: int,
        attention_size: int,
        size: int = 10,
        fertility_max: float = 2.0,
    ):
        super().__init__()
        if kind not in KINDS[1:]:
            raise ValueError(f"coverage {kind!r}: expected one of {', '.join(KINDS[1:])}")
        self.kind = kind
        self.size = size if kind == "neural" else 1  # d_c
        self.proj = nn.Linear(self.size, attention_size, bias=False)  # W_c
        self.fertility_max = fertility_max
        if kind == "linguistic":
            self.fertility = nn.Linear(key_size, 1)  # U_f (and its bias)
        if kind == "neural":
            d = self.size
            # the GRU's input weights, split by input: alpha (a column), h_j, q_t
            self.from_alpha = nn.Parameter(torch.empty(3 * d))
            self.from_key = nn.Linear(key_size, 3 * d, bias=True)  # W_ih's h_j block, b_ih
            self.from_query = nn.Linear(query_size, 3 * d, bias=False)  # W_ih's q_t block
            self.recurrent = nn.Linear(d, 3 * d, bias=True)  # W_hh, b_hh
            nn.init.uniform_(self.from_alpha, -(d**-0.5), d**-0.5)

    def terms(self, values: Tensor) -> Tensor | None:
        """Once per batch, from the encoder states h_j (B, S, Hk): the fertility Phi_j
        (B, S, 1), the GRU's input projection of h_j (B, S, 3 d_c), or None."""
        if self.kind == "linguistic":
            return self.fertility_max * torch.sigmoid(wide(self.fertility(values)))
        if self.kind == "neural":
            return wide(self.from_key(values))
        return None

    def initial(self, memory: Memory) -> Tensor:
        """C_0 = 0: (B, S, d_c)."""
        values = memory.values
        dtype = torch.promote_types(values.dtype, torch.float32)
        return values.new_zeros(values.size(0), values.size(1), self.size, dtype=dtype)

    def keys(self, memory: Memory, coverage: Tensor) -> Tensor:
        """The additive score's keys with the coverage term: W_k h_j + b + W_c C_{t-1,j}
        (B, S, A)."""
        keys = memory.keys
        return keys + self.proj(coverage.to(keys.dtype))

    def update(self, coverage: Tensor, alphas: Tensor, query: Tensor, memory: Memory) -> Tensor:
        """C_{t-1} (B, S, d_c), alpha_t (B, S), q_t (B, Hq) -> C_t (B, S, d_c)."""
        alphas = alphas.to(coverage.dtype).unsqueeze(-1)  # (B, S, 1)
        if self.kind == "sum":
            updated = coverage + alphas
        elif self.kind == "linguistic":
            assert memory.coverage_terms is not None
            updated = coverage + alphas / memory.coverage_terms
        else:
            assert memory.coverage_terms is not None
            d = self.size
            inputs = (
                alphas * self.from_alpha.to(coverage.dtype)
                + memory.coverage_terms
                + wide(self.from_query(query)).unsqueeze(1)
            )  # (B, S, 3 d): W_ih [alpha; h_j; q_t] + b_ih
            hidden = wide(self.recurrent(coverage))
            reset = torch.sigmoid(inputs[..., :d] + hidden[..., :d])
            update = torch.sigmoid(inputs[..., d : 2 * d] + hidden[..., d : 2 * d])
            new = torch.tanh(inputs[..., 2 * d :] + reset * hidden[..., 2 * d :])
            updated = (1 - update) * new + update * coverage
        return updated * memory.mask.unsqueeze(-1).to(updated.dtype)
