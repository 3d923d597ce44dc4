"""The Python API, for scripts and notebooks: the CLI's translate and score as methods.

    import nmt
    model = nmt.load("runs/demo")                # or several: nmt.load(["runs/a", "runs/b"])
    model.translate(["En el principio creó Dios los cielos y la tierra."], beam_size=5)
    model.score(["Dios es amor."], ["God is love."])
    model.align("Dios es amor.", "God is love.")  # [(0, 0), (1, 1), (2, 2)]: word links

Options take the names of the ``decoding`` config keys and default to the (first) run's
config, as the CLI's do; the same checks apply and raise the same errors (``nmt.errors``:
``ConfigError`` for options, ``DataError`` for text, ``CheckpointError`` for models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, overload

from nmt.commands.align import Extraction, Link, align_pairs
from nmt.commands.common import Models
from nmt.commands.translate import NoRepeat, given_steering
from nmt.config import Config
from nmt.decoding.options import Backend, SearchOptions, check_request, decoding_options
from nmt.decoding.plan import DecodingPlan
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError


@dataclass
class ScoredTranslation:
    """One hypothesis of an n-best list: its text, length-normalised score (as translate
    ranks) and log-probability log P(text | source)."""

    text: str
    score: float
    log_prob: float


@dataclass
class Score:
    """Forced score of a given translation: log P(target | source), the length-normalised
    score, and each target piece with its log-probability (EOS last, as ``</s>``). None
    fields for an empty source."""

    log_prob: float | None
    score: float | None
    tokens: list[tuple[str, float]]


def load(
    model: str | Path | Sequence[str | Path],
    device: str = "auto",
    precision: str = "auto",
    backend: Backend = "torch",
) -> Model:
    """A run directory (its best.pt) or checkpoint, or several of them (an ensemble), ready
    to translate and score. ``precision`` auto: decided by the hardware (``nmt.fast.precision``); the
    choice and its reason are in ``model.plan`` and ``model.precision``.
    ``backend="onnxruntime"``: one directory that `nmt export` wrote, which translates
    without the checkpoint (score and align need the checkpoint)."""
    paths = [model] if isinstance(model, (str, Path)) else list(model)
    if not paths:
        raise DataError("nmt.load: give a run directory or checkpoint")
    if backend not in get_args(Backend):
        raise ConfigError(f"nmt.load: backend {backend!r}: expected one of {get_args(Backend)}")
    return Model(Models([Path(p) for p in paths], device, precision, backend).open())


class Model:
    """Loaded model(s) with their tokenizer; see ``load``."""

    def __init__(self, translator: Translator):
        self.translator = translator

    @property
    def precision(self) -> str:
        """What the models decode in and why, e.g. ``fp32 (auto: this CPU has no native bf16 matmuls)``."""
        return f"{self.translator.precision} ({self.translator.precision_reason})"

    @property
    def plan(self) -> DecodingPlan:
        """The decoding plan of the last translate or score call (before any: of a call of
        full batches under the run's decoding section); ``.line()`` says it in one line."""
        translator = self.translator
        return translator.last_plan or translator.plan(translator.config.decoding)

    @property
    def config(self) -> Config:
        """The (first) run's resolved config."""
        return self.translator.config

    @overload
    def translate(
        self,
        sentences: str,
        *,
        n_best: int = 1,
        prefixes: str | Sequence[str] | None = None,
        constraints: Sequence[str] | Sequence[Sequence[str]] | None = None,
        **options: Any,
    ) -> str | list[ScoredTranslation]: ...

    @overload
    def translate(
        self,
        sentences: Sequence[str],
        *,
        n_best: int = 1,
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        **options: Any,
    ) -> list[str] | list[list[ScoredTranslation]]: ...

    def translate(
        self,
        sentences: str | Sequence[str],
        *,
        n_best: int = 1,
        prefixes: str | Sequence[str] | None = None,
        constraints: Sequence[str] | Sequence[Sequence[str]] | None = None,
        **options: Any,
    ) -> str | list[ScoredTranslation] | list[str] | list[list[ScoredTranslation]]:
        """Translate one sentence (-> str) or a list (-> list of str, one per sentence).

        ``n_best`` > 1: a list of ``ScoredTranslation``s per sentence instead, best first.
        ``prefixes``: one target prefix per sentence ("" for none); ``constraints``: one list
        of target phrases per sentence. ``options``: decoding keys, e.g. ``beam_size=5``,
        ``length_penalty``, ``coverage_penalty``, ``max_len_ratio``, ``no_repeat_ngram``,
        ``shortlist="off"``.
        """
        single = isinstance(sentences, str)
        lines = [sentences] if isinstance(sentences, str) else list(sentences)
        if single and isinstance(prefixes, str):
            prefixes = [prefixes]
        if single and constraints is not None and all(isinstance(c, str) for c in constraints):
            constraints = [[str(c) for c in constraints]]
        decoding = decoding_options(self.translator.config.decoding, options)
        check_request(decoding, n_best, constraints is not None, "beam_size" in options)
        no_repeat = NoRepeat(decoding.no_repeat_ngram)
        steering = given_steering(
            self.translator, len(lines), prefixes, constraints, no_repeat=no_repeat
        )
        search = SearchOptions(n_best)
        results = self.translator.translate(lines, decoding, search, steering=steering)
        if n_best == 1:
            texts = [self.translator.best_text(result) for result in results]
            return texts[0] if single else texts
        lists = [
            [
                ScoredTranslation(self.translator.detokenize(h), h.score, h.log_prob)
                for h in result.hypotheses
            ]
            for result in results
        ]
        return lists[0] if single else lists

    @overload
    def score(self, sources: str, targets: str, **options: Any) -> Score: ...

    @overload
    def score(
        self, sources: Sequence[str], targets: Sequence[str], **options: Any
    ) -> list[Score]: ...

    def score(
        self, sources: str | Sequence[str], targets: str | Sequence[str], **options: Any
    ) -> Score | list[Score]:
        """Forced scores of given translations: one ``Score`` per (source, target) pair (a
        single Score for two strings). ``options``: ``length_penalty``,
        ``coverage_penalty``, ``ensemble_average``, ``batch_size``."""
        single, src, trg = _pairs("score", sources, targets)
        decoding = decoding_options(self.translator.config.decoding, options)
        results = self.translator.score(src, trg, decoding)
        tokenizer = self.translator.tokenizer
        out = []
        for target, result in zip(trg, results, strict=True):
            if result is None:
                out.append(Score(None, None, []))
                continue
            (ids,) = tokenizer.encode_trg([target])
            pieces = tokenizer.trg_pieces_and_eos(ids)
            tokens = list(zip(pieces, result.token_log_probs, strict=True))
            out.append(Score(result.log_prob, result.score, tokens))
        return out[0] if single else out

    @overload
    def align(  # type: ignore[overload-overlap]
        self,
        sources: str,
        targets: str,
        extract: str = "argmax",
        threshold: float | None = None,
        attention: bool = False,
    ) -> list[Link]: ...

    @overload
    def align(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        extract: str = "argmax",
        threshold: float | None = None,
        attention: bool = False,
    ) -> list[list[Link]]: ...

    def align(
        self,
        sources: str | Sequence[str],
        targets: str | Sequence[str],
        extract: str = "argmax",
        threshold: float | None = None,
        attention: bool = False,
    ) -> list[Link] | list[list[Link]]:
        """Word alignments of given translations (as `nmt align`): per pair a sorted list of
        (source word, target word) indices, whitespace words from 0; a single list for two
        strings. From the alignment head where the model has one, unless ``attention``."""
        extraction = Extraction(extract, threshold, attention)
        extraction.check()
        single, src, trg = _pairs("align", sources, targets)
        out = align_pairs(self.translator, src, trg, extraction)
        return out[0] if single else out


def _pairs(
    method: str, sources: str | Sequence[str], targets: str | Sequence[str]
) -> tuple[bool, list[str], list[str]]:
    """(one pair given as two strings?, the sources, the targets), as many of each."""
    src = [sources] if isinstance(sources, str) else list(sources)
    trg = [targets] if isinstance(targets, str) else list(targets)
    if len(src) != len(trg):
        raise DataError(
            f"{method}: {len(src)} sources but {len(trg)} targets; give one target per source"
        )
    return isinstance(sources, str), src, trg
