"""The body of `nmt translate`: lines in, exactly one output line (or n-best block) per line,
the attention of each translation on request, prefixes and constraints per line, and a
line-by-line mode for terminals and pipes. The request checks here are shared with the
Python API (nmt.api)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from nmt import checkpoint
from nmt.commands.progress import progress_bar
from nmt.config import DecodingConfig, from_dict
from nmt.decoding.alignment import format_links, hypothesis_links
from nmt.decoding.translator import Steered, Translation, Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, atomic_write_text, check_output, read_lines, write_lines
from nmt.plots import save_attention


def decoding_options(translator: Translator, overrides: dict[str, Any]) -> DecodingConfig:
    """The first model's decoding section with the given options (None: keep) applied and
    checked by the schema."""
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = {**translator.config.decoding.model_dump(), **given}
    return from_dict({"decoding": merged}, "decoding options").decoding


def check_request(
    decoding: DecodingConfig, n_best: int, constrained: bool, beam_given: bool
) -> None:
    """Options that cannot go together: more n-best than beam, constraints with greedy."""
    beam = f"--beam {decoding.beam_size}" + (
        "" if beam_given else " (the run's decoding.beam_size)"
    )
    if n_best > decoding.beam_size:
        raise ConfigError(
            f"--n-best {n_best} is larger than {beam}; a beam keeps at most that many "
            f"hypotheses: raise --beam or lower --n-best"
        )
    if constrained and decoding.beam_size < 2:
        raise ConfigError(
            f"--constraints needs a beam of 2 or more, got {beam}: greedy search cannot "
            f"place constraints; give --beam 5 (at least one more than the constraint pieces)"
        )


def prefix_ids(translator: Translator, prefixes: Sequence[str], where: str) -> list[list[int]]:
    """One prefix per line (empty: none) -> target ids; ``where`` names the file in errors."""
    return [
        translator.target_ids(text, f"{where} line {n}") if text.strip() else []
        for n, text in enumerate(prefixes, start=1)
    ]


def constraint_ids(
    translator: Translator, rows: Sequence[Sequence[str]], where: str
) -> list[list[list[int]]]:
    """Each line's phrases -> target ids per phrase."""
    out = []
    for n, phrases in enumerate(rows, start=1):
        ids = []
        for phrase in phrases:
            if not phrase.strip():
                raise DataError(f"{where} line {n}: an empty constraint phrase; remove it")
            ids.append(translator.target_ids(phrase, f"{where} line {n}"))
        out.append(ids)
    return out


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
) -> Steered | None:
    """The --prefix and --constraints files as ids; ``count``: the input's line count, which
    each must match (None: streamed input, checked line by line)."""
    if prefix_path is None and constraints_path is None:
        return None
    for option, path in (("--prefix", prefix_path), ("--constraints", constraints_path)):
        if path is not None and not path.is_file():
            raise DataError(f"{option} {path}: no such file")
    steered = Steered()
    if prefix_path is not None:
        texts = read_lines(str(prefix_path))
        _check_count(texts, count, f"--prefix {prefix_path}")
        steered.prefixes = prefix_ids(translator, texts, str(prefix_path))
    if constraints_path is not None:
        texts = read_lines(str(constraints_path))
        _check_count(texts, count, f"--constraints {constraints_path}")
        rows = parse_constraints(texts, str(constraints_path))
        steered.constraints = constraint_ids(translator, rows, str(constraints_path))
    return steered


def _check_count(lines: Sequence[str], count: int | None, option: str) -> None:
    if count is not None and len(lines) != count:
        raise DataError(
            f"{option} has {len(lines)} lines but the input has {count}; give one line per "
            f"input line (an empty line for none)"
        )


