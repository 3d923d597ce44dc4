"""The body of `nmt translate`: lines in, exactly one output line (or n-best block) per line,
the attention of each translation on request, prefixes and constraints per line, and a
line-by-line mode for terminals and pipes. The text-to-ids of prefixes and constraints and
the output format here are shared with the Python API (nmt.api) and the server
(nmt.commands.serve)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO

import torch

from nmt.commands.common import (
    Heatmaps,
    Models,
    check_attention_dir,
    check_writes,
    open_heatmaps,
    progress_bar,
)
from nmt.config import DecodingConfig
from nmt.decoding.alignment import format_links, hypothesis_links
from nmt.decoding.options import KEYS, Naming, SearchOptions, check_request, decoding_options
from nmt.decoding.steering import Steering, search_limits
from nmt.decoding.translator import Translation, Translator
from nmt.errors import ConfigError, DataError
from nmt.files import (
    STDIN,
    check_one_stdin,
    read_lines,
    split_lines,
    standard_input,
    standard_output,
    write_lines,
)


@dataclass(frozen=True)
class TranslateRequest:
    """What `nmt translate` is asked: the models, the text in and out (``-``: stdin and
    stdout), the ``decoding`` keys to override (None: the run's value), and what to write
    besides the text."""

    models: Models
    input: str = STDIN
    output: str = STDIN
    decoding: Mapping[str, object] = field(default_factory=dict)
    n_best: int = 1  # > 1: TSV rows of line, rank, score, text
    scores: bool = False  # each line prefixed with its score and a tab
    batch_tokens: int | None = None  # also cap the padded source tokens of a batch
    prefix: Path | None = None  # a file of target prefixes, one per input line
    constraints: Path | None = None  # JSONL: a list of target phrases per input line
    attention_dir: Path | None = None  # a heatmap per sentence
    alignments: Path | None = None  # a Pharaoh line per output
    unbuffered: bool = False  # translate each stdin line as it arrives
    show_progress: bool = True
    naming: Naming = KEYS  # how errors name the options (the CLI's: its flags)

    @property
    def search(self) -> SearchOptions:
        attention = self.attention_dir is not None or self.alignments is not None
        return SearchOptions(self.n_best, attention, self.batch_tokens)


@dataclass(frozen=True)
class NoRepeat:
    """``decoding.no_repeat_ngram`` (0: off) and what the caller calls it, for errors."""

    n: int = 0
    name: str = "no_repeat_ngram"

    def check(self, ids: list[int], text: str, where: str) -> list[int]:
        """Forced pieces (a prefix, a constraint phrase) ``ids`` of ``text``, if no n-gram
        repeats in them: one that does can be in no output under no_repeat_ngram n (search
        would end with no hypothesis), so it is an error, not an empty output."""
        grams = [tuple(ids[i : i + self.n]) for i in range(len(ids) - self.n + 1)]
        if self.n > 0 and len(set(grams)) < len(grams):
            gram = "a piece" if self.n == 1 else f"a run of {self.n} pieces"
            raise ConfigError(
                f"{where}: {text!r} repeats {gram}, which {self.name} {self.n} forbids in "
                f"every output; give a larger {self.name} (0: none)"
            )
        return ids


def prefix_ids(
    translator: Translator,
    prefixes: Sequence[str],
    where: Callable[[int], str],
    no_repeat: NoRepeat = NoRepeat(),
) -> list[list[int]]:
    """One prefix per line (empty: none) -> target ids; ``where(i)`` names prefix ``i``
    (from 0) in errors: a file's line, a request's field."""
    return [
        no_repeat.check(translator.target_ids(text, where(i)), text, where(i))
        if text.strip()
        else []
        for i, text in enumerate(prefixes)
    ]


def constraint_ids(
    translator: Translator,
    rows: Sequence[Sequence[str]],
    where: Callable[[int], str],
    no_repeat: NoRepeat = NoRepeat(),
) -> list[list[list[int]]]:
    """Each line's phrases -> target ids per phrase; ``where(i)`` names row ``i``."""
    out = []
    for i, phrases in enumerate(rows):
        ids = []
        for phrase in phrases:
            if not phrase.strip():
                raise DataError(f"{where(i)}: an empty constraint phrase; remove it")
            ids.append(no_repeat.check(translator.target_ids(phrase, where(i)), phrase, where(i)))
        out.append(ids)
    return out


def list_line(name: str, index: int) -> str:
    """Entry ``index`` of a list argument as the Python API names it: ``prefixes line 2``."""
    return f"{name} line {index + 1}"


def file_line(path: Path) -> Callable[[int], str]:
    """Line ``index`` (from 0) of a file, as errors name it: ``FILE line 2``."""
    return lambda index: f"{path} line {index + 1}"


def given_steering(
    translator: Translator,
    count: int,
    prefixes: Sequence[str] | None,
    constraints: Sequence[Sequence[str]] | None,
    where: Callable[[str, int], str] = list_line,
    no_repeat: NoRepeat = NoRepeat(),
) -> Steering | None:
    """Prefixes and constraints given as lists (the Python API, the server), one entry per
    sentence of ``count`` (empty for none), as ids; None when neither is given. Errors name
    entry ``i`` of ``prefixes`` or ``constraints`` as ``where(name, i)`` does; no prefix or
    phrase may break the search's ``no_repeat``."""
    if prefixes is None and constraints is None:
        return None
    for name, given in (("prefixes", prefixes), ("constraints", constraints)):
        if given is not None and len(given) != count:
            raise DataError(
                f"translate: {len(given)} {name} for {count} sentences; give one per "
                f"sentence (empty for none)"
            )
    steering = Steering()
    if prefixes is not None:
        named = partial(where, "prefixes")
        steering.prefixes = prefix_ids(translator, prefixes, named, no_repeat)
    if constraints is not None:
        rows = [list(row) for row in constraints]
        named = partial(where, "constraints")
        steering.constraints = constraint_ids(translator, rows, named, no_repeat)
    return steering


def parse_constraints(lines: Sequence[str], where: str) -> list[list[str]]:
    """JSONL: one JSON list of target phrases per line; an empty line or [] is none."""
    out: list[list[str]] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            out.append([])
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where} line {n}: not JSON ({exc.msg} at column {exc.colno}); write a list "
                f'of target phrases, e.g. ["the house", "green"]'
            ) from None
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise DataError(
                f"{where} line {n}: expected a JSON list of target phrases (strings), got "
                f"{json.dumps(value)[:60]}"
            )
        out.append(value)
    return out


