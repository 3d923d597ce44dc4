"""The body of `nmt export`: a trained model as files that another runtime decodes, with the
tokenizer and config beside them, so that they load without the checkpoint. The ONNX format
(the only one) is the encoder and one decoder step as two graphs (``nmt.decoding.onnx``),
which `nmt translate --backend onnxruntime` searches (``nmt.decoding.exported``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nmt import checkpoint
from nmt.decoding.exported import (
    CONFIG,
    ENCODER,
    JOINT_TOKENIZER,
    METADATA,
    SPLIT_TOKENIZER,
    STEP,
    Metadata,
    require,
)
from nmt.decoding.onnx import export_onnx
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError, DataError, listed
from nmt.files import atomic_directory

FORMATS = ("onnx",)
QUANTIZATIONS = ("int8",)
# Every file an export writes, whichever its tokenizer: all that replacing one may delete.
EXPORTED = {METADATA, CONFIG, ENCODER, STEP, *JOINT_TOKENIZER, *SPLIT_TOKENIZER}


@dataclass(frozen=True)
class ExportRequest:
    """What `nmt export` is asked: the run (a run directory, its best.pt, or a checkpoint
    file), the directory to write (new, empty, or an earlier export, which is replaced) and
    the format."""

    run: Path
    output: Path
    format: str = "onnx"
    quantize: str | None = None  # "int8": the graphs' weights as int8 (nmt.decoding.onnx)


def export_command(request: ExportRequest) -> Metadata:
    """Export the run's model into ``request.output``, written whole or not at all (a failed
    export leaves an earlier one as it was). Every user error (the run, the output, the
    format, a missing ``onnx`` extra, a model whose graphs differ from it) is one
    NMTError."""
    if request.format not in FORMATS:
        raise ConfigError(f"--format {request.format!r}: expected one of {', '.join(FORMATS)}")
    if request.quantize is not None and request.quantize not in QUANTIZATIONS:
        raise ConfigError(
            f"--quantize {request.quantize!r}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    source = checkpoint.resolve(Path(request.run), "nmt export")
    output = Path(request.output)
    check_output_directory(output, source)
    for package in ("onnx", "onnxruntime"):  # before the checkpoint is read
        require(package, "nmt export --format onnx")
    translator = Translator.from_checkpoint(source, "cpu", "fp32")
    assert translator.model is not None  # a checkpoint's model
    with atomic_directory(output) as staging:
        return export_onnx(
            translator.model,
            translator.tokenizer,
            translator.config,
            staging,
            str(source),
            request.quantize,
        )


def check_output_directory(output: Path, source: Path) -> None:
    """``-o`` can become the exported directory: a new folder in an existing one, an empty
    folder, or an earlier export that holds nothing else (replacing it deletes what it
    holds), and not the folder the checkpoint is read from."""
    option = f"--output {output}"
    if output.exists() and not output.is_dir():
        raise DataError(f"{option}: is a file; give a directory for the exported model")
    if output.is_dir():
        if source.resolve().is_relative_to(output.resolve()):
            raise DataError(
                f"{option}: holds the checkpoint {source} this command reads; give another "
                f"directory"
            )
        if any(output.iterdir()) and not (output / METADATA).is_file():
            raise DataError(
                f"{option}: a folder with other files in it; give a new or empty directory, "
                f"or an earlier export (which is replaced)"
            )
        foreign = sorted(path.name for path in output.iterdir() if path.name not in EXPORTED)
        if foreign:
            raise DataError(
                f"{option}: an earlier export with other files in it ({listed(foreign, 3)}), "
                f"which replacing it would delete; move them out or give another directory"
            )
    parent = output.absolute().parent
    if not parent.is_dir():
        raise DataError(f"{option}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise DataError(f"{option}: cannot write in {parent} (permission denied)")
