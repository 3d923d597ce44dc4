"""Prepared corpora: token ids and lengths written once, reused by every run that would write
the same, memory-mapped by every rank, checked before use.

A split is prepared by one ``Dataset.map`` (in ``data.num_proc`` processes) that tokenises
each pair and marks the pairs to drop (an empty side; for training, more than
``data.max_length`` pieces on a side) into Arrow shards of an entry directory:

    {store}/prepared/{name}-{key}/
        manifest.json           the key, its parts, counts, the shards, the timings, and each
                                file's size in bytes and xxh3-128 checksum
        ids_*.arrow             src_ids, trg_ids (int32 lists), src_len, trg_len, drop [src, trg]
        rows.npy                the kept pairs' row numbers (int64)
        src_len.npy trg_len.npy their lengths (int32): all that batching reads

The key hashes everything that decides the entry: the source's identity (each local file's
resolved path, size and modification time; a hub dataset's fingerprint), the data keys that
change the ids and the tokenizer's bytes. A run with another tokenizer or config computes
another key and builds another entry.

Entries are built in a temporary directory, their files' sizes and checksums recorded in the
manifest, written last, and the directory renamed into place whole: a killed preparation
leaves nothing that looks finished, and two runs preparing at once never see half an entry
(the first to rename wins; the other removes its own and uses the winner's, once checked).
A failed write (a full disk) is a ``DataError`` naming the file, with the temporary directory
removed. The process building an entry holds a lock in its temporary directory until it ends;
the temporary directory of one killed outright (SIGKILL, a machine's reboot) is removed by the
next preparation in the store, once its lock shows its builder gone (``nmt.data.scratch``).
Directories and files get the permissions the umask gives (a cache shared by a group is
readable by the group under umask 002), not ``mkdtemp``'s private 0700.

Before an entry is used, ``Store.find`` checks it against its manifest: the key, every file
present with its size (each time), and its checksum (once per process and entry: a disk that
filled, a machine that died before its writes reached the disk, a file overwritten in place).
An entry that fails is moved aside and removed with one warning naming the file, and prepared
again; one that cannot be removed (a read-only cache) is a ``DataError``.

What stays in memory per training pair: its row number (8 bytes) and two lengths (4 bytes
each); the ids stay in the memory-mapped shards until a batch reads them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from nmt.data import scratch
from nmt.data.batching import Batch, make_batch
from nmt.data.guidance import guide_matrix, parse_pharaoh, word_link_cells
from nmt.data.stages import Stages
from nmt.data.textfiles import quiet_datasets
from nmt.data.tokenizer import Tokenizer, piece_words
from nmt.errors import DataError, NMTError
from nmt.files import atomic_write_text

log = logging.getLogger("nmt")

STORE_VERSION = 2  # part of every key: bump when what an entry holds changes
KEEP, EMPTY, LONG = 0, 1, 2  # the drop column's codes
AUTO_PROC_PAIRS = 100_000  # from this many pairs on, data.num_proc defaults to the cores
CHUNK = 4 << 20  # bytes read at a time when checksumming a file

# The entries this process has checksummed: (entry, its manifest's inode and mtime_ns). A
# rebuilt entry has a new manifest, so it is checked again.
_verified: set[tuple[str, int, int]] = set()


def digest(*parts: Any) -> str:
    """A short stable hash of ``parts`` (bytes as themselves, the rest by ``repr``)."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part if isinstance(part, bytes) else repr(part).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()[:20]


def file_identity(paths: list[Path]) -> list[tuple[str, int, int]]:
    """(resolved path, size, mtime_ns) of each file, and of the files inside each folder."""
    found: list[Path] = []
    for path in paths:
        found.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    identity = []
    for path in found:
        stat = path.stat()
        identity.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    return identity