def read_steering(
    translator: Translator,
    prefix_path: Path | None,
    constraints_path: Path | None,
    count: int | None,
    no_repeat: NoRepeat = NoRepeat(),
) -> Steering | None:
    """The --prefix and --constraints files as ids; ``count``: the input's line count, which
    each must match (None: streamed input, checked line by line); ``no_repeat``: the
    search's, which no prefix or phrase may break."""
    if prefix_path is None and constraints_path is None:
        return None
    for option, path in (("--prefix", prefix_path), ("--constraints", constraints_path)):
        if path is not None and not path.is_file():
            raise DataError(f"{option} {path}: no such file")
    steering = Steering()
    if prefix_path is not None:
        texts = read_lines(str(prefix_path))
        _check_count(texts, count, f"--prefix {prefix_path}")
        steering.prefixes = prefix_ids(translator, texts, file_line(prefix_path), no_repeat)
    if constraints_path is not None:
        texts = read_lines(str(constraints_path))
        _check_count(texts, count, f"--constraints {constraints_path}")
        rows = parse_constraints(texts, str(constraints_path))
        where = file_line(constraints_path)
        steering.constraints = constraint_ids(translator, rows, where, no_repeat)
    return steering


def _check_count(lines: Sequence[str], count: int | None, option: str) -> None:
    if count is not None and len(lines) != count:
        raise DataError(
            f"{option} has {len(lines)} lines but the input has {count}; give one line per "
            f"input line (an empty line for none)"
        )


def format_translation(
    translator: Translator, index: int, item: Translation, n_best: int, scores: bool
) -> list[str]:
    """Line ``index``'s output: its text (``scores``: after its score and a tab), or with
    ``n_best`` > 1 a row per hypothesis: line, rank, score, text. A line without a
    hypothesis scores 0 where it is empty (nothing to translate) and -inf where search found
    none (constraints no output meets)."""
    none = f"{-math.inf if item.src_ids else 0.0:.4f}"
    if n_best > 1:
        rows = [
            f"{index}\t{rank}\t{hyp.score:.4f}\t{translator.detokenize(hyp)}"
            for rank, hyp in enumerate(item.hypotheses, start=1)
        ]
        return rows or [f"{index}\t1\t{none}\t"]
    text = translator.best_text(item)
    if scores:
        best = item.best
        score = f"{best.score:.4f}" if best is not None else none
        return [f"{score}\t{text}"]
    return [text]


