"""Self-describing checkpoints, written atomically (temporary file, fsync, rename)."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from nmt import __version__
from nmt.errors import CheckpointError

FORMAT = 1  # bumped when the checkpoint layout changes incompatibly


@functools.cache
def _umask() -> int:
    """The process umask (read once: setting it to read it is not thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync, then rename it over
    ``path`` (and fsync the folder, so that the rename survives a power cut).

    A reader sees the old file or the complete new one, never a part, even when the writer is
    killed midway; the temporary file is ``.NAME.XXXX.tmp``, which nothing takes for a
    checkpoint. The new file gets the usual permissions (0666 less the umask), not
    ``mkstemp``'s private 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the ``.NAME.XXXX.tmp`` files of writers killed midway; returns them."""
    stale = sorted(directory.glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically (see ``atomic_write_bytes``)."""
    atomic_write_bytes(path, lambda handle: handle.write(text.encode("utf-8")))


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


class RunLock:
    """An exclusive lock on a run directory for the length of a training run.

    A second ``nmt train`` pointed at a directory in use refuses instead of interleaving its
    checkpoints and logs. The lock is an ``flock`` on ``.lock``, so the operating system drops
    it when the process dies, however it dies. Taking it removes the temporary files that a
    killed writer left in the directory (no other writer can be at work there).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.handle: Any = None

    def __enter__(self) -> RunLock:
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = self.path.open("a+")
        except OSError as exc:
            raise CheckpointError(
                f"run.dir: cannot create {self.path.parent} ({exc.strerror}); choose another "
                f"--run-dir"
            ) from None
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "another process"
            self.handle.close()
            raise CheckpointError(
                f"{self.path.parent}: in use by {owner}; wait for it to finish or use another "
                f"--run-dir"
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()}\n")
        self.handle.flush()
        remove_stale_temporaries(self.path.parent)
        return self

    def __exit__(self, *exc: Any) -> None:
        import fcntl

        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()
