"""Where a split's pairs come from: each becomes a Hugging Face ``datasets.Dataset`` with
string columns ``src`` and ``trg``.

Local text pairs, TSV and JSONL files are parsed by ``nmt.data.textfiles`` into memory-mapped
Arrow tables; parquet files, datasets Arrow files and ``save_to_disk`` folders are opened by
``datasets``; hub datasets come through ``load_dataset(name, config, split=, revision=)``, the
same call for a hub name and for a local folder in the hub's layout. Tokenising and filtering
happen once, in ``nmt.data.store``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nmt.data.textfiles import Progress, existing, quiet_datasets, read_file, string_features
from nmt.errors import DataError

if TYPE_CHECKING:
    from nmt.config import Config, DataConfig

log = logging.getLogger("nmt")


def _key(cfg: DataConfig, split: str) -> str:
    """The config key that names ``split`` (data.train, data.dev, data.test or
    data.eval_splits.NAME), for messages."""
    for name, value in (("train", cfg.train), ("dev", cfg.dev), ("test", cfg.test)):
        if split == value:
            return f"data.{name}"
    for name, value in cfg.eval_splits.items():
        if split == value:
            return f"data.eval_splits.{name}"
    return "data"


def _read_text_pair(
    cfg: DataConfig, prefix: str, cache_dir: Path | None, progress: Progress
) -> Any:
    key = _key(cfg, prefix)
    src_path, trg_path = (existing(path, key) for path in local_files(cfg, prefix))
    src = read_file(src_path, "text", ("", ""), cfg.utf8_errors, cache_dir, progress)
    trg = read_file(trg_path, "text", ("", ""), cfg.utf8_errors, cache_dir, progress)
    if len(src) != len(trg):
        (longer, more), (shorter, fewer) = sorted(
            ((src_path, len(src)), (trg_path, len(trg))), key=lambda side: -side[1]
        )
        raise DataError(
            f"{longer}:{fewer + 1}: no partner line: {shorter} ends after line {fewer:,} but "
            f"{longer} has {more:,} lines; parallel files must have one sentence per line on "
            f"both sides"
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
                new_fingerprint=hashlib.sha256(
                    repr((rows._fingerprint, src_field, trg_field)).encode()
                ).hexdigest()[:16],
            )
        except (KeyError, TypeError):
            pass
    raise DataError(
        f"{where}: no fields {src_field!r} and {trg_field!r} (found {', '.join(columns)}); "
        f"set data.src_field and data.trg_field"
    )


def _read_table(cfg: DataConfig, split: str, cache_dir: Path | None) -> Any:
    """A parquet file or folder of shards, a datasets Arrow file, or a save_to_disk folder."""
    datasets = quiet_datasets()
    key = _key(cfg, split)
    path = Path(split)
    if not path.exists():
        raise DataError(f"{key}: {path}: no such {cfg.format} data; fix {key} in the config")
    try:
        if cfg.format == "parquet":
            files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
            if not files:
                raise DataError(f"{key}: {path} holds no .parquet files; fix {key} in the config")
            rows = datasets.Dataset.from_parquet(
                [str(f) for f in files], cache_dir=str(cache_dir / "parquet") if cache_dir else None
            )
        elif cfg.format == "arrow":
            rows = datasets.Dataset.from_file(str(path))
        else:
            rows = datasets.load_from_disk(str(path))
    except DataError:
        raise
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{key}: {path}: cannot read it as {cfg.format} data ({reason})") from None
    if isinstance(rows, datasets.DatasetDict):
        raise DataError(
            f"{key}: {path} is a DatasetDict with splits {', '.join(rows)}; name one split's "
            f"folder, e.g. {path / next(iter(rows))}"
        )
    return _select_fields(rows, cfg, str(path))


def _read_hub(cfg: DataConfig, split: str, cache_dir: Path | None) -> Any:
    """``datasets.load_dataset(hub_name, hub_config, split, revision)``; downloads are kept in
    ``cache_dir/hub`` (the run's cache unless data.cache_dir is set), not the user's HF cache,
    so that a run's directory holds what it read."""
    datasets = quiet_datasets()
    try:
        rows = datasets.load_dataset(
            cfg.hub_name,
            cfg.hub_config,
            split=split,
            revision=cfg.hub_revision,
            cache_dir=str(cache_dir / "hub") if cache_dir else None,
        )
    except Exception as exc:
        raise DataError(f"data.hub_name {cfg.hub_name!r} split {split!r}: {exc}") from None
    return _select_fields(rows, cfg, f"{cfg.hub_name} {split}")


def read_pairs(
    cfg: DataConfig, split: str, cache_dir: Path | None = None, progress: Progress = None
) -> Any:
    """A ``datasets.Dataset`` with string columns ``src`` and ``trg`` for one split.

    ``split`` is the value of data.train, data.dev or data.test: a file prefix (text), a file
    (tsv, jsonl, parquet, arrow), a folder (parquet shards, disk) or a hub split. Text, TSV
    and JSONL files are read by ``nmt.data.textfiles`` (lines end at ``\\n``; CRLF handled;
    file:line errors) into Arrow tables under ``cache_dir``.
    """
    if cfg.format == "text":
        return _read_text_pair(cfg, split, cache_dir, progress)
    if cfg.format in ("tsv", "jsonl"):
        path = existing(Path(split), _key(cfg, split))
        fields = (cfg.src_field or cfg.src_lang, cfg.trg_field or cfg.trg_lang)
        return read_file(path, cfg.format, fields, cfg.utf8_errors, cache_dir, progress)
    if cfg.format == "hub":
        return _read_hub(cfg, split, cache_dir)
    return _read_table(cfg, split, cache_dir)


def local_files(cfg: DataConfig, split: str) -> list[Path]:
    """The local file(s) a split is read from (before a .gz is looked for)."""
    if cfg.format == "text":
        return [Path(f"{split}.{cfg.src_lang}"), Path(f"{split}.{cfg.trg_lang}")]
    return [Path(split)]


def source_files(cfg: DataConfig, split: str) -> list[Path]:
    """The files (or folders) a local split is read from, as found (a ``.gz`` included)."""
    if cfg.format in ("text", "tsv", "jsonl"):
        return [existing(path, _key(cfg, split)) for path in local_files(cfg, split)]
    return [Path(split)]


def check_files(config: Config) -> None:
    """Before training: every local file the run reads exists; all missing ones in one error.

    Checks data.train and data.dev (a text pair's two files, or the TSV/JSONL file; a ``.gz``
    beside a name counts), and when they are set tokenizer.model, training.init_from,
    training.guided_alignment and data.dev_alignment.
    """
    data = config.data
    problems = []
    for key, split in (("data.train", data.train), ("data.dev", data.dev)):
        if data.format in ("parquet", "arrow", "disk"):
            if not Path(split).exists():
                problems.append(f"{key}: {split}: no such {data.format} data")
            continue
        for path in local_files(data, split) if data.format != "hub" else []:
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
    for key, link_file in (
        ("training.guided_alignment", config.training.guided_alignment),
        ("data.dev_alignment", data.dev_alignment),
    ):
        if link_file:
            try:
                existing(Path(link_file), key)
            except DataError as exc:
                problems.append(str(exc).removesuffix(f"; fix {key} in the config"))
    if problems:
        raise DataError("; ".join(problems) + "; fix the paths in the config or --override them")