def translate_command(
    request: TranslateRequest,
    warn: Callable[[str], None] = lambda message: None,
    say: Callable[[str], None] = lambda message: None,
) -> int:
    """`nmt translate`: read lines, write exactly one output line (or n-best block) per line.

    Every user error (input, output path, checkpoints, options, prefix and constraint files)
    is raised before the output is touched; a file output is replaced atomically, so a failed
    run leaves an existing file as it was. A line whose constraints no output could meet
    gets an empty output line and a call of ``warn``; so, at the end, do the outputs that
    search ended at their length limit (cut short, or repeating). Line by line (each output
    written and flushed as its line arrives): ``unbuffered``, or input from a terminal. ``alignments``:
    a file for the word alignment of each output (Pharaoh, from its attention), written at
    the end. ``say`` hears, at the end, the decoding plan the search ran by (its line,
    as ``nmt eval`` prints it: ``nmt.decoding.plan``).
    """
    check_one_stdin(
        {"--input": request.input, "--prefix": request.prefix, "--constraints": request.constraints}
    )
    stdin = standard_input() if request.input == STDIN else None
    streaming = stdin is not None and (request.unbuffered or stdin.isatty())
    if request.unbuffered and request.output != STDIN:
        raise ConfigError("--unbuffered writes each line to stdout as it is done: drop --output")
    _check_writes(request)
    lines = None if streaming else read_lines(request.input)
    translator = request.models.open()
    _check_alignments(translator, request)
    decoding = decoding_options(translator.config.decoding, request.decoding)
    beam_given = bool(request.decoding.get("beam_size"))
    constrained = request.constraints is not None
    check_request(decoding, request.n_best, constrained, beam_given, request.naming)
    known = None if lines is None else len(lines)
    no_repeat = NoRepeat(decoding.no_repeat_ngram, request.naming("no_repeat_ngram"))
    steering = read_steering(translator, request.prefix, request.constraints, known, no_repeat)
    heatmaps = open_heatmaps(translator, request.attention_dir)
    job = _Job(translator, decoding, request, steering, heatmaps, warn)
    if lines is None:
        assert stdin is not None
        count = _stream(job, stdin, standard_output())
    else:
        count = _translate_all(job, lines)
    if job.at_limit:
        warn(
            f"{job.at_limit} of {job.decoded} outputs stopped at their length limit "
            f"(ceil({decoding.max_len_ratio:g} x source pieces) + {decoding.max_len_offset}"
            f"{' + forced tokens' if steering is not None else ''}): cut short, or "
            f"repeating themselves; --max-len-ratio and --max-len-offset set the limit"
        )
    if request.alignments is not None:
        write_lines(request.alignments, job.links)
    say((translator.last_plan or translator.plan(decoding, [], steering)).line())
    return count


def _check_writes(request: TranslateRequest) -> None:
    """The output, the alignments file and the heatmaps' folder can be written, and replace
    nothing the command reads."""
    read: dict[str, str | Path | Sequence[Path] | None] = {
        "--model": request.models.files(),
        "--input": request.input,
        "--prefix": request.prefix,
        "--constraints": request.constraints,
    }
    check_writes("--output", request.output, read)
    if request.output != STDIN:
        read["--output"] = request.output
    if request.alignments is not None:
        check_writes("--alignments", request.alignments, read)
    check_attention_dir(request.attention_dir)


def _check_alignments(translator: Translator, request: TranslateRequest) -> None:
    """--alignments of a model with an alignment head read the head, which an exported
    model does not have: not the attention in its place."""
    exported = translator.backend is not None
    if request.alignments is not None and exported and translator.config.model.alignment_head:
        raise ConfigError(
            "--alignments: this model aligns with its alignment head (model.alignment_head), "
            "which the exported graphs do not hold; write alignments with the torch backend "
            "(the run directory)"
        )


