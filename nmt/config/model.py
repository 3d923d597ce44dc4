"""The model section of the config: embeddings, encoder, decoder and attention, and the rules
between their sizes and score functions.

Valid names come from the model's registry (nmt.model.registry), read when a model section is
validated (a score registered later is a valid name without an edit here), and so do the rules
each score class declares; this module only reads them. The registry is imported then, not
with this module: it imports torch, and the commands that validate no model section (help,
usage errors, ``nmt eval`` of files) start without it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

from pydantic import Field, model_validator

from nmt.config.base import MAX_LAYERS, MAX_LENGTH, MAX_WIDTH, Section


def registry() -> ModuleType:
    """nmt.model.registry: the decoders and the registered scores, with their rules."""
    from nmt.model import registry as module

    return module


class EncoderConfig(Section):
    """The recurrent encoder over source embeddings."""

    rnn: Literal["gru", "lstm"] = Field("gru", description="recurrent cell")
    hidden_size: int = Field(256, ge=1, le=MAX_WIDTH, description="units per direction")
    layers: int = Field(1, ge=1, le=MAX_LAYERS, description="stacked layers")
    bidirectional: bool = Field(True, description="read the source both ways")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout between layers and on outputs")


class DecoderConfig(Section):
    """The attention decoder: Bahdanau (pre-step) or Luong (post-step)."""

    style: str = Field(
        "bahdanau",
        description="bahdanau: attend from s_{i-1} (pre-step); luong: from h_t (post-step)",
    )
    rnn: Literal["gru", "lstm"] = Field("gru", description="recurrent cell")
    hidden_size: int = Field(256, ge=1, le=MAX_WIDTH, description="decoder state size")
    layers: int = Field(1, ge=1, le=MAX_LAYERS, description="stacked layers")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout between layers and on outputs")
    input_feeding: bool = Field(True, description="luong: feed h~_{t-1} into the next input")
    init: Literal["bridge", "final", "zeros"] = Field(
        "bridge", description="initial state: tanh(W h_enc), the encoder's final states, or zeros"
    )
    maxout: bool = Field(False, description="bahdanau: maxout (pool 2) deep output layer")
    output_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="bahdanau: size of the deep output layer (default embedding_size)",
    )

    @model_validator(mode="after")
    def _known_style(self) -> DecoderConfig:
        styles = registry().DECODERS
        if self.style not in styles:  # the caller prefixes "model.decoder."
            raise ValueError(f"style: got {self.style!r}, expected one of {', '.join(styles)}")
        return self


class AttentionConfig(Section):
    """The score function that weighs the source positions at each target step (every variant,
    its equation and its paper: docs/models.md)."""

    score: str = Field(
        "additive", description="score function, by name (docs/models.md; or a registered one)"
    )
    hidden_size: int | None = Field(
        None,
        ge=1,
        le=MAX_WIDTH,
        description="additive: MLP size; local-p: size of W_p (default decoder hidden_size)",
    )
    scale: Literal["none", "fixed", "learned"] = Field(
        "none",
        description="dot/general energies times 1, 1/sqrt(d), or a learned scalar (init 1)",
    )
    beta: float = Field(
        5.0,
        gt=0,
        le=1000,
        description="cosine: sharpening factor beta * cos(q, k) (at most 1000: fp16's range "
        "holds the energies)",
    )
    learn_beta: bool = Field(False, description="cosine: learn beta, starting from beta")
    max_source_length: int = Field(
        128,
        ge=1,
        le=MAX_LENGTH,
        description="location: source positions W_a can address; later ones get 0",
    )
    heads: int = Field(
        8, ge=1, le=MAX_WIDTH, description="multihead: heads; must divide the key size"
    )
    window: int = Field(
        10, ge=1, le=MAX_LENGTH, description="local-m/local-p: half-width D of the window"
    )
    local_score: str = Field(
        "general",
        description="local-m/local-p: score inside the window, a score of one query and one "
        "key (docs/models.md)",
    )
    coverage: Literal["none", "sum", "linguistic", "neural"] = Field(
        "none",
        description="additive: a coverage vector C fed into the score, v^T tanh(W q + U h + "
        "V C) (Tu et al. 2016): sum: C += alpha; linguistic: C += alpha / fertility; neural: "
        "a GRU of alpha, h and the query",
    )
    coverage_size: int = Field(
        10, ge=1, le=MAX_WIDTH, description="coverage neural: units d_c of the coverage GRU"
    )
    fertility_max: float = Field(
        2.0,
        gt=0,
        le=100,
        description="coverage linguistic: N in the fertility N sigmoid(U_f h_j)",
    )

    @model_validator(mode="after")
    def _known_names(self) -> AttentionConfig:
        problems = []
        scores = registry().SCORES  # as registered now
        if self.score not in scores:
            problems.append(f"score: got {self.score!r}, expected one of {', '.join(scores)}")
        content = registry().content_scores()
        if self.local_score not in content:
            problems.append(
                f"local_score: got {self.local_score!r}, expected one of "
                f"{', '.join(content)} (a score of one query and one key)"
            )
        if problems:  # the caller prefixes the first with "model.attention."
            raise ValueError("; model.attention.".join(problems))
        return self


class ModelConfig(Section):
    """Embeddings and output layer; the encoder, decoder and attention sub-sections."""

    embedding_size: int = Field(
        256, ge=1, le=MAX_WIDTH, description="source and target embedding size"
    )
    embedding_dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings")
    tie_embeddings: bool = Field(
        False, description="share the target embedding with the output layer"
    )
    # made when a config is, not at import (their checks read the registry)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    alignment_head: bool = Field(
        False,
        description="a second attention that reads each target word once it is known (its "
        "decoder features and embedding) and learns training.guided_alignment's links; nmt "
        "align, translate --alignments and the dev AER read it instead of the attention. "
        "Translations never use it and its gradients stop at its inputs",
    )
    alignment_head_joint: bool = Field(
        False,
        description="let the alignment head's loss also train the encoder, decoder and target "
        "embedding (multi-task, Garg et al. 2019): better alignments, other translations",
    )
    alignment_head_context: bool = Field(
        False,
        description="let the alignment head also read the target words after each word (a "
        "backward GRU over the target embeddings, Garg et al.'s full target context); "
        "alignments are read once the whole target is known",
    )

    def attention_problems(self) -> list[str]:
        """Score/size combinations that cannot work, each with what would; the rules each
        score class declares (nmt.model.attention.Attention's class attributes)."""
        att = self.attention
        enc_out = _encoder_units(self.encoder)
        dec_hidden = self.decoder.hidden_size
        scores = registry().SCORES
        outer = scores[att.score]
        key, score = ("local_score", att.local_score) if outer.windowed else ("score", att.score)
        inner = scores[score]
        problems = []
        if inner.equal_sizes and enc_out != dec_hidden:
            problems.append(
                f"model.attention.{key}: {score!r} needs equal query and key sizes, but the "
                f"encoder gives {enc_out} and model.decoder.hidden_size is {dec_hidden}; "
                f"set them equal or use 'general' or 'additive'"
            )
        if outer.splits_keys and enc_out % att.heads:
            divisors = [d for d in range(1, enc_out + 1) if enc_out % d == 0]
            problems.append(
                f"model.attention.heads: {att.score!r} splits the {enc_out} key units into "
                f"heads, but {att.heads} does not divide {enc_out}; use one of "
                f"{', '.join(map(str, divisors))}"
            )
        if att.scale != "none" and not inner.scalable:
            problems.append(
                f"model.attention.scale: {att.scale!r} scales dot and general energies, not "
                f"{score!r}; set scale: none" + (" (cosine has beta)" if score == "cosine" else "")
            )
        if att.coverage != "none" and not outer.covers:
            covering = ", ".join(name for name, cls in scores.items() if cls.covers)
            problems.append(
                f"model.attention.coverage: {att.coverage!r} feeds the additive score, not "
                f"{att.score!r}; use score: one of {covering}, or coverage: none"
            )
        if att.scale == "learned" and inner.prescaled:
            problems.append(
                f"model.attention.scale: {key} {score!r} already has the fixed 1/sqrt(d) "
                f"scale; for a learned one use {key}: dot with scale: learned"
            )
        return problems

    def bridge_problems(self) -> list[str]:
        """``init: final`` hands the encoder's final states to the decoder as they are."""
        enc, dec = self.encoder, self.decoder
        enc_final = _encoder_units(enc)
        if dec.init != "final" or (enc_final, enc.layers) == (dec.hidden_size, dec.layers):
            return []
        return [
            f"model.decoder.init: 'final' needs the decoder ({dec.layers} layers of "
            f"{dec.hidden_size}) to match the encoder ({enc.layers} layers of {enc_final}); use "
            f"init: bridge or zeros"
        ]

    def tying_problems(self) -> list[str]:
        """A tied output layer must read as many units as the target embedding has."""
        if not self.tie_embeddings:
            return []
        dec = self.decoder
        out = dec.hidden_size if dec.style == "luong" else (dec.output_size or self.embedding_size)
        if out == self.embedding_size:
            return []
        return [
            f"model.tie_embeddings: the output layer reads {out} units but "
            f"model.embedding_size is {self.embedding_size}; make them equal or set "
            f"tie_embeddings: false"
        ]

    def head_problems(self) -> list[str]:
        """The alignment head's options need the head."""
        problems = []
        if self.alignment_head_context and not self.alignment_head:
            problems.append(
                "model.alignment_head_context: there is no head to give context to; set "
                "model.alignment_head: true"
            )
        if self.alignment_head_joint and not self.alignment_head:
            problems.append(
                "model.alignment_head_joint: there is no head to train jointly; set "
                "model.alignment_head: true"
            )
        return problems


def _encoder_units(encoder: EncoderConfig) -> int:
    """Units of each encoder output and final state: both directions' together."""
    return encoder.hidden_size * (2 if encoder.bidirectional else 1)
