"""The bodies of `nmt align` (word alignments from the attention while the model reads a
given translation) and `nmt eval --align` (alignments scored against a reference)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nmt.commands.common import Models, check_writes, progress_bar
from nmt.commands.score import read_pairs_given
from nmt.decoding.alignment import (
    EXTRACTIONS,
    THRESHOLD,
    AlignmentScores,
    ReferenceLinks,
    attention_links,
    content_links,
    content_reference,
    format_links,
    parse_links,
    score_alignments,
)
from nmt.decoding.options import KEYS, Naming
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, check_one_stdin, read_lines, write_lines
from nmt.function_words import FUNCTION_WORDS, content_mask

Link = tuple[int, int]


@dataclass(frozen=True)
class Extraction:
    """How word links are read from a model reading a translation: ``method`` (argmax,
    threshold, next, intersect or gdfa; ``nmt.decoding.alignment``), the least mass for
    threshold, and ``attention``: the attention even where the models have an alignment
    head (which is read by default). Errors name them ``extract``, ``threshold`` and
    ``attention``, or as ``naming`` says (`nmt align`'s flags, a request's fields)."""

    method: str = "argmax"
    threshold: float | None = None  # None: THRESHOLD, for the threshold method alone
    attention: bool = False

    def check(self, naming: Naming = KEYS) -> None:
        """A known method, and a threshold in (0, 1] (NaN is not), given with the threshold
        method alone (no other reads it)."""
        if self.method not in EXTRACTIONS:
            raise ConfigError(
                f"{naming('extract')} {self.method!r}: expected one of {', '.join(EXTRACTIONS)}"
            )
        if self.threshold is None:
            return
        if self.method != "threshold":
            raise ConfigError(
                f"{naming('threshold')} {self.threshold}: only {naming('extract')} threshold "
                f"reads it (not {self.method}); give both, or neither"
            )
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"{naming('threshold')} {self.threshold}: expected a value in (0, 1]")

    @property
    def mass(self) -> float:
        """The least attention mass of a threshold link: as given, else THRESHOLD."""
        return THRESHOLD if self.threshold is None else self.threshold

    def check_head(self, translator: Translator, naming: Naming = KEYS) -> None:
        """``next`` reads the attention's following step; a head aligns each word at its own
        step."""
        if self.method == "next" and translator.has_alignment_head and not self.attention:
            raise ConfigError(
                f"{naming('extract')} next: the model's alignment head aligns each word at its "
                f"own step; use argmax or threshold, or {naming('attention')} to align with "
                f"the attention"
            )


@dataclass(frozen=True)
class AlignRequest:
    """What `nmt align` is asked: the models, the pairs (-i SRC -t TRG, or --tsv FILE; none
    of them: TSV on stdin), the output and how links are read."""

    models: Models
    input: str | None = None
    target: str | None = None
    tsv: str | None = None
    output: str = STDIN
    extraction: Extraction = Extraction()
    show_progress: bool = True
    naming: Naming = KEYS  # the CLI's: its flags


def align_pairs(
    translator: Translator,
    sources: Sequence[str],
    targets: Sequence[str],
    extraction: Extraction = Extraction(),
    progress: Callable[[int], None] | None = None,
) -> list[list[Link]]:
    """Each pair's word links while the model reads the target (none where either side is
    empty): from its alignment head if it has one and not ``extraction.attention``, else
    from its attention."""
    extraction.check_head(translator)
    links, _ = attention_links(
        translator,
        sources,
        targets,
        translator.config.decoding,
        extraction.method,
        extraction.mass,
        progress,
        extraction.attention,
    )
    return links


def align_command(request: AlignRequest, say: Callable[[str], None] = lambda message: None) -> int:
    """`nmt align`: one Pharaoh line per (source, target) pair (empty for an empty side);
    ``say`` hears, at the end, the decoding plan's line (``nmt.decoding.plan``)."""
    request.extraction.check(request.naming)
    read = {"-i": request.input, "-t": request.target, "--tsv": request.tsv}
    check_one_stdin(read)
    check_writes("--output", request.output, {**read, "--model": request.models.files()})
    pairs = read_pairs_given(request.input, request.target, request.tsv, None)
    translator = request.models.open()
    request.extraction.check_head(translator, request.naming)
    texts = (request.input, request.target, request.tsv)
    enabled = request.show_progress and bool(pairs.sources)
    with progress_bar(len(pairs.sources), enabled, texts) as advance:
        links = align_pairs(translator, pairs.sources, pairs.targets, request.extraction, advance)
    lines = [format_links(row) for row in links]
    write_lines(request.output, lines)
    decoding = translator.config.decoding
    say((translator.last_plan or translator.plan(decoding, forced=True)).line())
    return len(lines)


