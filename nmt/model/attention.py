"""The attention contract: the encoder states prepared once per batch (``Memory``), the masked
softmax, and the base class every score function implements.

Every score turns queries (decoder states) and the encoder states into weights over source
positions and a context vector:

    alphas = softmax_s(score(q_t, k_s)) over real (non-padded) positions s
    context_t = sum_s alphas[t, s] * h_s

Keys are projected once per batch in ``prepare`` (not once per decoder step); ``forward``
takes any number of query steps T at once, so a decoder that does not need step-by-step
attention attends for the whole target in one batched matmul. ``positions`` are the target
step indices of the T queries (0-based); only Luong's local-m attention reads them.

The weights are computed in (at least) float32 whatever the autocast dtype, and a float64
module stays float64 end to end, so references can be checked to round-off. The score
functions themselves live in ``scores``, ``positional`` and ``multihead``; each takes its config
names by ``register_score``, into ``SCORES``, which the config validates against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from nmt.fast.sinks import PLAIN_PRODUCTS, Products

if TYPE_CHECKING:
    from nmt.config import AttentionConfig
    from nmt.fast import FastPaths


@dataclass
class Memory:
    """Encoder states prepared for attention.

    values: (B, S, Hk) encoder outputs; keys: (B, S, A) projected keys ((B, h, S, Hk/h) for
    multihead); mask: (B, S) True at real positions; projected_values: multihead's per-head
    values (B, h, S, Hk/h), else None; coverage_terms: the coverage update's terms of h_j
    alone (``nmt.model.coverage``), else None; folded: the values times a Luong decoder's
    W_c context half (B, S, H), made once for a search (``LuongDecoder.for_search``), which
    then reads no other values: ``values`` is then the same tensor; else None; products: how
    ``with_keys`` and ``with_values`` multiply, and whether a dot score attends in one step
    (``Products.attend``): ``FastPaths.step_products`` in training, ``search_products`` in
    search (``Decoder.for_search``).

    beams: the query rows per sentence (``shared``, beam search), whose memory is held once
    per sentence: the tensors above are then (B, ...) for queries of B * beams rows, sentence
    after sentence. Only a score that reads the memory through ``with_keys``,
    ``with_values`` and ``row_mask`` alone (``Attention.shares_beams``) is given one.
    """

    values: Tensor
    keys: Tensor
    mask: Tensor
    projected_values: Tensor | None = None
    coverage_terms: Tensor | None = None
    products: Products = PLAIN_PRODUCTS
    beams: int = 1
    folded: Tensor | None = None

    def with_keys(self, query: Tensor) -> Tensor:
        """q_t^T k_s for every query and key: (B, T, A) -> (B, T, S); the beams of a
        sentence in one product with its keys."""
        if self.beams == 1:
            return self.products.with_keys(query, self.keys)
        rows, steps = query.shape[:2]
        shared = query.reshape(rows // self.beams, self.beams * steps, -1)  # (B', K*T, A)
        return self.products.with_keys(shared, self.keys).reshape(rows, steps, -1)

    def with_values(self, alphas: Tensor) -> Tensor:
        """sum_s alphas[t, s] h_s: (B, T, S) -> (B, T, Hk)."""
        if self.beams == 1:
            return self.products.with_values(alphas, self.values)
        rows, steps = alphas.shape[:2]
        shared = alphas.reshape(rows // self.beams, self.beams * steps, -1)  # (B', K*T, S)
        return self.products.with_values(shared, self.values).reshape(rows, steps, -1)

    @property
    def row_mask(self) -> Tensor:
        """The mask of each query row: (B * beams, S)."""
        return self.mask if self.beams == 1 else self.mask.repeat_interleave(self.beams, 0)

    def shared(self, beams: int) -> Memory:
        """The memory of B sentences for B * beams query rows, held once (not copied)."""
        return replace(self, beams=beams)

    def for_steps(self, products: Products) -> Memory:
        """The same memory, multiplied through ``products``."""
        return replace(self, products=products)

    def index_select(self, index: Tensor) -> Memory:
        """The memory of the rows ``index`` (B',): beams in search. Shared (``beams`` > 1),
        ``index`` holds whole sentences' rows, in order (search drops whole sentences)."""
        projected, terms, folded = self.projected_values, self.coverage_terms, self.folded
        if self.beams > 1:
            index = index[:: self.beams] // self.beams  # (B'/beams,) their sentences
        values = self.values[index]
        if folded is not None:  # one copy where the folded values stand in for the values
            folded = values if folded is self.values else folded[index]
        return Memory(
            values,
            self.keys[index],
            self.mask[index],
            projected[index] if projected is not None else None,
            terms[index] if terms is not None else None,
            products=self.products,
            beams=self.beams,
            folded=folded,
        )


def wide(x: Tensor) -> Tensor:
    """x in float32, or in float64 if it already is (never narrower than float32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_softmax(energies: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis in float32 (float64 stays float64); masked positions get
    exactly zero weight.

    energies: (B, ..., S); mask: (B, S), or the full shape of ``energies``, True where real.
    The fill value is the minimum of the dtype the softmax runs in, so no mask constant can
    overflow in fp16/bf16. Every row must keep at least one real position.
    """
    energies = wide(energies)
    if mask.dim() < energies.dim():
        mask = mask.view(mask.size(0), *[1] * (energies.dim() - mask.dim()), mask.size(-1))
    energies = energies.masked_fill(~mask, torch.finfo(energies.dtype).min)
    return torch.softmax(energies, dim=-1)


class Attention(nn.Module):
    """Base class of every score function.

    A content score defines ``project_keys`` and ``energies``; the others override ``alphas``
    (location, local) or ``prepare`` and ``forward`` (multihead). ``from_config`` builds one
    from the config's ``model.attention`` section, passing the keys ``config_keys`` names. The class attributes tell the config
    schema which rules apply (nmt.config checks them all before a run starts).
    """

    content: ClassVar[bool] = False  # a score of one query and one key: usable in a local window
    equal_sizes: ClassVar[bool] = False  # a product q^T k: query and key sizes must be equal
    scalable: ClassVar[bool] = False  # model.attention.scale multiplies its energies
    prescaled: ClassVar[bool] = False  # already scaled by a fixed 1/sqrt(d)
    windowed: ClassVar[bool] = False  # Luong's local window around an inner content score
    splits_keys: ClassVar[bool] = False  # model.attention.heads must divide the key size
    covers: ClassVar[bool] = False  # model.attention.coverage feeds its energies
    # reads the memory through Memory.with_keys, with_values and row_mask alone, so beam
    # search may hold it once per sentence (Memory.shared)
    shares_beams: ClassVar[bool] = False
    # the model.attention keys the constructor takes, in order, after the two sizes
    config_keys: ClassVar[tuple[str, ...]] = ()
    # the compiled search kernel that computes this class's weights and context (None: the
    # equations as written here); "dot": softmax over the real positions of g q^T k, k the
    # projected keys (project_keys), g the learned ``scale`` or 1 (nmt.fast.attend). Each
    # class declares it for itself: a subclass that does not is given None, so one that
    # changes the math never runs its parent's kernel (__init_subclass__)
    kernel: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kernel" not in cls.__dict__:
            cls.kernel = None

    def __init__(self, query_size: int, key_size: int):
        super().__init__()
        self.query_size = query_size
        self.key_size = key_size

    @classmethod
    def from_config(
        cls, cfg: AttentionConfig, query_size: int, key_size: int, fast: FastPaths
    ) -> Attention:
        """The score as configured, for queries of ``query_size`` and keys of ``key_size``."""
        return cls(query_size, key_size, *(getattr(cfg, key) for key in cls.config_keys))

    def project_keys(self, values: Tensor) -> Tensor:
        """(B, S, Hk) -> (B, S, A); once per batch."""
        return values

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        return Memory(values, self.project_keys(values), mask)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        """(B, T, Hq) -> (B, T, S) unnormalised scores."""
        raise NotImplementedError

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        """(B, T, Hq) -> (B, T, S) float32 weights, zero at padding."""
        return masked_softmax(self.energies(query, memory), memory.row_mask)

    def forward(
        self, query: Tensor, memory: Memory, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """query: (B, T, Hq); positions: (T,) target steps or None (0..T-1)
        -> context (B, T, Hk), alphas (B, T, S) float32."""
        alphas = self.alphas(query, memory, positions)  # (B, T, S)
        return memory.with_values(alphas), alphas  # (B, T, Hk)

    def attend(
        self, query: Tensor, memory: Memory, positions: Tensor, coverage: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """What a decoder calls: ``forward``, and the coverage vector (``nmt.model.coverage``)
        carried across the T queries, one after another: query (B, T, Hq), coverage before
        the first query (B, S, d_c) or None (zeros) -> context (B, T, Hk), alphas (B, T, S),
        the coverage after the last query. A score without coverage returns None for it."""
        context, alphas = self(query, memory, positions)
        return context, alphas, None


SCORES: dict[str, type[Attention]] = {}  # model.attention.score's names (aliases too) -> class
A = TypeVar("A", bound=type[Attention])


def register_score(*names: str) -> Callable[[A], A]:
    """A class decorator: ``model.attention.score`` takes each of ``names`` for the class.
    A new score is its class, so decorated, and its test; the config validates against
    ``SCORES`` as it is when a config is read."""

    def register(cls: A) -> A:
        for name in names:
            if name in SCORES:
                raise ValueError(f"score {name!r} is already {SCORES[name].__name__}'s name")
            SCORES[name] = cls
        return cls

    return register
