"""What each endpoint asks of a served model. A request is checked first, against the
server's limits and the rules `nmt translate`, `nmt score` and `nmt align` apply (every
error raised before any decoding), then becomes a ``Job`` for the decode thread
(``nmt.commands.serve.batching``), whose result is the request's reply.

Translate jobs of one model with the same decoding options share a key: the batcher may
decode them in one ``Translator.translate`` call, each sentence with its own prefix and
constraints. Score and align jobs are decoded alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from torch import Tensor

from nmt.commands.align import Extraction, align_pairs
from nmt.commands.serve.batching import Job
from nmt.commands.serve.limits import Limits
from nmt.commands.serve.models import ServedModel
from nmt.commands.serve.schemas import (
    AlignBody,
    AttentionMap,
    HypothesisLine,
    PairAlignment,
    PairScore,
    ScoreBody,
    TranslateBody,
    TranslatedLine,
)
from nmt.commands.translate import NoRepeat, format_translation, given_steering, output_links
from nmt.config import DecodingConfig
from nmt.data.tokenizer import Tokenizer, piece_words
from nmt.decoding.alignment import format_links, output_words
from nmt.decoding.options import Naming, SearchOptions, check_request, decoding_options
from nmt.decoding.steering import Steering
from nmt.decoding.translator import Translation
from nmt.errors import DataError

# The decoding keys a translate request may set (None: the run's value).
DECODING_KEYS = (
    "beam_size",
    "length_penalty",
    "coverage_penalty",
    "max_len_ratio",
    "no_repeat_ngram",
)

# Errors name a request's fields: the options' own keys (beam_size, n_best, extract), but for
# the one field named otherwise.
ALIGN_FIELDS = Naming({"attention": "use_attention"})


def field_entry(name: str, index: int) -> str:
    """Entry ``index`` of a request's list field, as the 422s name it: ``prefixes.0``."""
    return f"{name}.{index}"


@dataclass(frozen=True)
class TranslateWork:
    """One checked translate request: its sentences, steering (None: none) and options."""

    model: ServedModel
    lines: list[str]
    decoding: DecodingConfig
    search: SearchOptions
    steering: Steering | None
    attention: bool
    alignments: bool


def translate_job(model: ServedModel, body: TranslateBody, limits: Limits) -> Job:
    """A translate request, checked, as a job keyed by its model and options."""
    lines = body.sentences
    limits.check_count("sentences", len(lines))
    phrases = [phrase for row in body.constraints or [] for phrase in row]
    limits.check_chars([*lines, *(body.prefixes or []), *phrases])
    translator = model.translator
    beam_given = body.beam_size is not None
    # the server's limit before the schema's own bound: any beam past it, the same 413
    beam_size = translator.config.decoding.beam_size if body.beam_size is None else body.beam_size
    limits.check_beam(beam_size, beam_given)
    overrides = {key: getattr(body, key) for key in DECODING_KEYS}
    decoding = decoding_options(translator.config.decoding, overrides)
    check_request(decoding, body.n_best, body.constraints is not None, beam_given)
    no_repeat = NoRepeat(decoding.no_repeat_ngram)
    given = body.prefixes, body.constraints
    steering = given_steering(translator, len(lines), *given, field_entry, no_repeat)
    search = SearchOptions(body.n_best, body.attention or body.alignments)
    work = TranslateWork(
        model, list(lines), decoding, search, steering, body.attention, body.alignments
    )
    key = ("translate", model.name, decoding.model_dump_json(), search)
    return Job(key, len(lines), work, translate_together)


def translate_together(
    works: list[TranslateWork], stop: threading.Event
) -> list[list[TranslatedLine]]:
    """Requests of one model and options in one ``Translator.translate`` call: each
    request's translations, line for line; once ``stop`` is set, the search stops."""
    first = works[0]
    translator = first.model.translator
    lines = [line for work in works for line in work.lines]
    steering = joined_steering([(work.steering, len(work.lines)) for work in works])
    search = replace(first.search, stop=stop)
    results = translator.translate(lines, first.decoding, search, steering=steering)
    out, start = [], 0
    for work in works:
        part = results[start : start + len(work.lines)]
        start += len(work.lines)
        out.append(
            [
                _translated(work, i, line, item)
                for i, (line, item) in enumerate(zip(work.lines, part, strict=True))
            ]
        )
    return out


def joined_steering(parts: Sequence[tuple[Steering | None, int]]) -> Steering | None:
    """Several requests' steering (each None or one entry per sentence, for its count of
    sentences) as one, in order: a request without prefixes (or constraints) gets empty
    ones, which impose nothing."""
    if all(steering is None for steering, _ in parts):
        return None

    def joined(name: str) -> list[Any] | None:
        given = [getattr(steering, name) if steering else None for steering, _ in parts]
        if all(rows is None for rows in given):
            return None
        return [
            row
            for rows, (_, count) in zip(given, parts, strict=True)
            for row in (rows if rows is not None else [[]] * count)
        ]

    return Steering(joined("prefixes"), joined("constraints"))


