"""The config schema: every key, its type, its default and a one-line description.

YAML becomes typed, frozen objects here and nowhere else. Unknown keys are errors with the
closest match; every problem in a file is reported at once, one per line, as
``model.attention.score: got 'dott', expected one of ...``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nmt.errors import ConfigError
from nmt.model.registry import DECODERS, content_scores
from nmt.model.registry import SCORES as SCORE_CLASSES

SCORES = tuple(SCORE_CLASSES)  # every name model.attention.score takes, aliases included
CONTENT_SCORES = tuple(content_scores())  # those usable as model.attention.local_score
DECODER_STYLES = tuple(DECODERS)


# Upper bounds that no model trainable with nmt reaches; a size above them is a typo.
MAX_WIDTH = 65_536  # embedding, hidden and output sizes, heads
MAX_LAYERS = 64
MAX_VOCAB = 1_000_000
MAX_LENGTH = 100_000  # sentence lengths in pieces, positions, windows


class _Section(BaseModel):
    # strict: YAML's true is not 1 and "3" is not 3; finite: .inf and .nan pass no range check
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False
    )


class DataConfig(_Section):
    """Where the parallel corpus comes from and which pairs are used for training."""

    format: Literal["text", "tsv", "jsonl", "parquet", "arrow", "disk", "hub"] = Field(
        "text",
        description="text: {prefix}.{lang} file pair; tsv; jsonl; parquet (a file or a folder "
        "of shards); arrow (a datasets Arrow file); disk (a save_to_disk folder); hub: "
        "datasets.load_dataset",
    )
    src_lang: str = Field("es", description="source language code (file suffix, JSON/hub key)")
    trg_lang: str = Field("en", description="target language code (file suffix, JSON/hub key)")
    train: str = Field(
        "data/bible/train",
        description="prefix (text), file (tsv/jsonl/parquet/arrow), folder (disk), split (hub)",
    )
    dev: str = Field("data/bible/dev", description="development set, same form as train")
    test: str | None = Field("data/bible/test", description="test set, same form as train")
    eval_splits: dict[str, str] = Field(
        {},
        description="more test sets, name: same form as train, each scored by nmt eval "
        "--split NAME (the demo's books: whole books held out of every other split)",
    )
    hub_name: str | None = Field(None, description="hub dataset name, e.g. iwslt2017")
    hub_config: str | None = Field(None, description="hub dataset config, e.g. iwslt2017-de-en")
    hub_revision: str | None = Field(
        None, description="hub dataset revision (commit, tag or branch) to pin; default: main"
    )
    cache_dir: str | None = Field(
        None,
        description="where parsed files, hub downloads and prepared corpora are kept "
        "(default: the run's cache/); share one between runs to prepare a corpus once",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        le=64,
        description="processes that tokenise (default: one per core, at most 8, for corpora "
        "of 100,000 pairs or more; else 1)",
    )
    src_field: str | None = Field(
        None, description="JSON/hub field of the source (default src_lang)"
    )
    trg_field: str | None = Field(
        None, description="JSON/hub field of the target (default trg_lang)"
    )
    max_length: int = Field(
        100, ge=1, le=MAX_LENGTH, description="drop training pairs longer than this in pieces"
    )
    dev_max_sentences: int | None = Field(
        None, ge=1, description="use only the first N dev pairs for validation BLEU"
    )
    dev_alignment: str | None = Field(
        None,
        description="reference word alignment of data.dev (Pharaoh, a line per dev pair; "
        "i-j sure, i?j possible; empty: not aligned): each validation logs the attention's "
        "dev AER, and tensorboard outlines its links on a dev heatmap",
    )
    utf8_errors: Literal["strict", "replace"] = Field(
        "strict",
        description="invalid UTF-8 in local files: strict: an error naming the line; "
        "replace: U+FFFD, with a warning counting the lines",
    )

    @model_validator(mode="after")
    def _eval_split_names(self) -> DataConfig:
        problems = []
        for name in self.eval_splits:
            if name in ("train", "dev", "test"):
                problems.append(f"eval_splits.{name}: {name} is data.{name}; rename the split")
            elif not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                problems.append(
                    f"eval_splits.{name}: a split name is letters, digits, _ and -; rename it"
                )
        if problems:  # the caller prefixes the first with "data."
            raise ValueError("; data.".join(problems))
        return self


class TokenizerConfig(_Section):
    """The sentencepiece model(s), trained on the training split unless `model` is given."""

    type: Literal["unigram", "bpe"] = Field("unigram", description="sentencepiece model type")
    vocab_size: int = Field(
        8000, ge=16, le=MAX_VOCAB, description="pieces per vocabulary (joint or each side)"
    )
    joint: bool = Field(True, description="one vocabulary for both languages")
    model: str | None = Field(None, description="existing sentencepiece .model (joint) to reuse")
    character_coverage: float = Field(1.0, gt=0, le=1, description="sentencepiece coverage")
    sampling_alpha: float | None = Field(
        None,
        gt=0,
        le=1,
        description="subword regularisation, training only, re-sampled every epoch: unigram: "
        "sampling's smoothing alpha (0.1-0.5 usual); bpe: BPE-dropout's merge-drop rate "
        "(below 1); null: off",
    )
    sampling_nbest: int = Field(
        -1,
        ge=-1,
        description="unigram sampling: sample among the n best segmentations (-1: all; 1 and 0 "
        "would not sample)",
    )
    max_train_sentences: int = Field(
        300_000,
        ge=100,
        description="sentences sampled to train sentencepiece (its memory grows with them: "
        "about 4.5 GiB per million WMT-length sentences)",
    )


class EncoderConfig(_Section):
    """The recurrent encoder over source embeddings."""

    rnn: Literal["gru", "lstm"] = Field("gru", description="recurrent cell")
    hidden_size: int = Field(256, ge=1, le=MAX_WIDTH, description="units per direction")
    layers: int = Field(1, ge=1, le=MAX_LAYERS, description="stacked layers")
    bidirectional: bool = Field(True, description="read the source both ways")
    dropout: float = Field(0.2, ge=0, lt=1, description="dropout between layers and on outputs")


class DecoderConfig(_Section):
    """The attention decoder: Bahdanau (pre-step) or Luong (post-step)."""

    style: str = Field(
        "bahdanau",
        description=f"{', '.join(DECODER_STYLES)}; bahdanau: attend from s_{{i-1}} (pre-step), "
        "luong: from h_t (post-step)",
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
        if self.style not in DECODER_STYLES:  # the caller prefixes "model.decoder."
            raise ValueError(
                f"style: got {self.style!r}, expected one of {', '.join(DECODER_STYLES)}"
            )
        return self


class AttentionConfig(_Section):
    """The score function that weighs the source positions at each target step (every variant,
    its equation and its paper: docs/models.md)."""

    score: str = Field("additive", description=f"score function: {', '.join(SCORES)}")
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
    beta: float = Field(5.0, gt=0, description="cosine: sharpening factor beta * cos(q, k)")
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
        description=f"local-m/local-p: score inside the window: {', '.join(CONTENT_SCORES)}",
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
        2.0, gt=0, description="coverage linguistic: N in the fertility N sigmoid(U_f h_j)"
    )

    @model_validator(mode="after")
    def _known_names(self) -> AttentionConfig:
        problems = []
        if self.score not in SCORES:
            problems.append(f"score: got {self.score!r}, expected one of {', '.join(SCORES)}")
        if self.local_score not in CONTENT_SCORES:
            problems.append(
                f"local_score: got {self.local_score!r}, expected one of "
                f"{', '.join(CONTENT_SCORES)} (a score of one query and one key)"
            )
        if problems:  # the caller prefixes the first with "model.attention."
            raise ValueError("; model.attention.".join(problems))
        return self


class ModelConfig(_Section):
    """Embeddings and output layer; the encoder, decoder and attention sub-sections."""

    embedding_size: int = Field(
        256, ge=1, le=MAX_WIDTH, description="source and target embedding size"
    )
    embedding_dropout: float = Field(0.2, ge=0, lt=1, description="dropout on embeddings")
    tie_embeddings: bool = Field(
        False, description="share the target embedding with the output layer"
    )
    encoder: EncoderConfig = EncoderConfig()
    decoder: DecoderConfig = DecoderConfig()
    attention: AttentionConfig = AttentionConfig()
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


class TrainingConfig(_Section):
    """Optimiser, schedule, batches, validation, precision and checkpoints."""

    optimizer: Literal["adam", "adamw"] = Field("adam", description="optimiser")
    learning_rate: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    clip_grad_norm: float | None = Field(1.0, gt=0, description="max gradient norm (null: off)")
    label_smoothing: float = Field(0.1, ge=0, lt=1, description="label smoothing epsilon")
    batch_tokens: int = Field(
        4000,
        ge=1,
        description="max padded tokens per batch (sentences x longest side); pairs are "
        "bucketed by their longer side, then source length",
    )
    guided_alignment: str | None = Field(
        None,
        description="a Pharaoh word alignment of the training pairs (a line per pair of "
        "data.train, e.g. eflomal's): a cross-entropy pulls the attention towards its links "
        "(Chen et al. 2016)",
    )
    guided_alignment_weight: float = Field(
        0.5, ge=0, description="weight of the guided-alignment cross-entropy in the loss"
    )
    accumulate: int = Field(
        1,
        ge=1,
        le=1024,
        description="batches per update (gradient accumulation): the gradients of this many "
        "batches (per rank) are summed and applied as one update on their union, "
        "normalised by all their target tokens; an epoch's last update may take fewer",
    )
    epochs: int = Field(10, ge=1, description="passes over the training data")
    max_steps: int | None = Field(None, ge=1, description="stop after this many updates")
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="stop after this wall-clock time, data preparation included, summed over "
        "every --resume of the run",
    )
    validate_every: int = Field(500, ge=1, description="updates between validations")
    log_every: int = Field(50, ge=1, description="updates between log lines")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="auto: bf16 on a GPU with native bf16, else fp16 with loss scaling; on a "
        "CPU bf16 only where it has native bf16 and a probe finds it faster, else fp32",
    )
    schedule: Literal["constant", "warmup", "inverse_sqrt", "plateau", "linear", "cosine"] = Field(
        "constant",
        description="constant; linear warmup then constant; inverse square root after "
        "warmup; halve on dev plateau; linear or cosine decay to 0 at the end of training: "
        "training.epochs, max_steps or max_minutes, whichever comes first",
    )
    decay_hold: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="linear and cosine: the fraction of the budget (epochs, max_steps or "
        "max_minutes) at the full rate before the decay begins (0: decay all the way; 0.8: "
        "the last 20%)",
    )
    warmup_steps: int = Field(
        0, ge=0, description="updates of linear warmup from 0 (before any schedule)"
    )
    plateau_patience: int = Field(2, ge=1, description="validations without improvement to halve")
    patience: int | None = Field(
        None, ge=1, description="stop after this many validations without improvement"
    )
    best_metric: Literal["bleu", "loss"] = Field(
        "bleu", description="dev metric for the best model"
    )
    keep_last: int = Field(
        1, ge=1, description="checkpoints kept besides the best (over 1: as step-N.pt files)"
    )
    save_every: int | None = Field(
        None,
        ge=1,
        description="updates between checkpoints (last.pt, and step-N.pt with keep_last over "
        "1) besides those of the validations, e.g. for nmt average (null: at validations only)",
    )
    oom_split: bool = Field(
        False,
        description="on GPU out-of-memory, retry the batch in halves (same update) instead of stopping",
    )
    seed: int = Field(1, ge=0, le=2**32 - 1, description="random seed (0 to 2^32 - 1)")
    init_from: str | None = Field(
        None,
        description="fine-tuning: start from this run directory's (best.pt) or checkpoint's "
        "weights and tokenizer; the optimiser state, learning-rate schedule, step and epoch "
        "counts, best score and random state start afresh, and the model section must build "
        "the same weight shapes",
    )
    freeze: list[Literal["embeddings", "encoder", "decoder", "attention"]] = Field(
        [],
        description="parts kept fixed in training: embeddings (source and target, and a tied "
        "output layer), encoder (with the bridge), decoder (with the output layer, without "
        "attention), attention",
    )


class DecodingConfig(_Section):
    """Search settings used by validation BLEU, `nmt translate` and `nmt eval`."""

    beam_size: int = Field(5, ge=1, description="beam width (1: greedy)")
    length_penalty: float = Field(1.0, ge=0, description="GNMT alpha in ((5+|Y|)/6)^alpha")
    max_len_ratio: float = Field(1.5, gt=0, description="max output length per source piece")
    max_len_offset: int = Field(10, ge=0, description="added to the max output length")
    batch_size: int = Field(64, ge=1, description="sentences per decoding batch")
    no_repeat_ngram: int = Field(
        0, ge=0, description="forbid repeating any n-gram of this size in an output (0: off)"
    )
    coverage_penalty: float = Field(
        0.0,
        ge=0,
        description="GNMT beta in beta * sum_i log(min(sum_j a_ij, 1)), added to a finished "
        "hypothesis's length-normalised score (0: off)",
    )
    ensemble_average: Literal["linear", "log_linear"] = Field(
        "linear",
        description="with several --model: linear averages the models' probabilities, "
        "log_linear their log-probabilities (renormalised)",
    )


class RunConfig(_Section):
    """Where the run is written and what it runs on."""

    dir: str = Field("runs/default", description="run directory (checkpoints, logs, tokenizer)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available")
    threads: int | None = Field(None, ge=1, description="CPU threads for torch (default: all)")
    fast_kernels: bool = Field(
        True,
        description="CPU training: nmt's own speed paths (nmt/fast: the RNN recurrence, "
        "dropout masks, the additive score's recomputed layer, the loss's softmax kernel) and "
        "malloc settings (false: torch's plain path, e.g. to compare). The RNN's time steps "
        "run as C kernels (nmt/fast/kernels.c) that nmt compiles with the machine's C compiler "
        "(`$CC`, else `cc`) on first use into ~/.cache/nmt (`$NMT_CACHE_DIR`); without a "
        "compiler, or with `NMT_NATIVE_KERNELS=0`, torch ops run them (environment.json's "
        "`native_kernels` says which). On glibc `nmt train` then starts itself again, before "
        "it writes anything, with glibc's tcache off "
        "(`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`, recorded in the run's "
        "environment.json): over an epoch the tcache fragments the heap (see "
        "docs/benchmarks.md). A `GLIBC_TUNABLES` of your own, even empty, is kept instead",
    )


class Config(_Section):
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    decoding: DecodingConfig = DecodingConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _compatible(self) -> Config:
        model = self.model
        dec = model.decoder
        problems = _attention_problems(model) + _bridge_problems(model)
        problems += _sampling_problems(self.tokenizer)
        if model.tie_embeddings:
            out = (
                dec.hidden_size
                if dec.style == "luong"
                else (dec.output_size or model.embedding_size)
            )
            if out != model.embedding_size:
                problems.append(
                    f"model.tie_embeddings: the output layer reads {out} units but "
                    f"model.embedding_size is {model.embedding_size}; make them equal or set "
                    f"tie_embeddings: false"
                )
        if self.data.format == "hub" and not self.data.hub_name:
            problems.append("data.hub_name: required when data.format is 'hub'")
        if len(set(self.training.freeze)) == 4 and not model.alignment_head:
            problems.append(
                "training.freeze: every part is frozen and nothing would train; leave at least "
                "one of embeddings, encoder, decoder, attention out"
            )
        if model.alignment_head_context and not model.alignment_head:
            problems.append(
                "model.alignment_head_context: there is no head to give context to; set "
                "model.alignment_head: true"
            )
        if model.alignment_head_joint and not model.alignment_head:
            problems.append(
                "model.alignment_head_joint: there is no head to train jointly; set "
                "model.alignment_head: true"
            )
        if model.alignment_head and not self.training.guided_alignment:
            problems.append(
                "model.alignment_head: the head learns only from training.guided_alignment; "
                "give that file (a Pharaoh alignment of data.train) or set alignment_head: false"
            )
        if self.training.guided_alignment and self.tokenizer.sampling_alpha is not None:
            problems.append(
                "training.guided_alignment: its links are mapped onto the one deterministic "
                "segmentation, which tokenizer.sampling_alpha replaces every epoch; use one "
                "of the two"
            )
        train = self.training
        if train.decay_hold and train.schedule not in ("linear", "cosine"):
            problems.append(
                f"training.decay_hold: only the linear and cosine schedules decay; "
                f"schedule is {train.schedule}"
            )
        if self.training.init_from and self.tokenizer.model:
            problems.append(
                "tokenizer.model: training.init_from brings its own tokenizer; remove one"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _sampling_problems(tok: TokenizerConfig) -> list[str]:
    """Subword-sampling settings that would not sample, or do not apply to the model type."""
    problems = []
    if tok.sampling_nbest in (0, 1):
        problems.append(
            f"tokenizer.sampling_nbest: {tok.sampling_nbest} would not sample; use -1 (all "
            f"segmentations) or 2 or more"
        )
    if tok.type == "bpe" and tok.sampling_alpha == 1:
        problems.append(
            "tokenizer.sampling_alpha: 1 would drop every BPE merge; BPE-dropout needs a rate "
            "below 1 (0.1 is usual)"
        )
    if tok.type == "bpe" and tok.sampling_nbest != -1:
        problems.append(
            "tokenizer.sampling_nbest: only unigram models sample among n-best segmentations; "
            "remove it for type: bpe"
        )
    return problems


def _attention_problems(model: ModelConfig) -> list[str]:
    """Score/size combinations that cannot work, each with what would; the rules each score
    class declares (nmt.model.attention.Attention's class attributes)."""
    att = model.attention
    enc_out = model.encoder.hidden_size * (2 if model.encoder.bidirectional else 1)
    dec_hidden = model.decoder.hidden_size
    outer = SCORE_CLASSES[att.score]
    key, score = ("local_score", att.local_score) if outer.windowed else ("score", att.score)
    inner = SCORE_CLASSES[score]
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
            f"model.attention.heads: {att.score!r} splits the {enc_out} key units into heads, "
            f"but {att.heads} does not divide {enc_out}; use one of "
            f"{', '.join(map(str, divisors))}"
        )
    if att.scale != "none" and not inner.scalable:
        problems.append(
            f"model.attention.scale: {att.scale!r} scales dot and general energies, not "
            f"{score!r}; set scale: none" + (" (cosine has beta)" if score == "cosine" else "")
        )
    if att.coverage != "none" and not outer.covers:
        covering = ", ".join(name for name, cls in SCORE_CLASSES.items() if cls.covers)
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


