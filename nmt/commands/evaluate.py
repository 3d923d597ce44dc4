"""The body of `nmt eval --model`: translate a split of the run's own data and score it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nmt import checkpoint, evaluate
from nmt.commands.progress import progress_bar
from nmt.commands.translate import decoding_options
from nmt.data.corpus import local_files, read_pairs
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError
from nmt.files import atomic_write_text, check_output


def evaluate_split(
    models: Path | Sequence[Path],
    split: str,
    decoding_overrides: dict[str, Any],
    device: str = "auto",
    hypotheses_out: Path | None = None,
    show_progress: bool = True,
    precision: str = "auto",
) -> Any:
    """Translate a split (dev, test, train or a data.eval_splits name) of the first run's own data with the model (several:
    their ensemble) and score it, decoding as `nmt translate` does (``precision``:
    see ``nmt.fast.precision``)."""
    models = [models] if isinstance(models, Path) else list(models)
    if hypotheses_out is not None:
        resolved = [checkpoint.resolve(m) for m in models]
        check_output(hypotheses_out, "--save-hypotheses", {"--model": resolved})
    translator = Translator.from_checkpoints(models, device, precision)
    data = translator.config.data
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
    if hypotheses_out is not None and data.format != "hub":
        inputs = {f"{key} file": path for path in local_files(data, where)}
        check_output(hypotheses_out, "--save-hypotheses", inputs)
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
    sources, references = list(rows["src"]), list(rows["trg"])
    decoding = decoding_options(translator, decoding_overrides)
    with progress_bar(len(sources), show_progress) as advance:
        results = translator.translate(sources, decoding, progress=advance)
    hyps = [translator.detokenize(r.hypotheses[0]) if r.hypotheses else "" for r in results]
    if hypotheses_out is not None:
        atomic_write_text(hypotheses_out, "".join(h + "\n" for h in hyps))
    name = f"{'+'.join(Path(m).name for m in models)}:{split} (beam {decoding.beam_size})"
    report = evaluate.score({name: hyps}, [references])
    decoded_in = f"{translator.precision} ({translator.precision_reason})"
    return dataclasses.replace(report, decoding_precision=decoded_in)
