"""The store's temporary folders: one left by a preparation killed outright is removed by the
next preparation, one a live preparation holds is kept; and what the store writes has the
permissions the umask gives, so that a group can share a cache."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nmt import files
from nmt.config import DataConfig
from nmt.data import scratch
from nmt.data.corpus import read_pairs
from nmt.data.store import Encode, Store, prepare
from nmt.data.tokenizer import Tokenizer, train_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
TEXT = DataConfig(format="text", src_lang="src", trg_lang="trg")
LINES = [f"casa{i % 5} sol palabra{i % 7}" for i in range(60)]

# A preparation that never ends: it holds its temporary folder, says where, and waits.
BUILDER = """
import sys, time
from pathlib import Path
from nmt.data.store import Store
with Store(Path(sys.argv[1])).building("train") as tmp:
    (tmp / "ids.arrow").write_bytes(b"half written")
    print(tmp, flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    proto = train_sentencepiece(LINES, 30, "unigram", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def _prepare(root: Path, corpus: Path, tokenizer: Tokenizer) -> Any:
    """One preparation of the tiny corpus in the store at ``root``."""

    def rows() -> Any:
        return read_pairs(TEXT, str(corpus / "train"), root)

    encode = Encode(tokenizer, None, keep_text=False)
    prepared, built = prepare(Store(root), "train", {"corpus": "tiny"}, rows, encode, 1, False)
    assert built
    return prepared


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for side in ("src", "trg"):
        (folder / f"train.{side}").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return folder


def _builder(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process in the middle of a preparation in the store at ``root``, and its folder."""
    child = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(root)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line, child.communicate()[1]
    return child, Path(line)


def test_a_killed_preparations_folder_goes_and_a_live_ones_stays(
    tmp_path: Path, corpus: Path, tokenizer: Tokenizer
) -> None:
    root = tmp_path / "cache"
    killed, killed_folder = _builder(root)
    live, live_folder = _builder(root)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed_folder.is_dir(), "SIGKILL leaves the folder behind"
        prepared = _prepare(root, corpus, tokenizer)
        assert not killed_folder.exists(), "the next preparation removes it"
        assert (live_folder / "ids.arrow").read_bytes() == b"half written", "the live one stays"
        names = sorted(p.name for p in (root / "prepared").iterdir())
        assert names == sorted([prepared.path.name, live_folder.name])
        assert not (prepared.path / scratch.LOCK).exists(), "a published entry has no lock"
    finally:
        live.kill()
        live.wait(timeout=30)
    assert scratch.sweep(root / "prepared") == [live_folder], "its lock died with it"
    assert [p.name for p in (root / "prepared").iterdir()] == [prepared.path.name]


def test_a_folder_without_a_lock_or_held_here_is_left_alone(tmp_path: Path) -> None:
    """A temporary folder with no ``.lock`` may be one being set up: it is never removed;
    nor is one this process holds. An entry moved aside to be removed is."""
    bare = scratch.make_folder(tmp_path, ".train.", scratch.BUILDING)
    held, lock = scratch.hold(tmp_path, "dev")
    aside = scratch.make_folder(tmp_path, ".train-0123.", scratch.REMOVED)
    (aside / "ids.arrow").write_bytes(b"old")
    try:
        assert scratch.sweep(tmp_path) == [aside]
        assert bare.is_dir() and held.is_dir() and not aside.exists()
    finally:
        scratch.release(lock)
    assert scratch.sweep(tmp_path) == [held]


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask set to ``mask`` (and nmt.files' record of it)."""
    previous = os.umask(mask)
    files._umask.cache_clear()
    try:
        yield
    finally:
        os.umask(previous)
        files._umask.cache_clear()


@pytest.mark.parametrize(
    ("mask", "group_reads"), [(0o002, True), (0o022, True), (0o077, False)], ids=oct
)
def test_the_cache_has_the_permissions_the_umask_gives(
    tmp_path: Path, corpus: Path, tokenizer: Tokenizer, mask: int, group_reads: bool
) -> None:
    """Folders 0777 and files 0666, less the umask: a group shares a cache under umask 002
    (and reads it under 022); under 077 only the owner can."""
    root = tmp_path / "cache"
    with umask(mask):
        prepared = _prepare(root, corpus, tokenizer)
    folders = [root / "prepared", prepared.path, root / "files"]
    written = [*prepared.path.iterdir(), *(root / "files").iterdir()]
    assert len(written) >= 7  # the entry's shards, arrays and manifest, the parsed corpus
    for path in folders:
        assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~mask, path
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path
    for path in [*folders, *written]:
        assert bool(path.stat().st_mode & stat.S_IRGRP) == group_reads, path
