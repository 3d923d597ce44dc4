"""The names the config gives to score functions and decoders: one table each.

A name maps to its class; aliases map to the same class. A score class takes its names by
``register_score`` where it is written (``SCORES`` lives beside ``Attention``); importing
this module registers every shipped one. The config schema reads these tables (valid names
and, from each class's attributes, the rules that apply to it), and ``build_attention`` /
``build_decoder`` turn a validated config into modules. A new decoder is its class plus one
line here (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmt.fast import FastPaths
from nmt.model import scores  # noqa: F401  (its classes register their names)
from nmt.model.attention import SCORES, Attention, register_score
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

if TYPE_CHECKING:
    from nmt.config import AttentionConfig, ModelConfig

register_score("location")(LocationAttention)
register_score("multihead")(MultiHeadAttention)
register_score("local-m")(LocalMonotonicAttention)
register_score("local-p")(LocalPredictiveAttention)
__all__ = ["SCORES", "DECODERS", "build_attention", "build_decoder", "content_scores"]

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