def _translated(work: TranslateWork, index: int, line: str, item: Translation) -> TranslatedLine:
    """One sentence's reply: the line `nmt translate` writes, the n-best list, and the
    best output's attention and word links where asked."""
    translator = work.model.translator
    best = item.best
    attention = None
    if work.attention and best is not None and best.alphas is not None:
        words = output_words(translator.tokenizer, best.tokens)
        text = translator.detokenize(best)
        attention = attention_map(
            translator.tokenizer, line, item.src_ids, text, best.tokens, words, best.alphas
        )
    alignment = output_links(translator, line, item, work.decoding) if work.alignments else None
    return TranslatedLine(
        text=format_translation(translator, index, item, 1, False)[0],
        score=best.score if best is not None else None,
        log_prob=best.log_prob if best is not None else None,
        hypotheses=[
            HypothesisLine(text=translator.detokenize(h), score=h.score, log_prob=h.log_prob)
            for h in item.hypotheses
        ],
        attention=attention,
        alignment=alignment,
    )


def attention_map(
    tokenizer: Tokenizer,
    source: str,
    src_ids: Sequence[int],
    target: str,
    trg_ids: Sequence[int],
    target_words: Sequence[int],
    alphas: Tensor,
) -> AttentionMap:
    """Attention (|y|+1, |x|) with its pieces (``</s>`` last on both sides), the whitespace
    words of both texts and each piece's word (``</s>``: None)."""
    return AttentionMap(
        source=tokenizer.src_pieces(src_ids),
        target=tokenizer.trg_pieces_and_eos(trg_ids),
        weights=alphas.float().tolist(),
        source_words=source.split(),
        target_words=target.split(),
        source_piece_word=[*piece_words(tokenizer.src, source), None],
        target_piece_word=[*target_words, None],
    )


PairBody = TypeVar("PairBody", ScoreBody, AlignBody)
PairOptions = TypeVar("PairOptions", DecodingConfig, Extraction)


@dataclass(frozen=True)
class PairWork(Generic[PairBody, PairOptions]):
    """One checked score or align request: its pairs (``body``) and ``options``, what decodes
    them (a score's decoding options, an alignment's extraction)."""

    model: ServedModel
    body: PairBody
    options: PairOptions


def _alone(
    work: PairWork[PairBody, PairOptions], pairs: Callable[[PairWork[PairBody, PairOptions]], Any]
) -> Job:
    """A score or align request's job, decoded alone: ``pairs`` gives its reply (forced, in
    one pass: no steps to stop between)."""
    return Job(None, len(work.body.sources), work, lambda works, _: [pairs(w) for w in works])


def score_job(model: ServedModel, body: ScoreBody, limits: Limits) -> Job:
    """A score request, checked, as a job of its own."""
    _check_pairs(body.sources, body.targets, limits)
    overrides = {"length_penalty": body.length_penalty, "coverage_penalty": body.coverage_penalty}
    decoding = decoding_options(model.translator.config.decoding, overrides)
    return _alone(PairWork(model, body, decoding), _scores)


def _scores(work: PairWork[ScoreBody, DecodingConfig]) -> list[PairScore]:
    """Each pair's forced score as `nmt score` gives it, with the pieces and the attention
    where asked."""
    translator, body = work.model.translator, work.body
    tokenizer = translator.tokenizer
    results = translator.score(body.sources, body.targets, work.options, body.attention)
    out = []
    for source, target, result in zip(body.sources, body.targets, results, strict=True):
        if result is None:
            out.append(PairScore(log_prob=None, score=None))
            continue
        (trg_ids,) = tokenizer.encode_trg([target])
        tokens = None
        if body.tokens:
            pieces = tokenizer.trg_pieces_and_eos(trg_ids)
            tokens = list(zip(pieces, result.token_log_probs, strict=True))
        attention = None
        if body.attention and result.alphas is not None:
            (src_ids,) = tokenizer.encode_src([source])
            words = piece_words(tokenizer.trg, target)
            attention = attention_map(
                tokenizer, source, src_ids, target, trg_ids, words, result.alphas
            )
        out.append(
            PairScore(
                log_prob=result.log_prob, score=result.score, tokens=tokens, attention=attention
            )
        )
    return out


def align_job(model: ServedModel, body: AlignBody, limits: Limits) -> Job:
    """An align request, checked, as a job of its own."""
    _check_pairs(body.sources, body.targets, limits)
    extraction = Extraction(body.extract, body.threshold, body.use_attention)
    extraction.check(ALIGN_FIELDS)
    extraction.check_head(model.translator, ALIGN_FIELDS)
    return _alone(PairWork(model, body, extraction), _alignments)


def _alignments(work: PairWork[AlignBody, Extraction]) -> list[PairAlignment]:
    """Each pair's word links, those of `nmt align`."""
    body = work.body
    links = align_pairs(work.model.translator, body.sources, body.targets, work.options)
    return [
        PairAlignment(
            links=row,
            pharaoh=format_links(row),
            source_words=source.split(),
            target_words=target.split(),
        )
        for source, target, row in zip(body.sources, body.targets, links, strict=True)
    ]


def _check_pairs(sources: Sequence[str], targets: Sequence[str], limits: Limits) -> None:
    if len(sources) != len(targets):
        raise DataError(
            f"targets: {len(targets)} for {len(sources)} sources; give one target per source"
        )
    limits.check_count("sources", len(sources))
    limits.check_chars([*sources, *targets])