def _format(
    translator: Translator, index: int, item: Translation, n_best: int, scores: bool
) -> list[str]:
    if n_best > 1:
        rows = [
            f"{index}\t{rank}\t{hyp.score:.4f}\t{translator.detokenize(hyp)}"
            for rank, hyp in enumerate(item.hypotheses, start=1)
        ]
        return rows or [f"{index}\t1\t0.0000\t"]
    text = translator.detokenize(item.hypotheses[0]) if item.hypotheses else ""
    if scores:
        score = item.hypotheses[0].score if item.hypotheses else 0.0
        return [f"{score:.4f}\t{text}"]
    return [text]


def write_attention(
    translator: Translator,
    directory: Path,
    index: int,
    src_ids: list[int],
    trg_ids: list[int],
    alphas: Any,
    links: Sequence[tuple[int, int, bool]] = (),
) -> None:
    """Heatmap and raw matrix of one sentence's attention: alphas (|y|+1, |x|); ``links``
    (target piece, source piece, sure) outline reference links."""
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(src_ids)
    trg = [*tokenizer.trg_pieces(trg_ids), "</s>"]
    save_attention(directory / f"{index:06d}", src, trg, alphas.float().numpy(), links)


def _write_best_attention(
    translator: Translator, directory: Path, index: int, item: Translation
) -> None:
    if item.hypotheses and item.hypotheses[0].alphas is not None:
        best = item.hypotheses[0]
        write_attention(translator, directory, index, item.src_ids, best.tokens, best.alphas)


def translate_command(
    model: Path | Sequence[Path],
    input_path: str,
    output_path: str,
    decoding_overrides: dict[str, Any],
    n_best: int = 1,
    scores: bool = False,
    batch_tokens: int | None = None,
    device: str = "auto",
    attention_dir: Path | None = None,
    show_progress: bool = True,
    precision: str = "auto",
    prefix: Path | None = None,
    constraints: Path | None = None,
    unbuffered: bool = False,
    warn: Callable[[str], None] = lambda message: None,
    alignments: Path | None = None,
) -> int:
    """`nmt translate`: read lines, write exactly one output line (or n-best block) per line.

    Every user error (input, output path, checkpoints, options, prefix and constraint files)
    is raised before the output is touched; a file output is replaced atomically, so a failed
    run leaves an existing file as it was. A line whose constraints no output could meet
    gets an empty output line and a call of ``warn``. Line by line (each output written and
    flushed as its line arrives): ``unbuffered``, or input from a terminal. ``alignments``:
    a file for the word alignment of each output (Pharaoh, from its attention), written at
    the end.
    """
    model = [model] if isinstance(model, Path) else list(model)
    streaming = input_path == STDIN and (unbuffered or sys.stdin.isatty())
    if unbuffered and output_path != STDIN:
        raise ConfigError("--unbuffered writes each line to stdout as it is done: drop --output")
    inputs: dict[str, Path | Sequence[Path]] = {"--model": [checkpoint.resolve(m) for m in model]}
    if output_path != STDIN:
        if input_path != STDIN:
            inputs["--input"] = [Path(input_path)]
        for option, path in (("--prefix", prefix), ("--constraints", constraints)):
            if path is not None:
                inputs[option] = [path]
        check_output(Path(output_path), "--output", inputs)
    if alignments is not None:
        outputs = {"--output": [Path(output_path)]} if output_path != STDIN else {}
        check_output(alignments, "--alignments", {**inputs, **outputs})
    if attention_dir is not None and attention_dir.exists() and not attention_dir.is_dir():
        raise DataError(f"--attention-dir {attention_dir}: is a file; give a directory")
    lines = None if streaming else read_lines(input_path)
    translator = Translator.from_checkpoints(model, device, precision)
    decoding = decoding_options(translator, decoding_overrides)
    check_request(
        decoding, n_best, constraints is not None, bool(decoding_overrides.get("beam_size"))
    )
    steered = read_steering(translator, prefix, constraints, None if lines is None else len(lines))
    attention = attention_dir is not None or alignments is not None
    if lines is None:
        links: list[str] = []
        count = _stream(
            translator, decoding, n_best, scores, attention_dir, steered, warn, links, attention
        )
        if alignments is not None:
            atomic_write_text(alignments, "".join(line + "\n" for line in links))
        return count
    with progress_bar(len(lines), show_progress and input_path != STDIN) as advance:
        results = translator.translate(
            lines, decoding, n_best, attention, batch_tokens, advance, steered
        )
    out_lines, link_lines = [], []
    for index, item in enumerate(results):
        out_lines.extend(_format(translator, index, item, n_best, scores))
        if attention_dir is not None:
            _write_best_attention(translator, attention_dir, index, item)
        if alignments is not None:
            link_lines.append(_links(translator, lines[index], item, decoding))
        _warn_unmet(lines[index], item, index, steered, warn)
    write_lines(output_path, out_lines)
    if alignments is not None:
        atomic_write_text(alignments, "".join(line + "\n" for line in link_lines))
    return len(lines)


