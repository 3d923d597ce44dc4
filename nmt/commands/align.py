"""The bodies of `nmt align` (word alignments from the attention while the model reads a
given translation) and `nmt eval --align` (alignments scored against a reference)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt import checkpoint
from nmt.commands.progress import progress_bar
from nmt.commands.score import read_pairs_given
from nmt.commands.translate import decoding_options
from nmt.decoding.alignment import (
    EXTRACTIONS,
    AlignmentScores,
    ReferenceLinks,
    extract_links,
    format_links,
    parse_links,
    piece_words,
    score_alignments,
)
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, check_output, read_lines, write_lines


def check_method(method: str, threshold: float) -> None:
    if method not in EXTRACTIONS:
        raise ConfigError(f"--extract {method!r}: expected one of {', '.join(EXTRACTIONS)}")
    if not 0.0 < threshold <= 1.0:
        raise ConfigError(f"--threshold {threshold}: expected a value in (0, 1]")


def align_pairs(
    translator: Translator,
    sources: Sequence[str],
    targets: Sequence[str],
    method: str = "argmax",
    threshold: float = 0.5,
    progress: Callable[[int], None] | None = None,
) -> list[list[tuple[int, int]]]:
    """Each pair's word links from the attention while the model reads the target (none
    where either side is empty)."""
    decoding = decoding_options(translator, {})
    results = translator.score(sources, targets, decoding, True, progress)
    out: list[list[tuple[int, int]]] = []
    for source, target, result in zip(sources, targets, results, strict=True):
        if result is None or result.alphas is None or not target.strip():
            out.append([])
            continue
        src_words = piece_words(translator.tokenizer.src, source)
        trg_words = piece_words(translator.tokenizer.trg, target)
        out.append(extract_links(result.alphas, src_words, trg_words, method, threshold))
    return out


def align_command(
    models: Sequence[Path],
    input_path: str | None,
    target_path: str | None,
    tsv: str | None,
    output_path: str,
    method: str = "argmax",
    threshold: float = 0.5,
    device: str = "auto",
    precision: str = "auto",
    show_progress: bool = True,
) -> int:
    """`nmt align`: one Pharaoh line per (source, target) pair (empty for an empty side)."""
    check_method(method, threshold)
    if output_path != STDIN:
        given = {"-i": input_path, "-t": target_path, "--tsv": tsv}
        inputs: dict[str, Any] = {k: Path(v) for k, v in given.items() if v not in (None, STDIN)}
        inputs["--model"] = [checkpoint.resolve(m) for m in models]
        check_output(Path(output_path), "--output", inputs)
    pairs = read_pairs_given(input_path, target_path, tsv, None)
    translator = Translator.from_checkpoints(models, device, precision)
    from_files = STDIN not in (input_path, target_path, tsv) and bool(pairs.sources)
    with progress_bar(len(pairs.sources), show_progress and from_files) as advance:
        links = align_pairs(translator, pairs.sources, pairs.targets, method, threshold, advance)
    lines = [format_links(row) for row in links]
    write_lines(output_path, lines)
    return len(lines)


@dataclass
class AlignmentReport:
    """`nmt eval --align`'s figures, as a table or JSON."""

    name: str
    scores: AlignmentScores

    def to_table(self) -> str:
        s = self.scores
        return (
            f"{'alignments':<28} {'precision':>9} {'recall':>7} {'AER':>7}\n"
            f"{self.name:<28} {100 * s.precision:>9.1f} {100 * s.recall:>7.1f} "
            f"{100 * s.aer:>7.1f}\n"
            f"{s.sentences} sentences, {s.links} links, {s.sure} sure and {s.possible} "
            f"possible reference links (Och & Ney 2003; percentages)"
        )

    def to_json(self) -> str:
        return json.dumps({"name": self.name, **self.scores.as_dict()}, indent=2)


def evaluate_alignments(hypotheses: Path, reference: Path) -> AlignmentReport:
    """Score a Pharaoh file against a reference with sure (i-j) and possible (i?j) links."""
    hyp_lines, ref_lines = read_lines(str(hypotheses)), read_lines(str(reference))
    if len(hyp_lines) != len(ref_lines):
        raise DataError(
            f"--align {hypotheses} has {len(hyp_lines)} lines but --align-ref {reference} has "
            f"{len(ref_lines)}; both need one line per sentence pair"
        )
    links, references = [], []
    for n, (hyp, ref) in enumerate(zip(hyp_lines, ref_lines, strict=True), start=1):
        try:
            sure, possible = parse_links(hyp, f"{hypotheses} line {n}")
            gold_sure, gold_possible = parse_links(ref, f"{reference} line {n}")
        except ValueError as exc:
            raise DataError(str(exc)) from None
        links.append(sure | possible)
        references.append(ReferenceLinks(gold_sure, gold_sure | gold_possible))
    return AlignmentReport(hypotheses.name, score_alignments(links, references))
