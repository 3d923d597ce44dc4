"""The names the config gives to score functions and decoders: one table each.

A name maps to its class; aliases map to the same class. The config schema reads these tables
(valid names and, from each class's attributes, the rules that apply to it), and
``build_attention`` / ``build_decoder`` turn a validated config into modules. A new score or
decoder is its class plus one line here (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmt.fast import FastPaths
from nmt.model.attention import Attention
from nmt.model.bahdanau import BahdanauDecoder
from nmt.model.decoder import Decoder
from nmt.model.luong import LuongDecoder
from nmt.model.multihead import MultiHeadAttention
from nmt.model.positional import (
    LocalAttention,
    LocalMonotonicAttention,
    LocalPredictiveAttention,
    LocationAttention,
)
from nmt.model.scores import (
    AdditiveAttention,
    CosineAttention,
    DotAttention,
    GeneralAttention,
    ScaledDotAttention,
)

if TYPE_CHECKING:
    from nmt.config import AttentionConfig, ModelConfig

SCORES: dict[str, type[Attention]] = {
    "additive": AdditiveAttention,
    "concat": AdditiveAttention,
    "mlp": AdditiveAttention,
    "dot": DotAttention,
    "general": GeneralAttention,
    "bilinear": GeneralAttention,
    "multiplicative": GeneralAttention,
    "scaled_dot": ScaledDotAttention,
    "cosine": CosineAttention,
    "location": LocationAttention,
    "multihead": MultiHeadAttention,
    "local-m": LocalMonotonicAttention,
    "local-p": LocalPredictiveAttention,
}

DECODERS: dict[str, type[Decoder]] = {
    "bahdanau": BahdanauDecoder,
    "luong": LuongDecoder,
}


def content_scores() -> list[str]:
    """The names of the scores of one query and one key (usable inside a local window)."""
    return [name for name, cls in SCORES.items() if cls.content]


def build_attention(
    cfg: AttentionConfig, query_size: int, key_size: int, fast: FastPaths | None = None
) -> Attention:
    """The configured score function (names validated by the config schema), with the speed
    paths ``fast`` (default: all of them)."""
    fast = fast or FastPaths()
    cls = SCORES[cfg.score]
    if issubclass(cls, LocalAttention):
        inner = SCORES[cfg.local_score].from_config(cfg, query_size, key_size, fast)
        return cls.around(inner, cfg, query_size)
    return cls.from_config(cfg, query_size, key_size, fast)


def build_decoder(
    cfg: ModelConfig, vocab_size: int, attention: Attention, fast: FastPaths
) -> Decoder:
    """The configured decoder style over the target vocabulary, attending with ``attention``."""
    return DECODERS[cfg.decoder.style](cfg, vocab_size, attention, fast)
