"""The store's temporary folders: made with the permissions of any folder of the user's, held
by their builder for as long as it builds, and removed once that builder is provably gone.

A folder is built as ``.NAME.XXXXXXXX.tmp`` beside the entries. Before its name is taken, its
builder holds an advisory ``flock`` on the file ``.lock`` inside it, made under a temporary
name and renamed into place once locked, so that a ``.lock`` that exists is held by a live
builder or by nobody. The kernel drops the lock when the builder's process ends in any way,
SIGKILL included (or, where it forked workers, when the last of them ends), and nothing else
drops it. A sweeper that takes the lock without waiting has proof that the builder is gone;
one that cannot (a live builder, a cache on a filesystem without ``flock``, another user's
folder) leaves the folder alone. A temporary folder without a ``.lock`` is never removed.

Folders are made by ``mkdir`` with mode 0777, which the umask narrows, not ``mkdtemp``'s
private 0700: a cache shared by a group (umask 002) can be read by the group.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from pathlib import Path

LOCK = ".lock"  # inside a temporary folder: flocked by its builder while it builds
BUILDING = ".tmp"  # the suffix of a temporary folder
REMOVED = ".removed"  # the suffix of an entry moved aside to be removed


def make_folder(parent: Path, prefix: str, suffix: str) -> Path:
    """A new folder ``{prefix}XXXXXXXX{suffix}`` in ``parent``, mode 0777 less the umask."""
    for _ in range(100):
        path = parent / f"{prefix}{uuid.uuid4().hex[:8]}{suffix}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{parent}: no free name for a folder {prefix}XXXXXXXX{suffix}")


def hold(parent: Path, name: str) -> tuple[Path, int]:
    """A new temporary folder for ``name`` in ``parent`` and the descriptor of its held lock,
    which the caller closes (``release``) once the folder is published or removed."""
    folder = make_folder(parent, f".{name}.", BUILDING)
    try:
        fd = _locked_file(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, fd


def _locked_file(folder: Path) -> int:
    """Make ``folder/.lock`` already locked: the lock is taken on a file of another name,
    which then takes the name ``.lock``."""
    staging = folder / f"{LOCK}.{uuid.uuid4().hex[:8]}"
    fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(staging, folder / LOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Drop a temporary folder's lock (its folder is published or removed by then)."""
    os.close(fd)


def sweep(parent: Path) -> list[Path]:
    """Remove from ``parent`` what killed processes left: temporary folders whose builder is
    gone and entries moved aside to be removed; returns the folders removed. Never waits on
    a lock, and an error (a read-only cache, a folder removed meanwhile) leaves that folder."""
    try:
        names = sorted(path for path in parent.iterdir() if path.name.startswith("."))
    except OSError:
        return []
    removed = []
    for path in names:
        if path.name.endswith(REMOVED) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif not (path.name.endswith(BUILDING) and path.is_dir()):
            continue
        else:
            fd = _orphan_lock(path)
            if fd is None:
                continue
            try:
                _remove_held(path)
            finally:
                os.close(fd)
        if not path.exists():
            removed.append(path)
    return removed


def _orphan_lock(folder: Path) -> int | None:
    """The lock of ``folder``, taken without waiting, when its builder is gone; else None (a
    live builder, no ``.lock``, or a lock this process cannot take)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_held(folder: Path) -> None:
    """Remove an orphaned temporary folder, renamed aside first so that no other sweeper
    starts on it."""
    aside = folder.with_name(f"{folder.name}.{uuid.uuid4().hex[:8]}{REMOVED}")
    with contextlib.suppress(OSError):
        folder.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
