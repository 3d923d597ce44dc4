"""Self-describing checkpoints: written atomically (``nmt.files``), read back with checks."""

from __future__ import annotations

import re
import warnings
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


ANOTHER = "use another checkpoint of the run (best.pt, last.pt, step-*.pt)"


def resolve(model: Path, given: str = "--model") -> Path:
    """A run directory (its best, else last checkpoint) or a checkpoint file; ``given``: what
    the caller calls the path (an option, a config key), for its errors."""
    model = Path(model)
    if model.is_dir():
        for name in ("best.pt", "last.pt"):
            if (model / name).is_file():
                return model / name
        raise CheckpointError(
            f"{model}: no best.pt or last.pt in this run directory; train it first or give "
            f"a checkpoint file to {given}"
        )
    if not model.is_file():
        raise CheckpointError(
            f"{model}: no such checkpoint file or run directory; check the path given to {given}"
        )
    return model


def step_of(state: dict[str, Any]) -> int:
    """The training step a checkpoint was saved at (0 when it records none)."""
    progress = state.get("progress")
    return int(progress.get("step", 0)) if isinstance(progress, dict) else 0


REQUIRED = ("model", "config", "tokenizer")  # what translate and eval need of a checkpoint


def _allowed_globals() -> list[Any]:
    """What a checkpoint may hold beyond the tensors, containers, numbers, strings and bytes
    that torch's weights-only unpickler reads: numpy's random state (``np.random.get_state()``,
    an array and its dtype), under the names numpy 1 and 2 pickle it by. None of these runs
    code: ``_reconstruct`` builds an array of an allowed type."""
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's array reconstructor
    allowed: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed.append((reconstruct, f"{module}._reconstruct"))
    dtype_class = type(np.dtype(np.uint32))
    allowed.append((dtype_class, f"numpy.dtypes.{dtype_class.__name__}"))
    return allowed


def _refused_global(exc: Exception) -> str | None:
    """The global a weights-only load refused, from torch's message, or None."""
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    return match.group(1) if match else None


def load(
    path: Path, map_location: str | torch.device = "cpu", instead: str = ANOTHER
) -> dict[str, Any]:
    """Read a checkpoint without running code from it (weights only, plus the allowlist
    above); truncated, foreign, unsafe or incompatible files are CheckpointErrors, and those
    of a damaged file end in ``instead``: what to do about it."""
    path = resolve(path)
    try:
        with torch.serialization.safe_globals(_allowed_globals()), warnings.catch_warnings():
            # a plain pickle (not torch.save's) is refused below: not with torch's warning first
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        refused = _refused_global(exc)
        if refused is not None:
            raise CheckpointError(
                f"{path}: refused: it holds a Python object ({refused}) that no nmt checkpoint "
                f"holds, and loading it could run code; use a checkpoint written by nmt train"
            ) from None
        if _archive_head(path) is False:
            raise CheckpointError(
                f"{path}: not a checkpoint (not the archive torch.save writes); give a run "
                f"directory or one of its best.pt, last.pt, step-*.pt"
            ) from None
        raise CheckpointError(
            f"{path}: cannot read checkpoint ({type(exc).__name__}); the file is truncated or "
            f"damaged: {instead}"
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
    _check_weights(path, state["model"], instead)
    return state


def _archive_head(path: Path) -> bool | None:
    """Whether ``path`` starts as torch.save's zip archive does (a cut-off checkpoint still
    does); None where it is empty or unreadable (nothing to tell by)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
    except OSError:
        return None
    return head == b"PK\x03\x04" if head else None


def _check_weights(path: Path, weights: Any, instead: str) -> None:
    """The ``model`` entry maps parameter names to tensors, every one finite: a NaN or an
    infinity decodes to empty lines and averages into every weight."""
    if not isinstance(weights, dict):
        raise CheckpointError(
            f"{path}: its model entry is a {type(weights).__name__}, not the parameter names "
            f"and tensors nmt train writes; the file was edited or is not an nmt checkpoint"
        )
    for name, tensor in weights.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{path}: its model entry {name!r} is a {type(tensor).__name__}, not a tensor; "
                f"the file was edited or is not an nmt checkpoint"
            )
        if tensor.is_floating_point() and not _finite(tensor):
            raise CheckpointError(
                f"{path}: its weight {name} holds NaN or infinite values (damaged or diverged "
                f"training); {instead}"
            )


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor``: its sum is finite (one pass, no mask), else each
    element is (a sum of finite half-precision weights may overflow)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