def _bridge_problems(model: ModelConfig) -> list[str]:
    """``init: final`` hands the encoder's final states to the decoder as they are."""
    enc, dec = model.encoder, model.decoder
    enc_final = enc.hidden_size * (2 if enc.bidirectional else 1)
    if dec.init != "final" or (enc_final, enc.layers) == (dec.hidden_size, dec.layers):
        return []
    return [
        f"model.decoder.init: 'final' needs the decoder ({dec.layers} layers of "
        f"{dec.hidden_size}) to match the encoder ({enc.layers} layers of {enc_final}); use "
        f"init: bridge or zeros"
    ]


def _section_fields(path: tuple[str, ...]) -> list[str]:
    """Field names valid at a dotted location, for did-you-mean suggestions."""
    model: Any = Config
    for part in path:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
        if not issubclass(model, BaseModel):
            return []
    return list(model.model_fields)


def _describe(error: Mapping[str, Any]) -> str:
    loc = tuple(str(p) for p in error["loc"])
    where = ".".join(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _section_fields(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
        return f"{where}: unknown key; {hint}"
    message = error["msg"]
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
        return message if not where else f"{'.'.join(loc)}.{message}"
    got = error.get("input")
    if isinstance(got, dict):
        return f"{where}: expected a mapping of keys; {message.lower()}"
    return f"{where}: got {got!r}; {message[0].lower()}{message[1:]}"


def _format_errors(exc: ValidationError, source: str) -> ConfigError:
    lines = [_describe(e) for e in exc.errors()]
    return ConfigError(f"{source}: " + "; ".join(lines))


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--override {override!r}: expected dotted.key=value")
    parts = key.strip().split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(
            f"--override {override!r}: {key.strip()!r} has an empty part; expected "
            f"dotted.key=value, e.g. training.epochs=3"
        )
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--override {override!r}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = parse_yaml(value) if value.strip() else None
    except (yaml.YAMLError, RecursionError):  # not YAML: the text itself
        node[parts[-1]] = value


def from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a nested dict; all problems reported in one ConfigError."""
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise _format_errors(exc, source) from None


class _Loader(yaml.SafeLoader):
    """YAML for configs: a key twice in one mapping is an error (PyYAML keeps the last), and
    numbers read as YAML 1.2 reads them (PyYAML's YAML 1.1 takes 1e-3 for a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} appears twice in one mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[no-untyped-call,no-any-return]


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """YAML text -> Python values, as configs and --override values are read."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with file and line in the error."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give the YAML config file inside it")
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; see configs/ for examples")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"{path}{line}: not valid YAML: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def load(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config file, apply ``--override`` values and validate."""
    raw = read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    if not raw:
        raise ConfigError(
            f"{path}: the config is empty; a config names at least its data (data.train, "
            f"data.dev) and its run directory (run.dir): start from configs/demo.yaml"
        )
    return from_dict(raw, str(path))


def to_yaml(config: Config) -> str:
    """The resolved config, every key included, as YAML."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    out: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in a:
                walk(a[key], b.get(key), f"{prefix}{key}.")
        elif a != b:
            out.append(prefix.rstrip("."))

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return out
