"""The body of `nmt eval`, in three modes: score hypothesis files against references, translate
a split of the run's own data with the model and score it (``--model``), or score an
alignment file against reference links (``--align``). Scoring files needs no torch: the other
modes import what they run when they run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nmt import evaluate
from nmt.config import DataConfig
from nmt.data.corpus import local_files, read_pairs
from nmt.decoding.options import KEYS, Naming, decoding_options
from nmt.errors import ConfigError, DataError
from nmt.files import check_one_stdin, write_lines

if TYPE_CHECKING:
    from nmt.commands.align import AlignmentReport
    from nmt.commands.common import Models


@dataclass(frozen=True)
class EvalRequest:
    """What `nmt eval` is asked: hypothesis files with references (one system each), or the
    models with a split of their run's data, or an alignment file with reference links; and
    how to report."""

    hypotheses: Sequence[Path] = ()
    references: Sequence[Path] = ()
    models: Models | None = None  # translate ``split`` instead of reading hypotheses
    split: str = "test"  # dev, test, train or a data.eval_splits name
    decoding: Mapping[str, object] = field(default_factory=dict)  # with models: keys to override
    save_hypotheses: Path | None = None  # with models: write the translations here
    significance: str = "bootstrap"  # bootstrap, ar or none: paired, against the first system
    align: Path | None = None  # a Pharaoh file to score against align_ref instead
    align_ref: Path | None = None
    align_src: Path | None = None  # with align: the texts the links index (content words)
    align_trg: Path | None = None
    show_progress: bool = True
    naming: Naming = KEYS  # the caller's names of the fields, for errors in its words


SIGNIFICANCE = ("bootstrap", "ar", "none")


def evaluate_command(request: EvalRequest) -> evaluate.Report | AlignmentReport:
    """`nmt eval`: the report of the mode the request names (a table or JSON to print)."""
    naming = request.naming
    if request.significance not in SIGNIFICANCE:
        raise ConfigError(
            f"{naming('significance')} {request.significance!r}: expected one of "
            f"{', '.join(SIGNIFICANCE)}"
        )
    unused = [naming(key) for key, value in request.decoding.items() if value is not None]
    unused += [naming("save_hypotheses")] if request.save_hypotheses is not None else []
    if request.models is None and unused:
        raise ConfigError(
            f"{', '.join(unused)}: for the translation of {naming('model')} RUN; give "
            f"{naming('model')}, or drop {'them' if len(unused) > 1 else 'it'}"
        )
    check_one_stdin(
        {
            "HYPOTHESES": request.hypotheses,
            "--ref": request.references,
            "--align": request.align,
            "--align-ref": request.align_ref,
            "--align-src": request.align_src,
            "--align-trg": request.align_trg,
        }
    )
    if request.align is not None or request.align_ref is not None:
        alone = not request.hypotheses and request.models is None
        if request.align is None or request.align_ref is None or not alone:
            raise ConfigError("give --align HYP with --align-ref GOLD (and no other systems)")
        from nmt.commands.align import evaluate_alignments

        return evaluate_alignments(
            request.align, request.align_ref, request.align_src, request.align_trg
        )
    if request.models is not None:
        if request.hypotheses:
            raise ConfigError("give either hypothesis files or --model, not both")
        return evaluate_split(request.models, request)
    if not request.hypotheses or not request.references:
        raise ConfigError("give hypothesis file(s) and --ref, or --model RUN --split test")
    test = None if request.significance == "none" else request.significance
    hypotheses, references = list(request.hypotheses), list(request.references)
    return evaluate.score_files(hypotheses, references, significance=test)


def evaluate_split(models: Models, request: EvalRequest) -> evaluate.Report:
    """Translate a split (dev, test, train or a data.eval_splits name) of the first run's own
    data with the models (several: their ensemble) and score it, decoding as `nmt translate`
    does."""
    from nmt.commands.common import check_writes, progress_bar

    out = request.save_hypotheses
    if out is not None:
        check_writes("--save-hypotheses", out, {"--model": models.files()})
    translator = models.open()
    data = translator.config.data
    split = request.split
    named = {"dev": data.dev, "test": data.test, "train": data.train, **data.eval_splits}
    if split not in named:
        more = "".join(f", {name}" for name in data.eval_splits)
        raise ConfigError(
            f"--split {split!r}: the run's config has dev, test{more} and train (more test "
            f"sets go under data.eval_splits), or score your own files: nmt eval HYP --ref REF"
        )
    where = named[split]
    key = f"data.eval_splits.{split}" if split in data.eval_splits else f"data.{split}"
    if where is None:
        raise ConfigError(
            f"--split {split}: the run's config has no data.{split}; use --split dev, or "
            f"score your own files: nmt eval HYP --ref REF"
        )
    if out is not None and data.format != "hub":
        inputs = {f"{key} file": path for path in local_files(data, where)}
        check_writes("--save-hypotheses", out, inputs)
    sources, references = _read_split(data, where, key)
    decoding = decoding_options(translator.config.decoding, request.decoding)
    with progress_bar(len(sources), request.show_progress) as advance:
        results = translator.translate(sources, decoding, progress=advance)
    hyps = [translator.best_text(result) for result in results]
    if out is not None:
        write_lines(out, hyps)
    name = f"{'+'.join(Path(m).name for m in models.paths)}:{split} (beam {decoding.beam_size})"
    report = evaluate.score({name: hyps}, [references])
    plan = translator.last_plan or translator.plan(decoding, [])
    return dataclasses.replace(report, decoding_plan=plan.as_dict())


def _read_split(data: DataConfig, where: str, key: str) -> tuple[list[str], list[str]]:
    """The split's sources and references; a path that is not there is the run's config's,
    relative to where nmt train ran."""
    try:
        rows = read_pairs(data, where)
    except DataError as exc:
        advice = f"; fix {key} in the config"
        if not str(exc).endswith(advice):
            raise
        raise DataError(
            str(exc).removesuffix(advice) + "; the path is from the run's config: run nmt eval "
            "from the folder nmt train ran in"
        ) from None
    return list(rows["src"]), list(rows["trg"])
