"""Prepared corpora: built once, found again only by a run that would build the same, never
half-written; the tokenizer sample bounded; the stage timings and progress counts right."""

from __future__ import annotations

import gzip
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nmt.config import Config, DataConfig, from_dict
from nmt.data import stages as stages_module
from nmt.data.corpus import read_pairs
from nmt.data.prepare import load_corpora, sample_text
from nmt.data.stages import Stages
from nmt.data.store import Encode, Store, TokenizedCorpus, prepare
from nmt.data.textfiles import read_file
from nmt.data.tokenizer import Tokenizer, train_sentencepiece
from nmt.errors import DataError
from tests.synthetic import data_section, write_corpus


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    lines = [f"palabra{i % 17} casa{i % 5} sol" for i in range(200)]
    proto = train_sentencepiece(lines, 40, "unigram", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def _rows(tmp_path: Path, pairs: list[tuple[str, str]]) -> Any:
    (tmp_path / "c.es").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (tmp_path / "c.en").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return read_pairs(DataConfig(format="text"), str(tmp_path / "c"), tmp_path / "cache")


PAIRS = [(f"casa{i % 5} sol " * (1 + i % 4), f"sol palabra{i % 17}") for i in range(300)]


def _config(root: Path, **data: Any) -> Config:
    write_corpus(root, {"train": 300, "dev": 8})
    return from_dict(
        {
            "data": {**data_section(root), **data},
            "tokenizer": {"vocab_size": 40, "type": "bpe"},
            "run": {"dir": str(root / "run"), "tensorboard": False},
        }
    )


def test_num_proc_changes_nothing_but_the_shards(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = _rows(tmp_path, PAIRS)
    encode = Encode(tokenizer, 6, keep_text=False)
    one, _ = prepare(Store(tmp_path / "a"), "train", {}, lambda: rows, encode, 1, False)
    two, _ = prepare(Store(tmp_path / "b"), "train", {}, lambda: rows, encode, 2, False)
    assert (len(one.manifest["shards"]), len(two.manifest["shards"])) == (1, 2)
    assert one.counts == two.counts and one.counts["long"] > 0
    for field in ("row_ids", "src_lengths", "trg_lengths"):
        assert np.array_equal(getattr(one, field), getattr(two, field)), field
    every = np.arange(len(one.row_ids))
    a, b = TokenizedCorpus(one).batch(every), TokenizedCorpus(two).batch(every)
    assert all(map(np.array_equal, a.tensors(), b.tensors()))


def test_what_stays_in_memory_per_pair(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = _rows(tmp_path, PAIRS)
    encode = Encode(tokenizer, None, keep_text=False)
    prepared, _ = prepare(Store(tmp_path / "s"), "train", {}, lambda: rows, encode, 1, False)
    assert prepared.row_ids.dtype == np.int64
    assert prepared.src_lengths.dtype == prepared.trg_lengths.dtype == np.int32
    ids = prepared.rows.data.column("src_ids")
    assert str(ids.type) == "list<item: int32>", "ids are int32 lists in the shards"


def test_an_entry_is_found_again_without_reading(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = _rows(tmp_path, PAIRS)
    store = Store(tmp_path / "store")
    encode = Encode(tokenizer, 6, keep_text=False)
    first, built = prepare(store, "train", {"source": 1}, lambda: rows, encode, 1, False)

    def unread() -> Any:
        raise AssertionError("a prepared split was read again")

    again, rebuilt = prepare(store, "train", {"source": 1}, unread, encode, 1, False)
    assert (built, rebuilt) == (True, False)
    assert again.path == first.path and np.array_equal(again.row_ids, first.row_ids)


def test_another_tokenizer_or_setting_gets_its_own_entry(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    rows = _rows(tmp_path, PAIRS)
    store = Store(tmp_path / "store")
    other_proto = train_sentencepiece([s for s, _ in PAIRS], 30, "bpe", 1.0, 1000, seed=1)
    other = Tokenizer(other_proto, other_proto)
    paths = set()
    for tok, max_length, parts in (
        (tokenizer, 6, {"source": 1}),
        (other, 6, {"source": 1}),
        (tokenizer, 9, {"source": 1}),
        (tokenizer, 6, {"source": 2}),
    ):
        prepared, built = prepare(
            store, "train", parts, lambda: rows, Encode(tok, max_length, False), 1, False
        )
        assert built
        paths.add(prepared.path)
    assert len(paths) == 4


def test_a_damaged_entry_is_rebuilt(
    tmp_path: Path, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _rows(tmp_path, PAIRS)
    store = Store(tmp_path / "store")
    encode = Encode(tokenizer, None, keep_text=False)
    first, _ = prepare(store, "train", {}, lambda: rows, encode, 1, False)
    shard = first.path / first.manifest["shards"][0]
    shard.unlink()
    with caplog.at_level(logging.WARNING, logger="nmt"):
        again, built = prepare(store, "train", {}, lambda: rows, encode, 1, False)
    assert built and f"{shard}: missing; preparing it again" in caplog.text
    manifest = again.path / "manifest.json"
    manifest.write_text(json.dumps({**again.manifest, "key": "someone else's"}))
    assert prepare(store, "train", {}, lambda: rows, encode, 1, False)[1], "key mismatch"


def test_a_refused_corpus_leaves_nothing(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = _rows(tmp_path, PAIRS)
    store = Store(tmp_path / "store")

    def refuse(counts: dict[str, int]) -> None:
        raise DataError(f"refused {counts['pairs']}")

    with pytest.raises(DataError, match="refused 300"):
        prepare(store, "train", {}, lambda: rows, Encode(tokenizer, 6, False), 1, False, refuse)
    assert list(store.prepared.iterdir()) == []


def test_an_empty_corpus_is_counted_and_refused_leaving_nothing(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """datasets maps no pairs to a table without columns: reading it was a KeyError."""
    rows = _rows(tmp_path, [])
    store = Store(tmp_path / "store")
    seen = []

    def refuse(counts: dict[str, int]) -> None:
        seen.append(counts)
        raise DataError("refused")

    with pytest.raises(DataError, match="refused"):
        prepare(store, "train", {}, lambda: rows, Encode(tokenizer, 6, False), 1, False, refuse)
    assert seen == [{"pairs": 0, "kept": 0, "empty": 0, "long": 0}]
    assert list(store.prepared.iterdir()) == []


def test_an_empty_training_corpus_with_a_tokenizer_is_one_line(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """With a tokenizer (a checkpoint's, or tokenizer.model) nothing trains one on the
    corpus first: preparing it finds it empty, as nmt train and nmt shortlist do."""
    config = _config(tmp_path)
    for side in ("src", "trg"):
        (tmp_path / f"train.{side}").write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=r"^data.train: .*: none of its 0 pairs has text on both"):
        load_corpora(config, tmp_path / "run", tokenizer)


def test_tokenizer_pickles_as_its_bytes(tokenizer: Tokenizer) -> None:
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.state_dict() == tokenizer.state_dict()
    assert copy.encode_src(["casa1 sol"]) == tokenizer.encode_src(["casa1 sol"])


# ----------------------------------------------------------------------------- whole runs


def test_a_second_run_sharing_the_cache_prepares_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path, cache_dir=str(tmp_path / "shared"))
    first, tokenizer = load_corpora(config, tmp_path / "run1", None)
    assert first.built == ["train", "dev"] and "tokenizer" in first.stages
    with caplog.at_level(logging.INFO, logger="nmt"):
        second, again = load_corpora(config, tmp_path / "run2", None)
    assert second.built == [] and "tokenizer" not in second.stages
    assert "trained earlier" in caplog.text
    assert again.state_dict() == tokenizer.state_dict()
    assert np.array_equal(first.train.src_lengths, second.train.src_lengths)
    assert not (tmp_path / "run2/cache").exists(), "data.cache_dir replaces the run's cache"


def test_a_changed_corpus_file_is_prepared_again(tmp_path: Path) -> None:
    config = _config(tmp_path)
    first, tokenizer = load_corpora(config, tmp_path / "run", None)
    with (tmp_path / "train.src").open("a", encoding="utf-8") as handle:
        handle.write("sol luna\n")
    with (tmp_path / "train.trg").open("a", encoding="utf-8") as handle:
        handle.write("LUNA SOL\n")
    again, _ = load_corpora(config, tmp_path / "run", tokenizer)
    assert again.built == ["train"] and len(again.train) == len(first.train) + 1


def test_another_tokenizer_setting_trains_and_prepares_again(tmp_path: Path) -> None:
    config = _config(tmp_path)
    load_corpora(config, tmp_path / "run", None)
    changed = config.model_copy(
        update={"tokenizer": config.tokenizer.model_copy(update={"vocab_size": 45})}
    )
    corpora, tokenizer = load_corpora(changed, tmp_path / "run", None)
    assert corpora.built == ["train", "dev"] and "tokenizer" in corpora.stages
    assert tokenizer.src_vocab_size == 45


def test_dev_keeps_its_long_pairs_and_its_text(tmp_path: Path) -> None:
    config = _config(tmp_path, max_length=8, dev_max_sentences=5)
    corpora, _ = load_corpora(config, tmp_path / "run", None)
    dev = (tmp_path / "dev.src").read_text(encoding="utf-8").splitlines()
    assert len(corpora.dev) == 8 and corpora.dev_src == dev[:5]
    assert int(corpora.train.src_lengths.max()) <= 9 < len(corpora.dev.src_lengths) + 100


# ----------------------------------------------------------------------------- tokenizer sample


def test_the_tokenizer_sample_is_bounded_and_seeded(tmp_path: Path) -> None:
    pairs = [(f"s{i}", f"t{i}") for i in range(1000)]
    pairs[3] = ("", "t3")
    rows = _rows(tmp_path, pairs)
    src, trg = sample_text(rows, 100, seed=1)
    assert 99 <= len(src) == len(trg) <= 100
    assert all(s[1:] == t[1:] for s, t in zip(src, trg, strict=True)), "pairs stay pairs"
    assert sample_text(rows, 100, seed=1) == (src, trg)
    assert sample_text(rows, 100, seed=2) != (src, trg)
    everything = sample_text(rows, 5000, seed=1)
    assert everything[0] == [s for s, _ in pairs if s], "a small split is used whole, in order"


# ----------------------------------------------------------------------------- stages, progress


def test_stage_times_count_nested_stages_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 4.0, 10.0])  # outer starts, inner starts, inner ends, outer ends
    monkeypatch.setattr(stages_module.time, "perf_counter", lambda: next(clock))
    stages = Stages(show=False)
    with stages.stage("tokenise"), stages.stage("read"):
        pass
    assert stages.seconds == {"read": 3.0, "tokenise": 7.0}
    assert stages.summary() == "read 3.0s, tokenise 7.0s"


@pytest.mark.parametrize("compressed", [False, True])
def test_reading_reports_every_byte_of_the_file(tmp_path: Path, compressed: bool) -> None:
    text = "".join(f"línea {i}\n" for i in range(50_000)).encode()
    path = tmp_path / ("c.txt.gz" if compressed else "c.txt")
    path.write_bytes(gzip.compress(text) if compressed else text)
    seen: list[int] = []
    rows = read_file(path, "text", cache_dir=tmp_path / "cache", progress=seen.append)
    assert len(rows) == 50_000
    assert sum(seen) == path.stat().st_size and len(seen) >= 2


def test_preparation_shows_bars_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a terminal each stage gets a bar with an ETA on stderr; elsewhere nothing."""
    from nmt.data import prepare as prepare_module

    config = _config(tmp_path)
    load_corpora(config, tmp_path / "quiet", None)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(prepare_module, "on_terminal", lambda: True)
    shown: list[str] = []
    real_bar = Stages.bar

    def bar(self: Stages, description: str, total: int) -> Any:
        shown.append(f"{description} {total}")
        return real_bar(self, description, total)

    monkeypatch.setattr(Stages, "bar", bar)
    load_corpora(config, tmp_path / "shown", None)
    size = sum((tmp_path / f"train.{side}").stat().st_size for side in ("src", "trg"))
    assert shown[0] == f"reading {tmp_path / 'train'} {size}"
    assert "tokenising train" in capsys.readouterr().err