def _links(translator: Translator, line: str, item: Translation, decoding: DecodingConfig) -> str:
    """The Pharaoh line of the best output's word alignment (empty without an output): from
    the alignment heads, re-reading the output, where the models have them, else from the
    search's attention."""
    if not item.hypotheses:
        return ""
    best = item.hypotheses[0]
    weights = best.alphas
    if translator.has_alignment_head:
        weights = translator.head_alignment(item.src_ids, best.tokens, decoding)
    return format_links(hypothesis_links(translator.tokenizer, line, best.tokens, weights))


def _warn_unmet(
    line: str, item: Translation, index: int, steered: Steered | None, warn: Callable[[str], None]
) -> None:
    if line.strip() and not item.hypotheses and steered is not None:
        warn(
            f"input line {index + 1}: no output meets all its constraints within the length "
            f"limit (--no-repeat-ngram can forbid a constraint); its output line is empty"
        )


def _stream(
    translator: Translator,
    decoding: DecodingConfig,
    n_best: int,
    scores: bool,
    attention_dir: Path | None,
    steered: Steered | None,
    warn: Callable[[str], None],
    links: list[str],
    attention: bool,
    source: TextIO | None = None,
    sink: TextIO | None = None,
) -> int:
    """Translate each line as it arrives and write its output at once (interactive use)."""
    source = source or sys.stdin
    sink = sink or sys.stdout
    index = 0
    while True:
        line = source.readline()
        if not line:
            _check_count_at_end(steered, index)
            return index
        line = line.rstrip("\n").rstrip("\r")
        this = _steering_of(steered, index)
        (item,) = translator.translate([line], decoding, n_best, attention, steered=this)
        sink.write("".join(row + "\n" for row in _format(translator, index, item, n_best, scores)))
        sink.flush()
        if attention_dir is not None:
            _write_best_attention(translator, attention_dir, index, item)
        _warn_unmet(line, item, index, this, warn)
        links.append(_links(translator, line, item, decoding))
        index += 1


def _check_count_at_end(steered: Steered | None, count: int) -> None:
    """Streamed input ended: a prefix or constraints file must not have had more lines."""
    if steered is None:
        return
    for name, rows in (("--prefix", steered.prefixes), ("--constraints", steered.constraints)):
        if rows is not None and len(rows) != count:
            raise DataError(
                f"{name} has {len(rows)} lines but the input had {count}; give one line per "
                f"input line (an empty line for none)"
            )


def _steering_of(steered: Steered | None, index: int) -> Steered | None:
    """Line ``index``'s prefix and constraints, from files that must have that line."""
    if steered is None:
        return None
    for name, rows in (("--prefix", steered.prefixes), ("--constraints", steered.constraints)):
        if rows is not None and index >= len(rows):
            raise DataError(
                f"{name} has {len(rows)} lines but input line {index + 1} arrived; give one "
                f"line per input line (an empty line for none)"
            )
    return steered.subset([index])
