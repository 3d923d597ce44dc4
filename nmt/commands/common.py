"""What the decoding commands share: the models they open (``Models``: --model, --device,
--precision, --backend), the checks of what they will write, made before any work, the attention
heatmaps (``Heatmaps``), and the progress policy (a bar on stderr while files are read)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt import checkpoint
from nmt.decoding.exported import read_metadata
from nmt.decoding.options import Backend
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError, listed
from nmt.files import STDIN, check_output, standard_output


@dataclass(frozen=True)
class Models:
    """The models a command decodes with: run directories (their best.pt) or checkpoint
    files (several: an ensemble), the device and the precision (``nmt.fast.precision``); or,
    with the ``onnxruntime`` backend, one directory that `nmt export` wrote."""

    paths: Sequence[Path]
    device: str = "auto"
    precision: str = "auto"
    backend: Backend = "torch"

    def files(self) -> list[Path]:
        """The files the models are read from (a run directory: its best.pt; an exported
        directory: all of its files), which no output may replace."""
        if self.backend == "onnxruntime":
            self._check_one()
            directory = Path(self.paths[0])
            return [directory / name for name in read_metadata(directory).files()]
        return [checkpoint.resolve(Path(path)) for path in self.paths]

    def open(self) -> Translator:
        if self.backend == "onnxruntime":
            self._check_one()
            return Translator.from_exported(Path(self.paths[0]), self.device, self.precision)
        return Translator.from_checkpoints(self.paths, self.device, self.precision)

    def _check_one(self) -> None:
        if len(self.paths) != 1:
            raise ConfigError(
                f"--backend onnxruntime decodes one exported model, got {len(self.paths)} "
                f"--model; ensembles decode with the torch backend"
            )


def check_writes(
    option: str, output: str | Path, inputs: Mapping[str, str | Path | Sequence[Path] | None]
) -> None:
    """A file ``option`` writes (stdout: nothing to check) can be written and replaces none
    of ``inputs`` (option -> what it reads; stdin or None: no file), checked in that order.
    Stdout: open (``standard_output``)."""
    if output == STDIN:
        standard_output()
        return
    read: dict[str, Path | Sequence[Path]] = {}
    for name, given in inputs.items():
        if isinstance(given, str):
            if given != STDIN:
                read[name] = Path(given)
        elif given is not None:
            read[name] = given
    check_output(Path(output), option, read)


# What Heatmaps write into --attention-dir: NNNNNN.png/.npy/.json, and the temporary files
# of a write killed midway (``nmt.files.atomic_write_bytes``).
HEATMAP_FILE = re.compile(r"\.?\d{6,}\.(png|npy|json)(\.\w+\.tmp)?", re.ASCII)


def check_attention_dir(directory: Path | None) -> None:
    """--attention-dir is new, empty or holds only heatmaps (an earlier run's, which
    ``open_heatmaps`` removes): nothing else is in the way of this run's files."""
    if directory is None or not directory.exists():
        return
    if not directory.is_dir():
        raise DataError(f"--attention-dir {directory}: is a file; give a directory")
    foreign = sorted(p.name for p in directory.iterdir() if not HEATMAP_FILE.fullmatch(p.name))
    if foreign:
        raise DataError(
            f"--attention-dir {directory}: holds files nmt did not write there "
            f"({listed(foreign, 3)}); give a new or empty folder, or one of earlier heatmaps, "
            f"which are replaced"
        )


@dataclass(frozen=True)
class Heatmaps:
    """--attention-dir: per sentence, a heatmap PNG and the raw matrix (.npy, .json) named
    by its 0-based line number, with the pieces of the models' tokenizer as labels."""

    translator: Translator
    directory: Path

    def write(
        self,
        index: int,
        src_ids: list[int],
        trg_ids: list[int],
        alphas: Any,
        links: Sequence[tuple[int, int, bool]] = (),
    ) -> None:
        """Sentence ``index``'s attention, alphas (|y|+1, |x|); ``links`` (target piece,
        source piece, sure) outline reference links."""
        tokenizer = self.translator.tokenizer
        src = tokenizer.src_pieces(src_ids)
        trg = tokenizer.trg_pieces_and_eos(trg_ids)
        weights = alphas.float().numpy()
        from nmt.plots import save_attention  # matplotlib: imported only when drawn

        save_attention(self.directory / f"{index:06d}", src, trg, weights, links)


def open_heatmaps(translator: Translator, directory: Path | None) -> Heatmaps | None:
    """--attention-dir's heatmaps (None without it), an earlier run's removed first so that
    the folder holds this run's alone (``check_attention_dir`` has refused any other file)."""
    if directory is None:
        return None
    if directory.is_dir():
        for path in directory.iterdir():
            if HEATMAP_FILE.fullmatch(path.name):
                path.unlink()
    return Heatmaps(translator, directory)


@contextmanager
def progress_bar(
    total: int, enabled: bool, inputs: Sequence[str | None] = ()
) -> Iterator[Callable[[int], None] | None]:
    """A bar over ``total`` lines on stderr, gone when done; only when ``enabled``, with lines
    to count, and none of ``inputs`` is stdin (text piped in goes out as it comes)."""
    if not enabled or total == 0 or STDIN in inputs:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("translating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("translate", total=total)
        yield lambda n: bar.advance(task, n)