def checksum(path: Path) -> str:
    """The xxh3-128 of a file's bytes, read in chunks of ``CHUNK`` bytes."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            hasher.update(view[:size])
    return hasher.hexdigest()


def seal(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """What a manifest records of each file: its size in bytes and its checksum."""
    return {
        name: {"bytes": (directory / name).stat().st_size, "xxh3_128": checksum(directory / name)}
        for name in names
    }


def write_error(path: Path, exc: OSError) -> str:
    """One line for a failed write of prepared data: the file, the error and the fix."""
    if isinstance(exc, NMTError):  # already one line that names the file (nmt.files)
        return str(exc)
    reason = " ".join((exc.strerror or str(exc)).split())
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc):
        fix = "free space on its disk or point data.cache_dir elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make data.cache_dir writable or point data.cache_dir elsewhere"
    else:
        fix = "point data.cache_dir elsewhere"
    return f"{exc.filename or path}: cannot write prepared data ({reason}); {fix}"


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into a ``DataError`` naming it."""
    try:
        yield
    except OSError as exc:
        raise DataError(write_error(path, exc)) from None


def default_num_proc(pairs: int) -> int:
    """One process per core (at most 8) for big corpora; one for small ones."""
    if pairs < AUTO_PROC_PAIRS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))


@dataclass(frozen=True)
class Sampling:
    """Subword regularisation for one epoch: sentencepiece's ``alpha`` and ``nbest``, and a
    base seed; pair i's source is sampled with seed base + 2i, its target with base + 2i + 1,
    so an epoch's ids depend on nothing else (not on processes or batch boundaries)."""

    alpha: float
    nbest: int
    base: int

    def seeds(self, indices: list[int], side: int) -> list[int]:
        return [(self.base + 2 * i + side) % 2**32 for i in indices]


@dataclass
class Encode:
    """The map function: ids, lengths and the drop code of each pair (picklable, so that
    ``num_proc`` processes can run it); with ``sampling``, sampled segmentations."""

    tokenizer: Tokenizer
    max_length: int | None  # None: drop only pairs with an empty side
    keep_text: bool
    sampling: Sampling | None = None
    guide: str | None = None  # the file of the "links" column: guided alignment's cells

    @property
    def indexed(self) -> bool:
        return self.sampling is not None or self.guide is not None

    def ids(self, batch: dict[str, list[str]], indices: list[int] | None) -> tuple[list, list]:
        tok, sampling = self.tokenizer, self.sampling
        if sampling is None or indices is None:
            return tok.encode_src(batch["src"]), tok.encode_trg(batch["trg"])
        alpha, nbest = sampling.alpha, sampling.nbest
        return (
            tok.sample("src", batch["src"], sampling.seeds(indices, 0), alpha, nbest),
            tok.sample("trg", batch["trg"], sampling.seeds(indices, 1), alpha, nbest),
        )

    def __call__(
        self, batch: dict[str, list[str]], indices: list[int] | None = None
    ) -> dict[str, list]:
        src, trg = self.ids(batch, indices)
        src_len = [len(s) for s in src]
        trg_len = [len(t) + 1 for t in trg]
        limit = None if self.max_length is None else self.max_length + 1
        drop = []
        for s, t, a, b in zip(batch["src"], batch["trg"], src_len, trg_len, strict=True):
            if not (s.strip() and t.strip()):
                drop.append(EMPTY)
            elif limit is not None and (a > limit or b > limit):
                drop.append(LONG)
            else:
                drop.append(KEEP)
        out: dict[str, list] = {"src_ids": src, "trg_ids": trg, "drop": drop}
        out |= {"src_len": src_len, "trg_len": trg_len}
        if self.keep_text:
            out["src"], out["trg"] = batch["src"], batch["trg"]
        if self.guide is not None:
            assert indices is not None
            out["guide"] = [
                self.guide_cells(src, trg, links, index)
                for src, trg, links, index in zip(
                    batch["src"], batch["trg"], batch["links"], indices, strict=True
                )
            ]
        return out

    def guide_cells(self, src: str, trg: str, line: str, index: int) -> list[int]:
        """One pair's guided-alignment cells, flat (t0, s0, t1, s1, ...)."""
        where = f"training.guided_alignment {self.guide} line {index + 1}"
        try:
            links = parse_pharaoh(line, where)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        words = (len(src.split()), len(trg.split()))
        for i, j in links:
            if i >= words[0] or j >= words[1]:
                raise DataError(
                    f"{where}: link {i}-{j} is outside the pair's {words[0]} source and "
                    f"{words[1]} target words; the alignment is of other text"
                )
        src_words = piece_words(self.tokenizer.src, src)
        trg_words = piece_words(self.tokenizer.trg, trg)
        return [x for cell in word_link_cells(links, src_words, trg_words) for x in cell]


