"""The body of `nmt score`: forced scores of given translations, one output line per pair,
and n-best rescoring (the TSV of `nmt translate --n-best` with a score column added)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt import checkpoint
from nmt.commands.progress import progress_bar
from nmt.commands.translate import decoding_options, write_attention
from nmt.decoding.alignment import link_cells, parse_links, piece_words
from nmt.decoding.scoring import Scored
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, check_output, read_lines, write_lines


@dataclass
class Pairs:
    """What to score: sources and targets, line for line, and for n-best input the rows to
    write back (each with the score appended)."""

    sources: list[str]
    targets: list[str]
    rows: list[str] | None = None
    source_index: list[int] | None = None


def read_pairs_given(
    input_path: str | None, target_path: str | None, tsv: str | None, n_best: str | None
) -> Pairs:
    """-i SRC -t TRG, --tsv FILE (- for stdin), or -i SRC --n-best FILE; none: TSV on stdin."""
    if n_best is not None:
        if input_path is None or target_path is not None or tsv is not None:
            raise ConfigError(
                "--n-best rescoring reads the sources from -i SRC: give -i and --n-best only"
            )
        return _read_n_best(input_path, n_best)
    if tsv is not None or (input_path is None and target_path is None):
        if input_path is not None or target_path is not None:
            raise ConfigError("give either -i SRC -t TRG or --tsv FILE, not both")
        return _read_tsv(tsv or STDIN)
    if input_path is None or target_path is None:
        missing = "-t TRG" if target_path is None else "-i SRC"
        raise ConfigError(f"give the sources and the targets: {missing} is missing (or use --tsv)")
    sources, targets = read_lines(input_path), read_lines(target_path)
    if len(sources) != len(targets):
        raise DataError(
            f"-i {input_path} has {len(sources)} lines but -t {target_path} has {len(targets)}; "
            f"scoring needs one target line per source line"
        )
    return Pairs(sources, targets)


def _name(path: str) -> str:
    return "stdin" if path == STDIN else path


def _read_tsv(path: str) -> Pairs:
    sources, targets = [], []
    for n, line in enumerate(read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(
                f"{_name(path)} line {n}: expected source<TAB>target, found {len(fields)} "
                f"tab-separated fields"
            )
        sources.append(fields[0])
        targets.append(fields[1])
    return Pairs(sources, targets)


def _read_n_best(input_path: str, n_best: str) -> Pairs:
    """Rows `index<TAB>rank<TAB>score<TAB>text` (nmt translate --n-best), index 0-based into
    the source lines."""
    sources = read_lines(input_path)
    pairs = Pairs([], [], [], [])
    for n, line in enumerate(read_lines(n_best), start=1):
        fields = line.split("\t")
        if len(fields) != 4 or not (fields[0].isascii() and fields[0].isdigit()):
            raise DataError(
                f"{_name(n_best)} line {n}: expected index<TAB>rank<TAB>score<TAB>text as "
                f"nmt translate --n-best writes it"
            )
        index = int(fields[0])
        if index >= len(sources):
            raise DataError(
                f"{_name(n_best)} line {n}: source index {index}, but -i {input_path} has "
                f"{len(sources)} lines (indices start at 0)"
            )
        pairs.sources.append(sources[index])
        pairs.targets.append(fields[3])
        assert pairs.rows is not None and pairs.source_index is not None
        pairs.rows.append(line)
        pairs.source_index.append(index)
    return pairs


def format_scored(translator: Translator, target: str, result: Scored | None, tokens: bool) -> str:
    """`log P<TAB>score`, with --tokens also the per-piece log-probabilities and the pieces
    (EOS last, as `</s>`); empty fields for an empty source."""
    if result is None:
        return "\t\t\t" if tokens else "\t"
    line = f"{result.log_prob:.4f}\t{result.score:.4f}"
    if tokens:
        (ids,) = translator.tokenizer.encode_trg([target])
        pieces = [*translator.tokenizer.trg_pieces(ids), "</s>"]
        values = " ".join(f"{v:.4f}" for v in result.token_log_probs)
        line += f"\t{values}\t{' '.join(pieces)}"
    return line


def _reference_links(
    path: Path | None, attention_dir: Path | None, sources: list[str], targets: list[str]
) -> list[tuple[set[tuple[int, int]], set[tuple[int, int]]]] | None:
    """The --align-ref file's (sure, possible) links per pair, checked against the pairs'
    words before anything is scored or written."""
    if path is None:
        return None
    if attention_dir is None:
        raise ConfigError("--align-ref outlines links on heatmaps: give --attention-dir too")
    lines = read_lines(path)
    if len(lines) != len(sources):
        raise DataError(
            f"--align-ref {path} has {len(lines)} lines but there are {len(sources)} pairs; "
            f"give the reference alignment of these pairs"
        )
    links = []
    rows = zip(lines, sources, targets, strict=True)
    for number, (line, source, target) in enumerate(rows, start=1):
        where = f"--align-ref {path} line {number}"
        try:
            sure, possible = parse_links(line, where)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        words = (len(source.split()), len(target.split()))
        for i, j in sorted(sure | possible):
            if i >= words[0] or j >= words[1]:
                raise DataError(
                    f"{where}: link {i}-{j} is outside the pair's {words[0]} source and "
                    f"{words[1]} target words; the reference is of other text"
                )
        links.append((sure, possible))
    return links


def score_command(
    models: Sequence[Path],
    input_path: str | None,
    target_path: str | None,
    tsv: str | None,
    n_best: str | None,
    output_path: str,
    decoding_overrides: dict[str, Any],
    tokens: bool = False,
    attention_dir: Path | None = None,
    device: str = "auto",
    precision: str = "auto",
    show_progress: bool = True,
    align_ref: Path | None = None,
) -> int:
    """`nmt score`: one line per pair (or the n-best rows with a score column), written only
    when every pair is scored; with ``align_ref``, the heatmaps outline its links."""
    if tokens and n_best is not None:
        raise ConfigError(
            "--tokens does not apply to --n-best rescoring, which adds one score column"
        )
    if output_path != STDIN:
        given = {"-i": input_path, "-t": target_path, "--tsv": tsv, "--n-best": n_best}
        inputs: dict[str, Any] = {k: Path(v) for k, v in given.items() if v not in (None, STDIN)}
        inputs["--model"] = [checkpoint.resolve(m) for m in models]
        check_output(Path(output_path), "--output", inputs)
    if attention_dir is not None and attention_dir.exists() and not attention_dir.is_dir():
        raise DataError(f"--attention-dir {attention_dir}: is a file; give a directory")
    pairs = read_pairs_given(input_path, target_path, tsv, n_best)
    references = _reference_links(align_ref, attention_dir, pairs.sources, pairs.targets)
    translator = Translator.from_checkpoints(models, device, precision)
    decoding = decoding_options(translator, decoding_overrides)
    reading_file = STDIN not in (input_path, target_path, tsv, n_best) and pairs.sources
    with progress_bar(len(pairs.sources), show_progress and bool(reading_file)) as advance:
        results = translator.score(
            pairs.sources, pairs.targets, decoding, attention_dir is not None, advance
        )
    out = []
    for index, (target, result) in enumerate(zip(pairs.targets, results, strict=True)):
        if pairs.rows is not None:
            score = f"{result.score:.4f}" if result is not None else ""
            out.append(f"{pairs.rows[index]}\t{score}")
        else:
            out.append(format_scored(translator, target, result, tokens))
        if attention_dir is not None and result is not None and result.alphas is not None:
            tokenizer = translator.tokenizer
            (src_ids,) = tokenizer.encode_src([pairs.sources[index]])
            (trg_ids,) = tokenizer.encode_trg([target])
            cells: list[tuple[int, int, bool]] = []
            if references is not None:
                sure, possible = references[index]
                src_words = piece_words(tokenizer.src, pairs.sources[index])
                trg_words = piece_words(tokenizer.trg, target)
                cells = link_cells(sure, possible, src_words, trg_words)
            write_attention(
                translator, attention_dir, index, src_ids, trg_ids, result.alphas, cells
            )
    write_lines(output_path, out)
    return len(out)
