"""The JSON the server reads and writes (/docs shows them): requests are strict (a field of
the wrong type, a missing one or an unknown one is a 422, nothing is coerced); None in a
decoding field keeps the run's ``decoding`` value. Every text field is ``Text``: valid
Unicode, which JSON text need not be (``"\\ud800"``, a lone surrogate, is a 422 naming it)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


def _unicode(text: str) -> str:
    """``text`` if it is valid Unicode: a lone surrogate is no character, and no tokenizer
    takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("unicode", "not valid Unicode (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TranslateBody(_Body):
    """POST /api/translate."""

    model: Text | None = Field(None, description="a served model's name; null: the first")
    sentences: list[Text] = Field(description="the source sentences")
    beam_size: int | None = Field(None, description="beam size (1: greedy)")
    n_best: int = Field(1, ge=1, description="hypotheses per sentence (at most beam_size)")
    length_penalty: float | None = Field(None, description="GNMT alpha")
    coverage_penalty: float | None = Field(None, description="GNMT beta (0: off)")
    max_len_ratio: float | None = Field(None, description="longest output per source piece")
    no_repeat_ngram: int | None = Field(None, description="forbid repeated n-grams of this size")
    prefixes: list[Text] | None = Field(
        None, description="a target prefix per sentence (empty: none)"
    )
    constraints: list[list[Text]] | None = Field(
        None, description="target phrases each output must contain, a list per sentence"
    )
    attention: bool = Field(False, description="the best output's attention matrix")
    alignments: bool = Field(False, description="the best output's word alignment")


class ScoreBody(_Body):
    """POST /api/score."""

    model: Text | None = None
    sources: list[Text]
    targets: list[Text] = Field(description="a translation per source, to score")
    length_penalty: float | None = None
    coverage_penalty: float | None = None
    tokens: bool = Field(False, description="each target piece's log-probability")
    attention: bool = Field(False, description="the attention over each given target")


class AlignBody(_Body):
    """POST /api/align."""

    model: Text | None = None
    sources: list[Text]
    targets: list[Text]
    extract: Text = Field("argmax", description="argmax, threshold, next, intersect or gdfa")
    threshold: float | None = Field(
        None, description="with extract threshold: the least mass (null: 0.5)"
    )
    use_attention: bool = Field(
        False, description="align with the attention even where the model has an alignment head"
    )


class AttentionMap(BaseModel):
    """Attention weights, target pieces (rows, ``</s>`` last) by source pieces (columns),
    with the whitespace words each piece belongs to (``</s>``: null)."""

    source: list[str]
    target: list[str]
    weights: list[list[float]]
    source_words: list[str]
    target_words: list[str]
    source_piece_word: list[int | None]
    target_piece_word: list[int | None]


class HypothesisLine(BaseModel):
    text: str
    score: float
    log_prob: float


class TranslatedLine(BaseModel):
    """One sentence's translation: ``text`` is the line `nmt translate` writes (score null
    without an output); ``hypotheses`` the n-best list, best first."""

    text: str
    score: float | None
    log_prob: float | None
    hypotheses: list[HypothesisLine]
    attention: AttentionMap | None = None
    alignment: list[tuple[int, int]] | None = None


class TranslateReply(BaseModel):
    model: str
    translations: list[TranslatedLine]
    batched_with: int = Field(description="sentences decoded together, this request's included")
    elapsed_ms: float


class PairScore(BaseModel):
    """A pair's forced score (null fields for an empty source); ``tokens``: each target
    piece (``</s>`` last) with its log-probability."""

    log_prob: float | None
    score: float | None
    tokens: list[tuple[str, float]] | None = None
    attention: AttentionMap | None = None


class ScoreReply(BaseModel):
    model: str
    scores: list[PairScore]


class PairAlignment(BaseModel):
    """A pair's word links (source word, target word), also in Pharaoh format."""

    links: list[tuple[int, int]]
    pharaoh: str
    source_words: list[str]
    target_words: list[str]


class AlignReply(BaseModel):
    model: str
    alignments: list[PairAlignment]


class VocabularySizes(BaseModel):
    source: int
    target: int
    joint: bool


class TrainingFigures(BaseModel):
    """What the checkpoint records of its training (null where it records nothing)."""

    step: int | None = None
    epoch: int | None = None
    best_metric: str | None = None
    best: float | None = None
    dev_bleu: float | None = None
    dev_loss: float | None = None


class PlanInfo(BaseModel):
    """The decoding plan of a request of full batches under the run's decoding section
    (``nmt.decoding.plan``; a request of fewer batches may take fewer workers)."""

    precision: str
    reason: str = Field(description="why that precision")
    kernels: str = Field(description="compiled, torch or onnxruntime")
    loop: str = Field(description="host or device")
    workers: int = Field(description="batches decoded at once")
    shortlist: bool
    backend: str
    line: str = Field(description="the plan in one line, as nmt eval prints it")


class ModelInfo(BaseModel):
    name: str
    path: str
    device: str
    precision: str
    decoding_plan: PlanInfo
    alignment_head: bool
    summary: str
    config: dict[str, Any]
    vocabulary: VocabularySizes
    training: TrainingFigures


class ModelsReply(BaseModel):
    models: list[ModelInfo]


class VocabularyReply(BaseModel):
    side: str
    size: int
    offset: int
    pieces: list[str]


class HealthReply(BaseModel):
    status: str
    models: list[str]


class ErrorReply(BaseModel):
    error: str = Field(description="one line: the field or limit, and what was wrong")