def _features(keep_text: bool, guide: bool) -> Any:
    datasets = quiet_datasets()
    ids = datasets.Sequence(datasets.Value("int32"))
    columns = {
        "src_ids": ids,
        "trg_ids": ids,
        "src_len": datasets.Value("int32"),
        "trg_len": datasets.Value("int32"),
        "drop": datasets.Value("uint8"),
    }
    if keep_text:
        columns |= {"src": datasets.Value("string"), "trg": datasets.Value("string")}
    if guide:
        columns["guide"] = ids
    return datasets.Features(columns)


@dataclass
class Prepared:
    """A prepared split: the memory-mapped rows, the kept pairs and their lengths."""

    path: Path
    manifest: dict[str, Any]
    rows: Any  # datasets.Dataset over the entry's shards
    row_ids: np.ndarray  # (N,) int64: kept pairs' rows
    src_lengths: np.ndarray  # (N,) int32
    trg_lengths: np.ndarray  # (N,) int32

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.manifest["counts"])

    def text(self, limit: int) -> tuple[list[str], list[str]]:
        """The first ``limit`` kept pairs' text (entries prepared with ``keep_text``)."""
        picked = self.rows.select(self.row_ids[:limit]).select_columns(["src", "trg"])
        return list(picked["src"]), list(picked["trg"])

    def src_ids(self, limit: int) -> list[list[int]]:
        picked = self.rows.select(self.row_ids[:limit]).select_columns(["src_ids"])
        return [list(ids) for ids in picked["src_ids"]]


