"""Corpora from the hub and from Arrow-family files, read for real: a folder in the hub's
layout (parquet shards per split, a dataset card listing its configs) goes through the same
``datasets.load_dataset`` call that reads the hub, without a network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nmt.config import DataConfig, from_dict
from nmt.data.corpus import read_pairs
from nmt.data.prepare import load_corpora
from nmt.errors import DataError

PAIRS = [(f"hallo welt {i}", f"hello world {i}") for i in range(12)]
CARD = """---
configs:
- config_name: de-en
  data_files:
  - split: train
    path: de-en/train-*.parquet
  - split: validation
    path: de-en/validation-*.parquet
- config_name: flat
  data_files:
  - split: train
    path: flat/train-*.parquet
---
# A test corpus in the hub's layout
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may reach for the network: the hub library's offline switches are on."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, name):
            monkeypatch.setattr(datasets.config, name, True)


def _translation(pairs: list[tuple[str, str]]) -> pa.Table:
    return pa.table({"translation": [{"de": de, "en": en} for de, en in pairs]})


def _flat(pairs: list[tuple[str, str]]) -> pa.Table:
    return pa.table({"source": [de for de, _ in pairs], "target": [en for _, en in pairs]})


def hub_folder(root: Path) -> Path:
    """The hub's layout: a card with two configs, train in two parquet shards."""
    (root / "de-en").mkdir(parents=True)
    (root / "flat").mkdir()
    pq.write_table(_translation(PAIRS[:5]), root / "de-en/train-00000-of-00002.parquet")
    pq.write_table(_translation(PAIRS[5:10]), root / "de-en/train-00001-of-00002.parquet")
    pq.write_table(_translation(PAIRS[10:]), root / "de-en/validation-00000-of-00001.parquet")
    pq.write_table(_flat(PAIRS), root / "flat/train-00000-of-00001.parquet")
    (root / "README.md").write_text(CARD, encoding="utf-8")
    return root


def _pairs(rows: Any) -> list[tuple[str, str]]:
    return list(zip(rows["src"], rows["trg"], strict=True))


def test_hub_layout_translation_column(tmp_path: Path) -> None:
    folder = hub_folder(tmp_path / "corpus")
    cfg = DataConfig(
        format="hub", hub_name=str(folder), hub_config="de-en", src_lang="de", trg_lang="en"
    )
    assert _pairs(read_pairs(cfg, "train", tmp_path / "cache")) == PAIRS[:10]
    assert _pairs(read_pairs(cfg, "validation", tmp_path / "cache")) == PAIRS[10:]
    assert any((tmp_path / "cache/hub").rglob("*.arrow")), "downloads are kept in the cache"


def test_hub_layout_flat_fields(tmp_path: Path) -> None:
    folder = hub_folder(tmp_path / "corpus")
    cfg = DataConfig(
        format="hub",
        hub_name=str(folder),
        hub_config="flat",
        src_field="source",
        trg_field="target",
    )
    assert _pairs(read_pairs(cfg, "train", tmp_path / "cache")) == PAIRS


def test_hub_revision_reaches_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.hub_revision is passed to the real load_dataset (watched, not replaced)."""
    import datasets

    real, seen = datasets.load_dataset, []

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("revision"))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", watched)
    folder = hub_folder(tmp_path / "corpus")
    cfg = DataConfig(
        format="hub",
        hub_name=str(folder),
        hub_config="de-en",
        hub_revision="v1.0",
        src_lang="de",
        trg_lang="en",
    )
    assert len(read_pairs(cfg, "train", tmp_path / "cache")) == 10
    assert seen == ["v1.0"]


def test_hub_missing_dataset_is_a_data_error(tmp_path: Path) -> None:
    cfg = DataConfig(format="hub", hub_name=str(tmp_path / "absent"), hub_config="de-en")
    with pytest.raises(DataError, match="data.hub_name .*absent.* split 'train'"):
        read_pairs(cfg, "train", tmp_path / "cache")


def test_hub_unknown_fields_list_what_was_found(tmp_path: Path) -> None:
    folder = hub_folder(tmp_path / "corpus")
    cfg = DataConfig(format="hub", hub_name=str(folder), hub_config="flat")
    with pytest.raises(DataError, match="no fields 'es' and 'en' .*source, target"):
        read_pairs(cfg, "train", tmp_path / "cache")


def test_training_from_the_hub_layout_prepares_both_splits(tmp_path: Path) -> None:
    folder = hub_folder(tmp_path / "corpus")
    config = from_dict(
        {
            "data": {
                "format": "hub",
                "hub_name": str(folder),
                "hub_config": "de-en",
                "src_lang": "de",
                "trg_lang": "en",
                "train": "train",
                "dev": "validation",
                "test": None,
            },
            "tokenizer": {"vocab_size": 30},
        }
    )
    corpora, tokenizer = load_corpora(config, tmp_path / "run", None)
    assert (len(corpora.train), len(corpora.dev)) == (10, 2)
    assert corpora.dev_src == [de for de, _ in PAIRS[10:]]
    assert corpora.built == ["train", "dev"]
    again, _ = load_corpora(config, tmp_path / "run", tokenizer)
    assert again.built == [], "the hub dataset's fingerprint finds the prepared splits"


# ----------------------------------------------------------------------------- local formats


def _arrow_stream(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize("layout", ["parquet-file", "parquet-folder", "arrow", "disk"])
def test_local_arrow_family_formats(tmp_path: Path, layout: str) -> None:
    import datasets

    table = _translation(PAIRS)
    if layout == "parquet-file":
        fmt, path = "parquet", tmp_path / "train.parquet"
        pq.write_table(table, path)
    elif layout == "parquet-folder":
        fmt, path = "parquet", tmp_path / "shards"
        path.mkdir()
        pq.write_table(table.slice(0, 7), path / "part-0.parquet")
        pq.write_table(table.slice(7), path / "part-1.parquet")
    elif layout == "arrow":
        fmt, path = "arrow", tmp_path / "train.arrow"
        _arrow_stream(path, table)
    else:
        fmt, path = "disk", tmp_path / "saved"
        datasets.Dataset(table).save_to_disk(str(path))
    cfg = DataConfig(format=fmt, src_lang="de", trg_lang="en", train=str(path))
    assert _pairs(read_pairs(cfg, str(path), tmp_path / "cache")) == PAIRS


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path: Path) -> None:
    import datasets

    splits = {"train": datasets.Dataset(_flat(PAIRS)), "test": datasets.Dataset(_flat(PAIRS))}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(format="disk", train=str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"data.train: .*saved is a DatasetDict .*saved/train"):
        read_pairs(cfg, str(tmp_path / "saved"), tmp_path / "cache")
    cfg = DataConfig(format="disk", src_field="source", trg_field="target")
    assert len(read_pairs(cfg, str(tmp_path / "saved/train"), tmp_path / "cache")) == 12


def test_damaged_parquet_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1 not really")
    cfg = DataConfig(format="parquet", train=str(path))
    with pytest.raises(DataError, match=r"data.train: .*train.parquet: cannot read it as parquet"):
        read_pairs(cfg, str(path), tmp_path / "cache")


def test_missing_local_table_names_the_key(tmp_path: Path) -> None:
    cfg = DataConfig(format="arrow", dev=str(tmp_path / "dev.arrow"))
    with pytest.raises(DataError, match=r"data.dev: .*dev.arrow: no such arrow data"):
        read_pairs(cfg, str(tmp_path / "dev.arrow"), tmp_path / "cache")
