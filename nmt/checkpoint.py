"""Self-describing checkpoints: written atomically (``nmt.files``), read back with checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nmt import __version__
from nmt.errors import CheckpointError
from nmt.files import atomic_write_bytes

FORMAT = 1  # bumped when the checkpoint layout changes incompatibly


def save(path: Path, state: dict[str, Any]) -> None:
    """Write a checkpoint; ``state`` gains the format and package version."""
    payload = {"format": FORMAT, "version": __version__, **state}
    atomic_write_bytes(path, lambda handle: torch.save(payload, handle))


def resolve(model: Path) -> Path:
    """A run directory (its best, else last checkpoint) or a checkpoint file."""
    model = Path(model)
    if model.is_dir():
        for name in ("best.pt", "last.pt"):
            if (model / name).is_file():
                return model / name
        raise CheckpointError(
            f"{model}: no best.pt or last.pt in this run directory; train it first or give "
            f"a checkpoint file to --model"
        )
    if not model.is_file():
        raise CheckpointError(
            f"{model}: no such checkpoint file or run directory; check the --model path"
        )
    return model


REQUIRED = ("model", "config", "tokenizer")  # what translate and eval need of a checkpoint


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint; truncated, foreign or incompatible files are CheckpointErrors."""
    path = resolve(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # torch raises several types for damaged files
        raise CheckpointError(
            f"{path}: cannot read checkpoint ({type(exc).__name__}); the file is truncated or "
            f"damaged: use another checkpoint of the run (best.pt, last.pt, step-*.pt)"
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path}: not an nmt checkpoint (no format field)")
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {state['format']!r} (written by nmt "
            f"{state.get('version', '?')}) is not readable by nmt {__version__}, which reads "
            f"format {FORMAT}; use the nmt version that wrote it"
        )
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"{path}: not a complete nmt checkpoint (no {', '.join(missing)})")
    return state