class Store:
    """The prepared entries (and tokenizers) under one cache directory. Checksumming found
    entries is timed as the stage "verify" of ``stages``."""

    def __init__(self, root: Path, stages: Stages | None = None):
        self.root = root
        self.prepared = root / "prepared"
        self.stages = stages or Stages(show=False)

    def entry(self, name: str, key: str) -> Path:
        return self.prepared / f"{name}-{key}"

    def find(self, name: str, key: str) -> dict[str, Any] | None:
        """The manifest of the entry with this key, once its files are checked against it;
        None when there is none, or it was damaged (then it is removed, with a warning)."""
        path = self.entry(name, key)
        if not path.is_dir():
            return None
        manifest, problem = read_manifest(path, key)
        if manifest is not None:
            problem = self.check(path, manifest["files"])
        if problem is None:
            return manifest
        self.discard(path, problem)
        return None

    def check(self, path: Path, files: dict[str, dict[str, Any]]) -> str | None:
        """What is wrong with an entry's files, or None: every file's presence and size each
        time (a stat), its checksum once per process."""
        problems = []
        for name, record in files.items():
            try:
                size = (path / name).stat().st_size
            except FileNotFoundError:
                problems.append(f"{path / name}: missing")
                continue
            except OSError as exc:
                problems.append(f"{path / name}: unreadable ({exc.strerror or exc})")
                continue
            if size != record["bytes"]:
                problems.append(f"{path / name}: {size} bytes, the manifest says {record['bytes']}")
        if problems:
            others = f" (and {len(problems) - 1} other files)" if len(problems) > 1 else ""
            return problems[0] + others
        try:
            stamp = manifest_stamp(path)
        except OSError as exc:
            return f"{path / 'manifest.json'}: unreadable ({exc.strerror or exc})"
        if stamp in _verified:
            return None
        with self.stages.stage("verify"):
            for name, record in files.items():
                try:
                    if checksum(path / name) != record["xxh3_128"]:
                        return (
                            f"{path / name}: checksum differs from its manifest (damaged on disk?)"
                        )
                except OSError as exc:
                    return f"{path / name}: unreadable ({exc.strerror or exc})"
        _verified.add(stamp)
        return None

    def remove(self, path: Path) -> None:
        """Remove an entry: renamed aside first, so that no process sees part of it."""
        aside = self.prepared / f".{path.name}.{uuid.uuid4().hex[:8]}{scratch.REMOVED}"
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)

    def discard(self, path: Path, problem: str) -> None:
        """Remove a damaged entry, with one warning saying what was wrong; a ``DataError``
        when it cannot be removed."""
        try:
            self.remove(path)
        except FileNotFoundError:
            pass  # a twin process removed it first
        except OSError as exc:
            raise DataError(
                f"{problem}; it cannot be removed to prepare it again "
                f"({exc.strerror or exc}): make data.cache_dir ({self.root}) writable or point "
                f"data.cache_dir elsewhere"
            ) from None
        log.warning("%s; preparing it again", problem)

    @contextmanager
    def building(self, name: str) -> Iterator[Path]:
        """A temporary directory to build an entry in, held by this process while it builds
        and gone afterwards (published or removed); what killed preparations left is removed
        first (``nmt.data.scratch``). A failed write in it becomes a ``DataError`` naming the
        file."""
        with writing(self.prepared):
            self.prepared.mkdir(parents=True, exist_ok=True)
            left = scratch.sweep(self.prepared)
            tmp, lock = scratch.hold(self.prepared, name)
        if left:
            log.info("%s: removed %d folders left by killed preparations", self.prepared, len(left))
        try:
            yield tmp
        except OSError as exc:
            raise DataError(write_error(tmp, exc)) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            scratch.release(lock)

    def publish(
        self, tmp: Path, name: str, key: str, manifest: dict[str, Any]
    ) -> tuple[Path, dict[str, Any]]:
        """Seal a finished temporary entry (``manifest["files"]``: the names of its files) and
        rename it into place; returns the entry and its manifest. The manifest, with each
        file's size and checksum, is written last. A twin process that published first wins:
        its entry is checked and used, and ``tmp`` removed."""
        manifest = {**manifest, "key": key, "files": seal(tmp, manifest["files"])}
        with writing(tmp / "manifest.json"):
            atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1, default=str))
        final = self.entry(name, key)
        try:
            tmp.rename(final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise DataError(write_error(final, exc)) from None
            found = self.find(name, key)
            if found is not None:  # a twin published first
                shutil.rmtree(tmp, ignore_errors=True)
                return final, found
            with writing(final):  # the twin's entry was damaged and is gone: ours replaces it
                tmp.rename(final)
        (final / scratch.LOCK).unlink(missing_ok=True)  # still held: the lock came along
        _verified.add(manifest_stamp(final))  # its files were checksummed just now
        return final, manifest

    def remove_family(self, name_prefix: str, family: str, keep: Path) -> None:
        """Remove the entries ``{name_prefix}*`` whose manifest names ``family``, but ``keep``
        (an epoch's sampled ids once the next epoch's are prepared)."""
        for path in self.prepared.glob(f"{name_prefix}*-*"):
            if path == keep or not path.is_dir():
                continue
            try:
                manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if manifest.get("parts", {}).get("family") == family:
                try:
                    self.remove(path)
                except OSError:
                    continue  # another process removed it, or the store is read-only


def read_manifest(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(an entry's manifest, None), or (None, what is wrong with it)."""
    where = path / "manifest.json"
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"{where}: missing"
    except (OSError, ValueError) as exc:  # a UnicodeDecodeError is a ValueError
        return None, f"{where}: unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return None, f"{where}: does not carry the entry's key {key}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(record, dict) and {"bytes", "xxh3_128"} <= record.keys()
        for record in files.values()
    ):
        return None, f"{where}: does not list its files' sizes and checksums"
    return manifest, None


def manifest_stamp(path: Path) -> tuple[str, int, int]:
    """An entry as this process checked it: its path, its manifest's inode and mtime."""
    stat = (path / "manifest.json").stat()
    return str(path), stat.st_ino, stat.st_mtime_ns


def load_entry(path: Path, manifest: dict[str, Any]) -> Prepared:
    datasets = quiet_datasets()
    shards = [datasets.Dataset.from_file(str(path / name)) for name in manifest["shards"]]
    rows = shards[0] if len(shards) == 1 else datasets.concatenate_datasets(shards)
    return Prepared(
        path,
        manifest,
        rows,
        np.load(path / "rows.npy"),
        np.load(path / "src_len.npy"),
        np.load(path / "trg_len.npy"),
    )


def prepare(
    store: Store,
    name: str,
    key_parts: dict[str, Any],
    rows: Callable[[], Any],
    encode: Encode,
    num_proc: int | None,
    progress: bool,
    check: Callable[[dict[str, int]], None] | None = None,
) -> tuple[Prepared, bool]:
    """The entry for ``key_parts``, built first if there is none; returns (it, built).

    ``rows()`` gives the pairs (called only when building); ``check(counts)`` runs before a
    new entry is published, so a corpus it refuses leaves nothing behind.
    """
    tokenizer = encode.tokenizer
    settings = (encode.max_length, encode.keep_text, encode.sampling, encode.guide)
    key = digest(STORE_VERSION, key_parts, settings, tokenizer.src_proto, tokenizer.trg_proto)
    manifest = store.find(name, key)
    if manifest is not None:
        if check:
            check(manifest["counts"])
        return load_entry(store.entry(name, key), manifest), False
    started = time.perf_counter()
    pairs = rows()
    with store.building(name) as tmp:
        manifest = _build(tmp, pairs, encode, num_proc, progress, name, key)
        if check:
            check(manifest["counts"])
        manifest |= {"parts": key_parts, "seconds": time.perf_counter() - started}
        final, manifest = store.publish(tmp, name, key, manifest)
    return load_entry(final, manifest), True


def _build(
    tmp: Path,
    pairs: Any,
    encode: Encode,
    num_proc: int | None,
    progress: bool,
    name: str,
    key: str,
) -> dict[str, Any]:
    """Tokenise ``pairs`` into shards in ``tmp``; the manifest's counts and files. The shards'
    fingerprint is made from the entry's key, so that whoever builds an entry writes the same
    bytes."""
    datasets = quiet_datasets()
    procs = min(num_proc or default_num_proc(len(pairs)), max(1, len(pairs)))
    features = _features(encode.keep_text, encode.guide is not None)
    if progress:
        datasets.enable_progress_bars()
    try:
        mapped = pairs.map(
            encode,
            with_indices=encode.indexed,
            batched=True,
            batch_size=2000,
            num_proc=procs if procs > 1 else None,
            remove_columns=pairs.column_names,
            features=features,
            cache_file_name=str(tmp / "ids.arrow"),
            new_fingerprint=digest("ids", name, key),
            desc=f"tokenising {name}",
        )
    except OSError as exc:
        raise DataError(write_error(tmp / "ids.arrow", exc)) from None
    finally:
        datasets.disable_progress_bars()
    table = mapped.data
    if table.num_rows == 0:  # datasets maps no pairs to a table without the features' columns
        table = features.arrow_schema.empty_table()
    drop = table.column("drop").to_numpy()
    kept = np.flatnonzero(drop == KEEP)
    arrays = {
        "rows.npy": kept.astype(np.int64),
        "src_len.npy": table.column("src_len").to_numpy()[kept].astype(np.int32),
        "trg_len.npy": table.column("trg_len").to_numpy()[kept].astype(np.int32),
    }
    for file, array in arrays.items():
        with writing(tmp / file):
            np.save(tmp / file, array)
    shards = [Path(f["filename"]).name for f in mapped.cache_files]
    counts = {
        "pairs": len(drop),
        "kept": len(kept),
        "empty": int((drop == EMPTY).sum()),
        "long": int((drop == LONG).sum()),
    }
    files = [*shards, "rows.npy", "src_len.npy", "trg_len.npy"]
    return {"counts": counts, "shards": shards, "files": files, "num_proc": procs}


class TokenizedCorpus:
    """Random access to a prepared split's kept pairs; ids stay in the memory-mapped shards.
    A split prepared with guided alignment gives each batch its attention targets."""

    def __init__(self, prepared: Prepared):
        self.guided = "guide" in prepared.rows.column_names
        columns = ["src_ids", "trg_ids", *(["guide"] if self.guided else [])]
        self.rows = prepared.rows.select_columns(columns)
        self.row_ids = prepared.row_ids
        self.src_lengths = prepared.src_lengths
        self.trg_lengths = prepared.trg_lengths

    def __len__(self) -> int:
        return len(self.src_lengths)

    def pairs(self, indices: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """The source and target ids of the pairs ``indices``."""
        picked = self.rows.select_columns(["src_ids", "trg_ids"])[self.row_ids[indices].tolist()]
        return picked["src_ids"], picked["trg_ids"]

    def batch(self, indices: np.ndarray) -> Batch:
        picked = self.rows[self.row_ids[indices].tolist()]
        batch = make_batch(picked["src_ids"], picked["trg_ids"], indices)
        if self.guided:
            batch.guide = guide_matrix(picked["guide"], batch.trg_out.size(1), batch.src.size(1))
        return batch
