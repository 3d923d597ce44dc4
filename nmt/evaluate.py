"""Corpus-level BLEU, chrF and TER through sacrebleu, with paired significance tests.

Every number comes from sacrebleu's own metric objects with their default settings,
so a score here equals what the ``sacrebleu`` command line prints for the same files
(tokenizer 13a for BLEU, chrF2, case-insensitive TER). Significance tests use
sacrebleu's ``PairedTest``; the first system is the baseline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.metrics.base import Metric
from sacrebleu.significance import PairedTest

from nmt.errors import ConfigError, DataError
from nmt.files import read_lines

METRICS: dict[str, Callable[..., Metric]] = {"bleu": BLEU, "chrf": CHRF, "ter": TER}
"""The metrics this module knows, by the names used on sacrebleu's command line."""

SIGNIFICANCE_TESTS: dict[str, str] = {"bootstrap": "bs", "ar": "ar"}
"""Our names for sacrebleu's paired tests: bootstrap resampling, approximate randomization."""

_HEADERS: dict[str, str] = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}
_TEST_NAMES: dict[str, str] = {
    "bootstrap": "bootstrap resampling",
    "ar": "approximate randomization",
}


@dataclass(frozen=True)
class SystemScore:
    """Corpus scores of one system.

    Attributes:
        name: The system's name (the file name for ``score_files``).
        bleu: Corpus BLEU, or None when BLEU was not requested.
        chrf: Corpus chrF2, or None when chrF was not requested.
        ter: Corpus TER, or None when TER was not requested.
        bleu_detail: sacrebleu's full BLEU line (precisions, BP, ratio, lengths).
        p_bleu: p-value of the BLEU difference to the baseline; None for the baseline
            and when no significance test ran. Likewise ``p_chrf`` and ``p_ter``.
    """

    name: str
    bleu: float | None
    chrf: float | None
    ter: float | None
    bleu_detail: str = ""
    p_bleu: float | None = None
    p_chrf: float | None = None
    p_ter: float | None = None

    def metric(self, name: str) -> float | None:
        """The score of metric ``name`` ("bleu", "chrf" or "ter")."""
        return getattr(self, name)

    def p_value(self, name: str) -> float | None:
        """The p-value of metric ``name`` against the baseline, if any."""
        return getattr(self, f"p_{name}")