@dataclass
class AlignmentReport:
    """`nmt eval --align`'s figures (all words, and content words when the texts are
    given), as a table or JSON."""

    name: str
    scores: AlignmentScores
    content: AlignmentScores | None = None
    skipped: int = 0  # pairs without reference links (left out of both figures)

    def to_table(self) -> str:
        rows = [("all words", self.scores)]
        if self.content is not None:
            rows.append(("content words", self.content))
        lines = [f"{self.name:<28} {'precision':>9} {'recall':>7} {'AER':>7}"]
        for label, s in rows:
            lines.append(
                f"{label:<28} {100 * s.precision:>9.1f} {100 * s.recall:>7.1f} {100 * s.aer:>7.1f}"
            )
        s = self.scores
        skipped = f"; {self.skipped} without reference links left out" if self.skipped else ""
        lines.append(
            f"{s.sentences} sentences{skipped}, {s.links} links, {s.sure} sure and "
            f"{s.possible} possible reference links (Och & Ney 2003; percentages)"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        report: dict[str, object] = {"name": self.name, **self.scores.as_dict()}
        report["skipped"] = self.skipped
        if self.content is not None:
            report["content_words"] = self.content.as_dict()
        return json.dumps(report, indent=2)


def _parse(path: Path, line: str, n: int) -> tuple[set[Link], set[Link]]:
    try:
        return parse_links(line, f"{path} line {n}")
    except ValueError as exc:
        raise DataError(str(exc)) from None


def _language(path: Path, option: str) -> str:
    """The language of a text file from its name (``test.es.gz`` -> es)."""
    suffixes = [s.lstrip(".") for s in path.suffixes if s != ".gz"]
    language = suffixes[-1] if suffixes else ""
    if language not in FUNCTION_WORDS:
        known = ", ".join(sorted(FUNCTION_WORDS))
        raise DataError(
            f"{option} {path}: content words need the language in the file name ({known}: "
            f"e.g. test.es), found {language or 'none'}"
        )
    return language


def _texts(source: Path, target: Path, count: int) -> list[tuple[list[bool], list[bool]]]:
    """Each pair's content-word masks, from the texts the links index."""
    masks = []
    sides = []
    for path, option in ((source, "--align-src"), (target, "--align-trg")):
        lines = read_lines(path)
        if len(lines) != count:
            raise DataError(
                f"{option} {path} has {len(lines)} lines but the alignments have {count}; "
                f"give the texts the alignments index"
            )
        language = _language(path, option)
        sides.append([content_mask(line.split(), language) for line in lines])
    for src, trg in zip(*sides, strict=True):
        masks.append((src, trg))
    return masks


def _check_range(links: set[Link], mask: tuple[list[bool], list[bool]], where: str) -> None:
    for i, j in sorted(links):
        if i >= len(mask[0]) or j >= len(mask[1]):
            raise DataError(
                f"{where}: link {i}-{j} is outside the sentence pair ({len(mask[0])} source and "
                f"{len(mask[1])} target tokens); the alignments and texts do not match"
            )


def evaluate_alignments(
    hypotheses: Path, reference: Path, source: Path | None = None, target: Path | None = None
) -> AlignmentReport:
    """Score a Pharaoh file against a reference with sure (i-j) and possible (i?j) links;
    with the source and target texts, also on content words only (``nmt.function_words``).

    A pair whose reference line is empty has no reference (the demo corpus's gold leaves out
    verses it cannot align) and is left out of every figure.
    """
    hyp_lines, ref_lines = read_lines(hypotheses), read_lines(reference)
    if len(hyp_lines) != len(ref_lines):
        raise DataError(
            f"--align {hypotheses} has {len(hyp_lines)} lines but --align-ref {reference} has "
            f"{len(ref_lines)}; both need one line per sentence pair"
        )
    if (source is None) != (target is None):
        raise DataError("content words need both --align-src and --align-trg")
    masks = _texts(source, target, len(ref_lines)) if source and target else None
    links, references, content_hyps, content_refs = [], [], [], []
    skipped = 0
    for n, (hyp, ref) in enumerate(zip(hyp_lines, ref_lines, strict=True), start=1):
        sure, possible = _parse(hypotheses, hyp, n)
        gold_sure, gold_possible = _parse(reference, ref, n)
        if not ref.strip():
            skipped += 1
            continue
        links.append(sure | possible)
        references.append(ReferenceLinks(gold_sure, gold_sure | gold_possible))
        if masks is not None:
            mask = masks[n - 1]
            _check_range(links[-1], mask, f"--align {hypotheses} line {n}")
            _check_range(references[-1].possible, mask, f"--align-ref {reference} line {n}")
            content_hyps.append(content_links(links[-1], mask))
            content_refs.append(content_reference(references[-1], mask))
    if not references:
        what = f"all {len(ref_lines)} of its lines are empty" if ref_lines else "it is empty"
        raise DataError(
            f"--align-ref {reference}: no reference links to score against ({what}); give "
            f"the gold alignment of the sentences in --align {hypotheses}"
        )
    content = score_alignments(content_hyps, content_refs) if masks is not None else None
    return AlignmentReport(hypotheses.name, score_alignments(links, references), content, skipped)
