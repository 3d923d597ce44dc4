"""The config's sections besides the model's, and ``Config``, the whole of them.

Each section checks its own keys. A rule between keys is a method of the section whose keys it
reads, or of ``Config`` where it reads several; ``Config`` runs them all, in one order, and
reports every problem at once.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from nmt.config.base import (
    MAX_BEAM,
    MAX_COUNT,
    MAX_DECODING_BATCH,
    MAX_LEN_RATIO,
    MAX_LENGTH,
    MAX_NBEST_SAMPLES,
    MAX_VOCAB,
    Section,
)
from nmt.config.model import ModelConfig


class DataConfig(Section):
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
        None, ge=1, le=MAX_COUNT, description="use only the first N dev pairs for validation BLEU"
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

    def source_problems(self) -> list[str]:
        """A hub corpus needs its name (checked with the others, at the end)."""
        if self.format == "hub" and not self.hub_name:
            return ["data.hub_name: required when data.format is 'hub'"]
        return []


class TokenizerConfig(Section):
    """The sentencepiece model(s), trained on the training split unless `model` is given."""

    type: Literal["unigram", "bpe"] = Field("unigram", description="sentencepiece model type")
    vocab_size: int = Field(
        8000, ge=16, le=MAX_VOCAB, description="pieces per vocabulary (joint or each side)"
    )
    joint: bool = Field(True, description="one vocabulary for both languages")
    model: str | None = Field(None, description="existing sentencepiece .model (joint) to reuse")
    character_coverage: float = Field(
        1.0,
        ge=0.98,
        le=1,
        description="sentencepiece's share of the training characters that the vocabulary "
        "covers; the rarest others become <unk> (sentencepiece takes 0.98 to 1)",
    )
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
        le=MAX_NBEST_SAMPLES,
        description="unigram sampling: sample among the n best segmentations (-1: all; 1 and 0 "
        "would not sample; at most 512, sentencepiece's limit)",
    )
    max_train_sentences: int = Field(
        300_000,
        ge=100,
        le=MAX_COUNT,
        description="sentences sampled to train sentencepiece (its memory grows with them: "
        "docs/guide/data.md)",
    )

    def sampling_problems(self) -> list[str]:
        """Subword-sampling settings that would not sample, or do not apply to the model type."""
        problems = []
        if self.sampling_nbest in (0, 1):
            problems.append(
                f"tokenizer.sampling_nbest: {self.sampling_nbest} would not sample; use -1 (all "
                f"segmentations) or 2 or more"
            )
        if self.type == "bpe" and self.sampling_alpha == 1:
            problems.append(
                "tokenizer.sampling_alpha: 1 would drop every BPE merge; BPE-dropout needs a "
                "rate below 1 (0.1 is usual)"
            )
        if self.type == "bpe" and self.sampling_nbest != -1:
            problems.append(
                "tokenizer.sampling_nbest: only unigram models sample among n-best "
                "segmentations; remove it for type: bpe"
            )
        return problems


class TrainingConfig(Section):
    """Optimiser, schedule, batches, validation, precision and checkpoints."""

    optimizer: Literal["adam", "adamw"] = Field("adam", description="optimiser")
    learning_rate: float = Field(1e-3, gt=0, le=10, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, le=10, description="weight decay")
    clip_grad_norm: float | None = Field(1.0, gt=0, description="max gradient norm (null: off)")
    label_smoothing: float = Field(0.1, ge=0, lt=1, description="label smoothing epsilon")
    batch_tokens: int = Field(
        4000,
        ge=1,
        le=MAX_COUNT,
        description="max padded tokens per batch (sentences x longest side); pairs are "
        "bucketed by their longer side, then source length",
    )
    lr_reference_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="the padded tokens per update (batch_tokens x accumulate x processes) "
        "that learning_rate was chosen for: with more or fewer, the peak rate is scaled by "
        "the square root of the ratio (Adam's square-root rule; null: learning_rate as "
        "given)",
    )
    guided_alignment: str | None = Field(
        None,
        description="a Pharaoh word alignment of the training pairs (a line per pair of "
        "data.train, e.g. eflomal's): a cross-entropy pulls the attention towards its links "
        "(Chen et al. 2016)",
    )
    guided_alignment_weight: float = Field(
        0.5, ge=0, le=100, description="weight of the guided-alignment cross-entropy in the loss"
    )
    accumulate: int = Field(
        1,
        ge=1,
        le=1024,
        description="batches per update (gradient accumulation): the gradients of this many "
        "batches (per rank) are summed and applied as one update on their union, "
        "normalised by all their target tokens; an epoch's last update may take fewer",
    )
    epochs: int = Field(10, ge=1, le=MAX_COUNT, description="passes over the training data")
    max_steps: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="stop after this many updates"
    )
    max_minutes: float | None = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="stop after this wall-clock time, data preparation included, summed over "
        "every --resume of the run",
    )
    validate_every: int = Field(500, ge=1, le=MAX_COUNT, description="updates between validations")
    log_every: int = Field(50, ge=1, le=MAX_COUNT, description="updates between log lines")
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
        0, ge=0, le=MAX_COUNT, description="updates of linear warmup from 0 (before any schedule)"
    )
    plateau_patience: int = Field(
        2, ge=1, le=MAX_COUNT, description="validations without improvement to halve"
    )
    patience: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="stop after this many validations without improvement"
    )
    best_metric: Literal["bleu", "loss"] = Field(
        "bleu", description="dev metric for the best model"
    )
    keep_last: int = Field(
        1,
        ge=1,
        le=MAX_COUNT,
        description="checkpoints kept besides the best (over 1: as step-N.pt files)",
    )
    save_every: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="updates between checkpoints (last.pt, and step-N.pt with keep_last over "
        "1) besides those of the validations, e.g. for nmt average (null: at validations only)",
    )
    oom_split: bool = Field(
        False,
        description="on GPU out-of-memory, retry the batch in halves (same update) instead of stopping",
    )
    cuda_graphs: bool = Field(
        True,
        description="on one GPU (not under torchrun), training runs as CUDA graphs captured "
        "once per batch shape (what they hold: cuda_graphs_scope), its batches padded to a few "
        "static shapes; no effect on a CPU",
    )
    cuda_graphs_scope: Literal["loss", "unroll"] = Field(
        "loss",
        description="what training.cuda_graphs captures: loss, the whole training loss forward "
        "and backward (encoder, decoder, output layer) for a GRU encoder, else as unroll; "
        "unroll, a step-by-step decoder's teacher-forced unroll alone (Bahdanau's, Luong's with "
        "input feeding), whose graphs hold less memory",
    )
    prefetch: bool | None = Field(
        None,
        description="the next update's batches read from the corpus and padded on a "
        "background thread while this update trains (null: on a GPU; on a CPU a step is long "
        "and the thread would share its cores)",
    )
    deferred_reads: bool | None = Field(
        None,
        description="an update's loss and gradient norm are read once the next update's "
        "forward and backward are queued, and a non-finite update is skipped on the device, "
        "so that a GPU never waits for the host between updates; read at once before a "
        "validation, a save, a stop and an epoch's end (null: on a GPU; one process without "
        "fp16's loss scaling)",
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

    def schedule_problems(self) -> list[str]:
        """decay_hold holds the rate before a decay, which only two schedules have."""
        if self.decay_hold and self.schedule not in ("linear", "cosine"):
            return [
                f"training.decay_hold: only the linear and cosine schedules decay; "
                f"schedule is {self.schedule}"
            ]
        return []


class DecodingConfig(Section):
    """Search settings used by validation BLEU, `nmt translate` and `nmt eval`."""

    beam_size: int = Field(5, ge=1, le=MAX_BEAM, description="beam width (1: greedy)")
    length_penalty: float = Field(
        1.0,
        ge=0,
        le=5,
        description="GNMT alpha in ((5+|Y|)/6)^alpha (at most 5, which keeps the longest "
        "output's normalised score a float32 number)",
    )
    max_len_ratio: float = Field(
        1.5,
        gt=0,
        le=MAX_LEN_RATIO,
        description="max output length per source piece: an output is at most ratio x source "
        "pieces + max_len_offset, and never over 100,000 pieces",
    )
    max_len_offset: int = Field(
        10, ge=0, le=MAX_LENGTH, description="added to the max output length"
    )
    batch_size: int = Field(
        64, ge=1, le=MAX_DECODING_BATCH, description="sentences per decoding batch"
    )
    no_repeat_ngram: int = Field(
        0,
        ge=0,
        le=MAX_LENGTH,
        description="forbid repeating any n-gram of this size in an output (0: off)",
    )
    coverage_penalty: float = Field(
        0.0,
        ge=0,
        le=10,
        description="GNMT beta in beta * sum_i log(min(sum_j a_ij, 1)), added to a finished "
        "hypothesis's length-normalised score (0: off)",
    )
    ensemble_average: Literal["linear", "log_linear"] = Field(
        "linear",
        description="with several --model: linear averages the models' probabilities, "
        "log_linear their log-probabilities (renormalised)",
    )
    shortlist: Literal["auto", "on", "off"] = Field(
        "auto",
        description="decode each batch over a lexical shortlist of the target vocabulary, "
        "built from the training pairs (auto: on a CPU, when the checkpoint has one; a GPU "
        "computes the whole output layer faster; on: an error if the checkpoint has none; "
        "off: the whole vocabulary)",
    )
    shortlist_frequent: int = Field(
        300, ge=0, le=1000, description="shortlist: the most frequent target pieces taken"
    )
    shortlist_per_word: int = Field(
        100, ge=1, le=100, description="shortlist: translations taken per source piece"
    )
    device_loop: bool | None = Field(
        None,
        description="beam and greedy search read nothing from the device until a batch "
        "ends: every sentence keeps its rows to the end, in fixed shapes, and the host "
        "learns that all are done without waiting (null: on a GPU; prefixes, constraints and "
        "no_repeat_ngram read every step)",
    )
    cuda_graphs: bool = Field(
        True,
        description="on a GPU, the device loop's search step is captured once per batch as "
        "a CUDA graph and replayed, not launched kernel by kernel",
    )
    workers: int | Literal["auto"] = Field(
        "auto",
        description="batches decoded at once, each in a thread: on a CPU with its share of "
        "torch's threads, on a GPU on its own CUDA stream (auto: on a CPU 2 where torch has 2 "
        "threads or more and the batches hold 16 sentences or more on average, else 1; on a "
        "GPU 1; never more than the batches)",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        """One message for workers' two forms, not one per member of the union."""
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise PydanticCustomError(
            "workers", "expected a number of threads (1 or more), or auto", {}
        )


