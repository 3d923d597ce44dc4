"""Corpora -> cleaned pairs -> token ids, random access by batch.

Every corpus becomes a Hugging Face ``datasets.Dataset``: local files (a text pair, TSV,
JSONL) parsed by ``nmt.textfiles`` into memory-mapped Arrow tables, hub datasets through
``load_dataset(name, config, split=...)``. Tokenisation is a ``Dataset.map`` whose results are
cached on disk under the run directory, so corpora larger than memory work; only lengths are
held in memory (for nmt.data.batching).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nmt.data.batching import Batch, make_batch
from nmt.data.textfiles import existing, quiet_datasets, read_file, string_features
from nmt.data.tokenizer import Tokenizer
from nmt.errors import DataError

if TYPE_CHECKING:
    from nmt.config import Config, DataConfig

log = logging.getLogger("nmt")


def _key(cfg: DataConfig, split: str) -> str:
    """The config key that names ``split`` (data.train, data.dev or data.test), for messages."""
    for name, value in (("train", cfg.train), ("dev", cfg.dev), ("test", cfg.test)):
        if split == value:
            return f"data.{name}"
    return "data"


def _read_text_pair(cfg: DataConfig, prefix: str, cache_dir: Path | None) -> Any:
    key = _key(cfg, prefix)
    src_path = existing(Path(f"{prefix}.{cfg.src_lang}"), key)
    trg_path = existing(Path(f"{prefix}.{cfg.trg_lang}"), key)
    src = read_file(src_path, "text", utf8_errors=cfg.utf8_errors, cache_dir=cache_dir)
    trg = read_file(trg_path, "text", utf8_errors=cfg.utf8_errors, cache_dir=cache_dir)
    if len(src) != len(trg):
        raise DataError(
            f"{src_path} has {len(src)} lines but {trg_path} has {len(trg)}; "
            f"parallel files must have one sentence per line on both sides"
        )
    datasets = quiet_datasets()
    if len(src) == 0:  # concatenate_datasets would drop an empty table, and its column
        return datasets.Dataset.from_dict({"src": [], "trg": []}, string_features(["src", "trg"]))
    return datasets.concatenate_datasets(
        [src.rename_column("text", "src"), trg.rename_column("text", "trg")], axis=1
    )


def _select_fields(rows: Any, cfg: DataConfig, where: str) -> Any:
    src_field = cfg.src_field or cfg.src_lang
    trg_field = cfg.trg_field or cfg.trg_lang
    columns = rows.column_names
    if src_field in columns and trg_field in columns:
        return rows.select_columns([src_field, trg_field]).rename_columns(
            {src_field: "src", trg_field: "trg"}
        )
    if "translation" in columns:
        try:
            return rows.map(
                lambda b: {
                    "src": [t[src_field] for t in b["translation"]],
                    "trg": [t[trg_field] for t in b["translation"]],
                },
                batched=True,
                remove_columns=columns,
            )
        except (KeyError, TypeError):
            pass
    raise DataError(
        f"{where}: no fields {src_field!r} and {trg_field!r} (found {', '.join(columns)}); "
        f"set data.src_field and data.trg_field"
    )


def read_pairs(cfg: DataConfig, split: str, cache_dir: Path | None = None) -> Any:
    """A ``datasets.Dataset`` with string columns ``src`` and ``trg`` for one split.

    ``split`` is the value of data.train, data.dev or data.test: a file prefix (text), a file
    (tsv, jsonl) or a hub split. Local files are read by ``nmt.textfiles`` (lines end at
    ``\\n``; CRLF handled; file:line errors) into Arrow tables under ``cache_dir``.
    """
    if cfg.format == "text":
        return _read_text_pair(cfg, split, cache_dir)
    if cfg.format in ("tsv", "jsonl"):
        path = existing(Path(split), _key(cfg, split))
        fields = (cfg.src_field or cfg.src_lang, cfg.trg_field or cfg.trg_lang)
        return read_file(path, cfg.format, fields, cfg.utf8_errors, cache_dir)
    datasets = quiet_datasets()
    try:
        rows = datasets.load_dataset(
            cfg.hub_name,
            cfg.hub_config,
            split=split,
            cache_dir=str(cache_dir) if cache_dir else None,
        )
    except Exception as exc:
        raise DataError(f"data.hub_name {cfg.hub_name!r} split {split!r}: {exc}") from None
    return _select_fields(rows, cfg, f"{cfg.hub_name} {split}")


def local_files(cfg: DataConfig, split: str) -> list[Path]:
    """The local file(s) a split is read from (before a .gz is looked for)."""
    if cfg.format == "text":
        return [Path(f"{split}.{cfg.src_lang}"), Path(f"{split}.{cfg.trg_lang}")]
    return [Path(split)]


def check_files(config: Config) -> None:
    """Before training: every local file the run reads exists; all missing ones in one error.

    Checks data.train and data.dev (a text pair's two files, or the TSV/JSONL file; a ``.gz``
    beside a name counts) and tokenizer.model when it is set.
    """
    data = config.data
    problems = []
    if data.format != "hub":
        for key, split in (("data.train", data.train), ("data.dev", data.dev)):
            for path in local_files(data, split):
                try:
                    existing(path, key)
                except DataError as exc:
                    problems.append(str(exc).removesuffix(f"; fix {key} in the config"))
    model = config.tokenizer.model
    if model and not Path(model).is_file():
        problems.append(f"tokenizer.model: {model}: no such sentencepiece model")
    start = config.training.init_from
    if start and not Path(start).exists():
        problems.append(f"training.init_from: {start}: no such run directory or checkpoint")
    if problems:
        raise DataError("; ".join(problems) + "; fix the paths in the config or --override them")


def drop_empty(rows: Any) -> tuple[Any, int]:
    """Remove pairs where either side is empty or whitespace; returns (rows, dropped)."""
    kept = rows.filter(
        lambda b: [
            bool(s.strip()) and bool(t.strip()) for s, t in zip(b["src"], b["trg"], strict=False)
        ],
        batched=True,
    )
    return kept, len(rows) - len(kept)


def _fingerprint(*parts: Any) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
    return digest.hexdigest()[:16]


def tokenize(rows: Any, tokenizer: Tokenizer) -> Any:
    """Add ``src_ids``, ``trg_ids`` and their lengths (a cached ``Dataset.map``)."""

    def encode(batch: dict[str, list[str]]) -> dict[str, list]:
        src = tokenizer.encode_src(batch["src"])
        trg = tokenizer.encode_trg(batch["trg"])
        return {
            "src_ids": src,
            "trg_ids": trg,
            "src_len": [len(s) for s in src],
            "trg_len": [len(t) + 1 for t in trg],
        }

    fingerprint = _fingerprint(rows._fingerprint, tokenizer.src_proto, tokenizer.trg_proto)
    return rows.map(encode, batched=True, batch_size=2000, new_fingerprint=fingerprint)


def drop_long(rows: Any, max_length: int) -> tuple[Any, int]:
    """Remove pairs with more than ``max_length`` pieces on either side."""
    kept = rows.filter(
        lambda b: [
            s <= max_length + 1 and t <= max_length + 1
            for s, t in zip(b["src_len"], b["trg_len"], strict=False)
        ],
        batched=True,
    )
    return kept, len(rows) - len(kept)


class TokenizedCorpus:
    """Random access to tokenised pairs; ids stay in the on-disk Arrow table."""

    def __init__(self, rows: Any):
        self.rows = rows.select_columns(["src_ids", "trg_ids", "src_len", "trg_len"])
        self.src_lengths = np.asarray(self.rows["src_len"], dtype=np.int64)
        self.trg_lengths = np.asarray(self.rows["trg_len"], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def batch(self, indices: np.ndarray) -> Batch:
        picked = self.rows[[int(i) for i in indices]]
        return make_batch(picked["src_ids"], picked["trg_ids"], indices)
