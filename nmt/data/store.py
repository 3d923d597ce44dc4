"""Prepared corpora: token ids and lengths written once, reused by every run that would write
the same, memory-mapped by every rank.

A split is prepared by one ``Dataset.map`` (in ``data.num_proc`` processes) that tokenises
each pair and marks the pairs to drop (an empty side; for training, more than
``data.max_length`` pieces on a side) into Arrow shards of an entry directory:

    {store}/prepared/{name}-{key}/
        manifest.json           the key, its parts, counts, the shard files, the timings
        ids_*.arrow             src_ids, trg_ids (int32 lists), src_len, trg_len, drop [src, trg]
        rows.npy                the kept pairs' row numbers (int64)
        src_len.npy trg_len.npy their lengths (int32): all that batching reads

The key hashes everything that decides the entry: the source's identity (each local file's
resolved path, size and modification time; a hub dataset's fingerprint), the data keys that
change the ids and the tokenizer's bytes. A run with another tokenizer or config computes
another key and builds another entry; an entry whose manifest does not carry its own key, or
lacks a file, is removed and rebuilt. Entries are built in a temporary directory and renamed
into place whole, so a killed preparation leaves nothing that looks finished and two runs
preparing at once never see half an entry.

What stays in memory per training pair: its row number (8 bytes) and two lengths (4 bytes
each); the ids stay in the memory-mapped shards until a batch reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmt.data.batching import Batch, make_batch
from nmt.data.guidance import guide_matrix, parse_pharaoh, word_link_cells
from nmt.data.textfiles import quiet_datasets
from nmt.data.tokenizer import Tokenizer, piece_words
from nmt.errors import DataError
from nmt.files import atomic_write_text

log = logging.getLogger("nmt")

STORE_VERSION = 1  # part of every key: bump when what an entry holds changes
KEEP, EMPTY, LONG = 0, 1, 2  # the drop column's codes
AUTO_PROC_PAIRS = 100_000  # from this many pairs on, data.num_proc defaults to the cores


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
    """The prepared entries (and tokenizers) under one cache directory."""

    def __init__(self, root: Path):
        self.root = root
        self.prepared = root / "prepared"

    def entry(self, name: str, key: str) -> Path:
        return self.prepared / f"{name}-{key}"

    def find(self, name: str, key: str) -> dict[str, Any] | None:
        """The manifest of a complete entry with this key; a damaged one is removed."""
        path = self.entry(name, key)
        if not path.is_dir():
            return None
        try:
            manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
            complete = manifest["key"] == key and all(
                (path / f).is_file() for f in manifest["files"]
            )
        except (OSError, ValueError, KeyError, TypeError):
            complete = False
        if complete:
            return dict(manifest)
        log.warning("%s: incomplete or damaged prepared data; preparing it again", path)
        shutil.rmtree(path, ignore_errors=True)
        return None

    def publish(self, tmp: Path, name: str, key: str) -> Path:
        """Rename a finished temporary entry into place (a concurrent twin may have won)."""
        final = self.entry(name, key)
        try:
            tmp.rename(final)
        except OSError:
            if self.find(name, key) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return final

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
                shutil.rmtree(path, ignore_errors=True)

    def scratch(self, name: str) -> Path:
        self.prepared.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.prepared))


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
    tmp = store.scratch(name)
    try:
        manifest = _build(tmp, pairs, encode, num_proc, progress, name)
        if check:
            check(manifest["counts"])
        manifest |= {"key": key, "parts": key_parts, "seconds": time.perf_counter() - started}
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1, default=str))
        final = store.publish(tmp, name, key)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_entry(final, store.find(name, key) or manifest), True


def _build(
    tmp: Path, pairs: Any, encode: Encode, num_proc: int | None, progress: bool, name: str
) -> dict[str, Any]:
    """Tokenise ``pairs`` into shards in ``tmp``; the manifest's counts and files."""
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
            new_fingerprint=digest("ids", tmp.name),
            desc=f"tokenising {name}",
        )
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"cannot write prepared data to {tmp.parent} ({exc})") from None
    finally:
        datasets.disable_progress_bars()
    table = mapped.data
    drop = table.column("drop").to_numpy()
    kept = np.flatnonzero(drop == KEEP)
    np.save(tmp / "rows.npy", kept.astype(np.int64))
    np.save(tmp / "src_len.npy", table.column("src_len").to_numpy()[kept].astype(np.int32))
    np.save(tmp / "trg_len.npy", table.column("trg_len").to_numpy()[kept].astype(np.int32))
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

    def batch(self, indices: np.ndarray) -> Batch:
        picked = self.rows[self.row_ids[indices].tolist()]
        batch = make_batch(picked["src_ids"], picked["trg_ids"], indices)
        if self.guided:
            batch.guide = guide_matrix(picked["guide"], batch.trg_out.size(1), batch.src.size(1))
        return batch
