"""The body of `nmt score`: forced scores of given translations, one output line per pair,
and n-best rescoring (the TSV of `nmt translate --n-best` with a score column added)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nmt.commands.common import (
    Heatmaps,
    Models,
    check_attention_dir,
    check_writes,
    open_heatmaps,
    progress_bar,
)
from nmt.decoding.alignment import link_cells, parse_links, piece_words
from nmt.decoding.options import decoding_options
from nmt.decoding.scoring import Scored
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, check_one_stdin, read_lines, write_lines

Links = tuple[set[tuple[int, int]], set[tuple[int, int]]]  # a pair's (sure, possible) links


@dataclass(frozen=True)
class ScoreRequest:
    """What `nmt score` is asked: the models, the pairs (-i SRC -t TRG, --tsv FILE, or -i SRC
    --n-best FILE; none of them: TSV on stdin), the output, the ``decoding`` keys to
    override (None: the run's value), and what to write besides the scores."""

    models: Models
    input: str | None = None
    target: str | None = None
    tsv: str | None = None
    n_best: str | None = None  # the TSV of `nmt translate --n-best` to rescore
    output: str = STDIN
    decoding: Mapping[str, object] = field(default_factory=dict)
    tokens: bool = False  # each piece's log-probability and the pieces
    attention_dir: Path | None = None  # the attention over each given target
    align_ref: Path | None = None  # reference links to outline on the heatmaps
    show_progress: bool = True


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
        pieces = translator.tokenizer.trg_pieces_and_eos(ids)
        values = " ".join(f"{v:.4f}" for v in result.token_log_probs)
        line += f"\t{values}\t{' '.join(pieces)}"
    return line


def _reference_links(
    path: Path | None, attention_dir: Path | None, sources: list[str], targets: list[str]
) -> list[Links] | None:
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


def score_command(request: ScoreRequest, say: Callable[[str], None] = lambda message: None) -> int:
    """`nmt score`: one line per pair (or the n-best rows with a score column), written only
    when every pair is scored; with ``align_ref``, the heatmaps outline its links. ``say``
    hears, at the end, the decoding plan's line (``nmt.decoding.plan``)."""
    if request.tokens and request.n_best is not None:
        raise ConfigError(
            "--tokens does not apply to --n-best rescoring, which adds one score column"
        )
    read = {
        "-i": request.input,
        "-t": request.target,
        "--tsv": request.tsv,
        "--n-best": request.n_best,
    }
    tsv = request.tsv or (None if any(read.values()) else STDIN)  # none given: TSV on stdin
    check_one_stdin({**read, "--tsv": tsv, "--align-ref": request.align_ref})
    check_writes("--output", request.output, {**read, "--model": request.models.files()})
    check_attention_dir(request.attention_dir)
    pairs = read_pairs_given(request.input, request.target, request.tsv, request.n_best)
    references = _reference_links(
        request.align_ref, request.attention_dir, pairs.sources, pairs.targets
    )
    translator = request.models.open()
    decoding = decoding_options(translator.config.decoding, request.decoding)
    texts = (request.input, request.target, request.tsv, request.n_best)
    enabled = request.show_progress and bool(pairs.sources)
    with progress_bar(len(pairs.sources), enabled, texts) as advance:
        attention = request.attention_dir is not None
        results = translator.score(pairs.sources, pairs.targets, decoding, attention, advance)
    heatmaps = open_heatmaps(translator, request.attention_dir)
    out = []
    for index, (target, result) in enumerate(zip(pairs.targets, results, strict=True)):
        if pairs.rows is not None:
            score = f"{result.score:.4f}" if result is not None else ""
            out.append(f"{pairs.rows[index]}\t{score}")
        else:
            out.append(format_scored(translator, target, result, request.tokens))
        if heatmaps is not None and result is not None:
            links = references[index] if references is not None else None
            _heatmap(heatmaps, index, pairs, result, links)
    write_lines(request.output, out)
    say((translator.last_plan or translator.plan(decoding, forced=True)).line())
    return len(out)


def _heatmap(
    heatmaps: Heatmaps, index: int, pairs: Pairs, result: Scored, links: Links | None
) -> None:
    """Pair ``index``'s attention over its target, with its reference ``links`` outlined."""
    if result.alphas is None:
        return
    tokenizer = heatmaps.translator.tokenizer
    source, target = pairs.sources[index], pairs.targets[index]
    (src_ids,) = tokenizer.encode_src([source])
    (trg_ids,) = tokenizer.encode_trg([target])
    cells: list[tuple[int, int, bool]] = []
    if links is not None:
        src_words = piece_words(tokenizer.src, source)
        trg_words = piece_words(tokenizer.trg, target)
        cells = link_cells(*links, src_words, trg_words)
    heatmaps.write(index, src_ids, trg_ids, result.alphas, cells)