@dataclass
class _Job:
    """One run of `nmt translate`: the models, the checked options and steering, where the
    heatmaps go, and the alignment lines so far."""

    translator: Translator
    decoding: DecodingConfig
    request: TranslateRequest
    steering: Steering | None
    heatmaps: Heatmaps | None
    warn: Callable[[str], None]
    links: list[str] = field(default_factory=list)
    decoded: int = 0  # the lines with an output
    at_limit: int = 0  # of those, the outputs that search ended at their length limit

    def finish(self, index: int, line: str, item: Translation) -> list[str]:
        """Line ``index``'s output rows; its heatmap, alignment and warning on the side."""
        translator, request = self.translator, self.request
        best = item.best
        if self.heatmaps is not None and best is not None and best.alphas is not None:
            self.heatmaps.write(index, item.src_ids, best.tokens, best.alphas)
        if request.alignments is not None:
            self.links.append(_links(translator, line, item, self.decoding))
        if best is not None:
            self.decoded += 1
            self.at_limit += len(best.tokens) + 1 >= self._limit(index, item)
        if line.strip() and best is None and self.steering is not None:
            self.warn(
                f"input line {index + 1}: no output meets all its constraints within the "
                f"length limit (--no-repeat-ngram can forbid a constraint); its output line "
                f"is empty"
            )
        return format_translation(translator, index, item, request.n_best, request.scores)

    def _limit(self, index: int, item: Translation) -> int:
        """Line ``index``'s output length limit, EOS included, as search set it."""
        steering = self.steering.subset([index]) if self.steering is not None else None
        lengths = torch.tensor([len(item.src_ids)])
        ratio, offset = self.decoding.max_len_ratio, self.decoding.max_len_offset
        return search_limits(lengths, ratio, offset, steering)[0]


def _links(translator: Translator, line: str, item: Translation, decoding: DecodingConfig) -> str:
    """The Pharaoh line of the best output's word alignment (empty without an output)."""
    return format_links(output_links(translator, line, item, decoding))


def output_links(
    translator: Translator, line: str, item: Translation, decoding: DecodingConfig
) -> list[tuple[int, int]]:
    """The best output's word links (source word, output word; none without an output):
    from the alignment heads, re-reading the output, where the models have them, else from
    the search's attention (the search must have kept it: ``SearchOptions.attention``)."""
    best = item.best
    if best is None:
        return []
    weights = best.alphas
    if translator.has_alignment_head:
        weights = translator.head_alignment(item.src_ids, best.tokens, decoding)
    return hypothesis_links(translator.tokenizer, line, best.tokens, weights)


def _translate_all(job: _Job, lines: list[str]) -> int:
    """Translate the lines in batches, then write every output line at once."""
    request = job.request
    with progress_bar(len(lines), request.show_progress, (request.input,)) as advance:
        results = job.translator.translate(
            lines, job.decoding, request.search, advance, job.steering
        )
    out = [row for i, item in enumerate(results) for row in job.finish(i, lines[i], item)]
    write_lines(request.output, out)
    return len(lines)


def _stream(job: _Job, source: TextIO, sink: TextIO) -> int:
    """Translate each line as it arrives and write its output at once (interactive use)."""
    index = 0
    while True:
        raw = source.buffer.readline()
        if not raw:
            _check_count_at_end(job.steering, index)
            return index
        (line,) = split_lines(raw, "<stdin>", first=index + 1)  # invalid UTF-8: a DataError
        this = _steering_of(job.steering, index)
        search = job.request.search
        (item,) = job.translator.translate([line], job.decoding, search, steering=this)
        sink.write("".join(row + "\n" for row in job.finish(index, line, item)))
        sink.flush()
        index += 1


def _check_count_at_end(steering: Steering | None, count: int) -> None:
    """Streamed input ended: a prefix or constraints file must not have had more lines."""
    if steering is None:
        return
    for name, rows in (("--prefix", steering.prefixes), ("--constraints", steering.constraints)):
        if rows is not None and len(rows) != count:
            raise DataError(
                f"{name} has {len(rows)} lines but the input had {count}; give one line per "
                f"input line (an empty line for none)"
            )


def _steering_of(steering: Steering | None, index: int) -> Steering | None:
    """Line ``index``'s prefix and constraints, from files that must have that line."""
    if steering is None:
        return None
    for name, rows in (("--prefix", steering.prefixes), ("--constraints", steering.constraints)):
        if rows is not None and index >= len(rows):
            raise DataError(
                f"{name} has {len(rows)} lines but input line {index + 1} arrived; give one "
                f"line per input line (an empty line for none)"
            )
    return steering.subset([index])
