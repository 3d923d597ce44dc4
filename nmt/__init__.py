"""nmt: attention-based RNN encoder-decoder machine translation.

The Python API: ``nmt.load(run)`` returns a model with ``translate``, ``score`` and ``align``
(nmt.api).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from nmt.api import Model

__version__ = "0.1.0"


def load(
    model: str | Path | Sequence[str | Path],
    device: str = "auto",
    precision: str = "auto",
    backend: Literal["torch", "onnxruntime"] = "torch",
) -> Model:
    """A run directory or checkpoint (or a list of them: an ensemble), or with
    ``backend="onnxruntime"`` a directory of `nmt export`, ready to translate (and, from a
    checkpoint, to score); see nmt.api. Importing nmt stays light: torch loads on the first
    call."""
    from nmt.api import load as load_model

    return load_model(model, device, precision, backend)