class RunConfig(Section):
    """Where the run is written and what it runs on."""

    dir: str = Field("runs/default", description="run directory (checkpoints, logs, tokenizer)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available")
    threads: int | None = Field(
        None, ge=1, le=1024, description="CPU threads for torch (default: all)"
    )
    fast_kernels: bool = Field(
        True,
        description="CPU training: nmt's speed paths (nmt/fast) and malloc settings, glibc's "
        "tcache off included; false: torch's plain path, e.g. to compare (docs/guide/speed.md)",
    )
    tensorboard: bool = Field(
        True,
        description="write tensorboard's scalars and the dev attention heatmaps to "
        "run_dir/tensorboard; false: metrics.jsonl and the log alone, and no heatmap is drawn",
    )


class Config(Section):
    """A whole config: its six sections."""

    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = Field(default_factory=ModelConfig)  # checked when a config is made
    training: TrainingConfig = TrainingConfig()
    decoding: DecodingConfig = DecodingConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _compatible(self) -> Config:
        """The rules between keys, run once every key is valid and reported together, one
        message for all. Each lives with the section it reads, or here if it reads several."""
        model, training = self.model, self.training
        problems = [
            *model.attention_problems(),
            *model.bridge_problems(),
            *self.tokenizer.sampling_problems(),
            *model.tying_problems(),
            *self.data.source_problems(),
            *self._freeze_problems(),
            *model.head_problems(),
            *self._guidance_problems(),
            *training.schedule_problems(),
            *self._tokenizer_source_problems(),
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _freeze_problems(self) -> list[str]:
        """Freezing every part leaves nothing to train, unless there is an alignment head."""
        if len(set(self.training.freeze)) == 4 and not self.model.alignment_head:
            return [
                "training.freeze: every part is frozen and nothing would train; leave at least "
                "one of embeddings, encoder, decoder, attention out"
            ]
        return []

    def _guidance_problems(self) -> list[str]:
        """The alignment head learns from guided alignment, which needs fixed segmentations."""
        problems = []
        if self.model.alignment_head and not self.training.guided_alignment:
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
        return problems

    def _tokenizer_source_problems(self) -> list[str]:
        """A tokenizer comes from one place."""
        if self.training.init_from and self.tokenizer.model:
            return ["tokenizer.model: training.init_from brings its own tokenizer; remove one"]
        return []