@dataclass(frozen=True)
class Report:
    """Scores of one or more systems on the same references.

    Attributes:
        systems: One entry per system, the baseline first.
        signatures: sacrebleu's reproducibility signature for each metric computed
            ("bleu", "chrf", "ter").
        n_segments: The number of lines scored.
        significance: The paired test that produced the p-values, if any.
        decoding_plan: How the hypotheses were decoded (``nmt eval --model``): the
            decoding plan's fields and its line (``nmt.decoding.plan``).
    """

    systems: list[SystemScore]
    signatures: dict[str, str]
    n_segments: int
    significance: str | None = None
    decoding_plan: dict[str, object] | None = None

    def to_json(self) -> str:
        """The report as JSON with sorted keys and two-space indentation."""
        return json.dumps(asdict(self), sort_keys=True, indent=2, ensure_ascii=False)

    def to_table(self) -> str:
        """A plain aligned text table, one row per system, signatures below."""
        names = [m for m in METRICS if m in self.signatures]
        with_p = any(s.p_value(m) is not None for s in self.systems for m in names)
        header = ["System"]
        for m in names:
            header += [_HEADERS[m], "p"] if with_p else [_HEADERS[m]]
        rows = [header] + [_table_row(s, names, with_p) for s in self.systems]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [_align(row, widths) for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        if with_p and self.significance:
            lines.append(
                f"p-values: paired {_TEST_NAMES[self.significance]} test "
                f"against the baseline {self.systems[0].name}"
            )
        lines.append(f"Segments: {self.n_segments}")
        if self.decoding_plan:
            lines.append(str(self.decoding_plan["line"]))
        lines += [f"{_HEADERS[m]} signature: {self.signatures[m]}" for m in names]
        return "\n".join(lines)


def _table_row(system: SystemScore, names: list[str], with_p: bool) -> list[str]:
    row = [system.name]
    for m in names:
        value = system.metric(m)
        row.append("-" if value is None else f"{value:.2f}")
        if with_p:
            p = system.p_value(m)
            row.append("-" if p is None else f"{p:.4f}")
    return row


def _align(row: list[str], widths: list[int]) -> str:
    cells = [row[0].ljust(widths[0])] + [
        c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
    ]
    return "  ".join(cells).rstrip()


def _check_lengths(
    systems: Mapping[str, Sequence[str]],
    references: Sequence[Sequence[str]],
    names: Mapping[str, str],
    ref_names: Sequence[str],
) -> int:
    """Check that all systems and reference streams have the same number of lines."""
    if not systems:
        raise DataError("no system output given to score")
    if not references:
        raise DataError("no reference given to score against")
    n_ref = len(references[0])
    for label, ref in zip(ref_names[1:], references[1:], strict=True):
        if len(ref) != n_ref:
            raise DataError(
                f"{label} has {len(ref)} lines but {ref_names[0]} has {n_ref}; "
                "all references must align line by line"
            )
    for sys_name, hyps in systems.items():
        if len(hyps) != n_ref:
            raise DataError(
                f"{names.get(sys_name, sys_name)} has {len(hyps)} lines but {ref_names[0]} "
                f"has {n_ref}; hypotheses and references must align line by line"
            )
    if n_ref == 0:
        raise DataError(f"{ref_names[0]} has no lines to score")
    return n_ref


def _make_metrics(metrics: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, Metric]:
    """sacrebleu metric objects with default settings, reference statistics cached."""
    if not metrics:
        raise ConfigError("no metric requested; choose from bleu, chrf, ter")
    built: dict[str, Metric] = {}
    for name in metrics:
        key = name.lower()
        if key not in METRICS:
            raise ConfigError(f"unknown metric {name!r}; choose from bleu, chrf, ter")
        built[key] = METRICS[key](references=references)
    return built


@contextmanager
def _sacrebleu_seed(seed: int) -> Iterator[None]:
    """Temporarily set the seed that sacrebleu's significance tests read from the environment."""
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = previous


def _paired_p_values(
    systems: Mapping[str, Sequence[str]],
    metrics: dict[str, Metric],
    test: str,
    seed: int,
    n_samples: int,
) -> tuple[dict[str, str], dict[str, list[float | None]]]:
    """Run sacrebleu's PairedTest; return signatures and p-values per metric (baseline first)."""
    named: list[tuple[str, Sequence[str]]] = [(name, list(hyps)) for name, hyps in systems.items()]
    with _sacrebleu_seed(seed):
        paired = PairedTest(
            named, metrics, references=None, test_type=SIGNIFICANCE_TESTS[test], n_samples=n_samples
        )
        signatures, results = paired()
    # PairedTest keys its output by score name ("BLEU", "chrF2", ...) in our metric order.
    score_names = [k for k in results if k != "System"]
    sigs = {key: str(signatures[sn].format()) for key, sn in zip(metrics, score_names, strict=True)}
    p_values = {
        key: [r.p_value for r in results[sn]]  # type: ignore[union-attr]
        for key, sn in zip(metrics, score_names, strict=True)
    }
    return sigs, p_values


def score(
    systems: Mapping[str, Sequence[str]],
    references: Sequence[Sequence[str]],
    metrics: Sequence[str] = ("bleu", "chrf", "ter"),
    significance: str | None = None,
    seed: int = 12345,
    *,
    n_samples: int = 0,
    names: Mapping[str, str] | None = None,
    ref_names: Sequence[str] | None = None,
) -> Report:
    """Score one or more systems against one or more reference streams.

    Args:
        systems: System name -> hypothesis lines, the baseline first.
        references: Reference streams, each a list of lines as long as the hypotheses.
        metrics: Any of "bleu", "chrf", "ter".
        significance: None, "bootstrap" (paired bootstrap resampling) or "ar"
            (approximate randomization); only used with two or more systems.
        seed: Seed of the significance test (sacrebleu's command line uses 12345).
        n_samples: Resamples or trials of the test; 0 takes sacrebleu's defaults
            (1000 for bootstrap, 10000 for ar).
        names: System name -> file name, used in error messages.
        ref_names: File name of each reference stream, used in error messages.

    Returns:
        A Report with one SystemScore per system, in the order given.

    Raises:
        DataError: Line counts differ, or there is nothing to score.
        ConfigError: Unknown metric or significance test.
    """
    if significance is not None and significance not in SIGNIFICANCE_TESTS:
        raise ConfigError(
            f"unknown significance test {significance!r}; choose bootstrap or ar (or None: no test)"
        )
    if ref_names is not None and len(ref_names) != len(references):
        raise ValueError(f"{len(ref_names)} ref_names for {len(references)} reference streams")
    labels = list(ref_names or [f"reference {i + 1}" for i in range(len(references))])
    n_segments = _check_lengths(systems, references, names or {}, labels)
    built = _make_metrics(metrics, references)
    signatures = {key: str(m.get_signature().format()) for key, m in built.items()}
    p_values: dict[str, list[float | None]] = {}
    if significance is not None and len(systems) > 1:
        signatures, p_values = _paired_p_values(systems, built, significance, seed, n_samples)
    scored = [
        _system_score(name, hyps, built, {key: p[index] for key, p in p_values.items()})
        for index, (name, hyps) in enumerate(systems.items())
    ]
    used_test = significance if p_values else None
    return Report(scored, signatures, n_segments, significance=used_test)


def _system_score(
    name: str, hyps: Sequence[str], metrics: dict[str, Metric], p_values: dict[str, float | None]
) -> SystemScore:
    """Corpus scores of one system; ``p_values`` maps metric names to p-values."""
    values = {key: m.corpus_score(list(hyps), None) for key, m in metrics.items()}
    return SystemScore(
        name=name,
        bleu=values["bleu"].score if "bleu" in values else None,
        chrf=values["chrf"].score if "chrf" in values else None,
        ter=values["ter"].score if "ter" in values else None,
        bleu_detail=str(values["bleu"]) if "bleu" in values else "",
        p_bleu=p_values.get("bleu"),
        p_chrf=p_values.get("chrf"),
        p_ter=p_values.get("ter"),
    )


def score_files(
    hyp_paths: Sequence[Path],
    ref_paths: Sequence[Path],
    metrics: Sequence[str] = ("bleu", "chrf", "ter"),
    significance: str | None = None,
    seed: int = 12345,
    *,
    n_samples: int = 0,
) -> Report:
    """Score hypothesis files against reference files; system names are the file names.

    The first hypothesis file is the baseline of the significance test. File names
    that occur twice (same name in different folders) fall back to the full path.

    Raises:
        DataError: A file is missing or not UTF-8, line counts differ, or two
            hypothesis paths are the same file.
    """
    hyp_paths = [Path(p) for p in hyp_paths]
    short = [p.name for p in hyp_paths]
    labels = [p.name if short.count(p.name) == 1 else str(p) for p in hyp_paths]
    if len(set(labels)) != len(labels):
        duplicate = next(label for label in labels if labels.count(label) > 1)
        raise DataError(f"{duplicate}: given twice as a hypothesis file")
    systems = {label: read_lines(p) for label, p in zip(labels, hyp_paths, strict=True)}
    references = [read_lines(Path(p)) for p in ref_paths]
    return score(
        systems,
        references,
        metrics,
        significance,
        seed,
        n_samples=n_samples,
        names={label: str(p) for label, p in zip(labels, hyp_paths, strict=True)},
        ref_names=[str(p) for p in ref_paths],
    )
