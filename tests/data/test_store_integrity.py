"""The prepared store proves itself: a damaged entry is named in one warning, removed and
prepared again into the same batches; a read-only cache, a full disk and two runs preparing
one store at once end in a one-line error or in the right data, never in wrong ids."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from nmt.config import Config, DataConfig, from_dict
from nmt.data import store as store_module
from nmt.data.batching import bucket_batches
from nmt.data.corpus import read_pairs
from nmt.data.prepare import load_corpora
from nmt.data.store import Encode, Prepared, Store, TokenizedCorpus, prepare
from nmt.data.tokenizer import Tokenizer, train_sentencepiece
from nmt.errors import DataError, NMTError
from tests.synthetic import data_section, write_corpus

ROOT = Path(__file__).resolve().parents[2]
TEXT = DataConfig(format="text", src_lang="src", trg_lang="trg")
PARTS = {"source": "tiny"}
MAX_LENGTH = 6  # drops some of the tiny corpus's pairs, so rows.npy is not 0..N-1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), {"train": 300})


@pytest.fixture(scope="module")
def tokenizer(corpus: Path) -> Tokenizer:
    lines = [
        line
        for side in ("src", "trg")
        for line in (corpus / f"train.{side}").read_text().split("\n")
    ]
    proto = train_sentencepiece([line for line in lines if line], 40, "unigram", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def prepare_train(
    store: Store, corpus: Path, tokenizer: Tokenizer, num_proc: int = 1, rows: Any = None
) -> tuple[Prepared, bool]:
    def read() -> Any:
        return read_pairs(TEXT, str(corpus / "train"), corpus / "cache")

    encode = Encode(tokenizer, MAX_LENGTH, keep_text=False)
    return prepare(store, "train", PARTS, rows or read, encode, num_proc, False)


def batches(prepared: Prepared) -> list[list[np.ndarray]]:
    """An epoch's training batches: each one's pair indices and (src, lengths, trg_in,
    trg_out), with the lengths that batching reads."""
    corpus = TokenizedCorpus(prepared)
    out = [[corpus.row_ids, corpus.src_lengths, corpus.trg_lengths]]
    for indices in bucket_batches(corpus.src_lengths, corpus.trg_lengths, 60, seed=1, epoch=0):
        out.append([indices, *(tensor.numpy() for tensor in corpus.batch(indices).tensors())])
    return out


def assert_same_batches(prepared: Prepared, expected: list[list[np.ndarray]]) -> None:
    got = batches(prepared)
    assert len(got) == len(expected) > 2
    for a, b in zip(got, expected, strict=True):
        assert len(a) == len(b) and all(map(np.array_equal, a, b))


@pytest.fixture(scope="module")
def clean(
    tmp_path_factory: pytest.TempPathFactory, corpus: Path, tokenizer: Tokenizer
) -> list[list[np.ndarray]]:
    """The batches of a store prepared once, untouched."""
    prepared, _ = prepare_train(Store(tmp_path_factory.mktemp("clean")), corpus, tokenizer)
    assert 0 < prepared.counts["long"] < prepared.counts["pairs"]
    return batches(prepared)


def as_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which entries this process has checksummed, as a new run would."""
    monkeypatch.setattr(store_module, "_verified", set())


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@dataclass
class Entry:
    """A store with the tiny corpus prepared in it, and the way back in as a new process."""

    store: Store
    first: Prepared
    corpus: Path
    tokenizer: Tokenizer
    monkeypatch: pytest.MonkeyPatch
    caplog: pytest.LogCaptureFixture

    def prepared_again(self) -> tuple[Prepared, bool, list[str]]:
        """The entry as a new process finds it: (prepared, built anew, the warnings)."""
        as_a_new_process(self.monkeypatch)
        with self.caplog.at_level(logging.WARNING, logger="nmt"):
            again, built = prepare_train(self.store, self.corpus, self.tokenizer)
        return again, built, warnings(self.caplog)


@pytest.fixture()
def entry(
    corpus: Path,
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> Entry:
    store = Store(tmp_path / "store")
    first, _ = prepare_train(store, corpus, tokenizer)
    return Entry(store, first, corpus, tokenizer, monkeypatch, caplog)


# ----------------------------------------------------------------------------- damage


def truncate(path: Path) -> str:
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.truncate(size // 2)
    return f"{size // 2} bytes, the manifest says {size}"


def overwrite(path: Path) -> str:
    """Flip four bytes in the middle: the same size, other contents."""
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size // 2)
        old = handle.read(4)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in old))
    assert path.stat().st_size == size
    return "checksum differs from its manifest (damaged on disk?)"


def delete(path: Path) -> str:
    path.unlink()
    return "missing"


@pytest.mark.parametrize("damage", [truncate, overwrite, delete])
@pytest.mark.parametrize("file", ["shard", "rows.npy", "src_len.npy", "trg_len.npy"])
def test_a_damaged_file_is_named_and_prepared_again(
    file: str, damage: Callable[[Path], str], entry: Entry, clean: list[list[np.ndarray]]
) -> None:
    first = entry.first
    path = first.path / (first.manifest["shards"][0] if file == "shard" else file)
    what = damage(path)
    again, built, warned = entry.prepared_again()
    assert built and warned == [f"{path}: {what}; preparing it again"]
    assert again.manifest["files"] == first.manifest["files"], "the same bytes again"
    assert_same_batches(again, clean)
    names = [p.name for p in entry.store.prepared.iterdir()]
    assert names == [again.path.name], "nothing left over"


@pytest.mark.parametrize("damage", ["data files gone", "manifest cut short", "manifest gone"])
def test_a_damaged_manifest_or_a_bare_one_is_prepared_again(
    damage: str, entry: Entry, clean: list[list[np.ndarray]]
) -> None:
    first = entry.first
    manifest = first.path / "manifest.json"
    files = list(first.manifest["files"])
    if damage == "data files gone":
        for name in files:
            (first.path / name).unlink()
        expected = f"{first.path / files[0]}: missing (and {len(files) - 1} other files)"
    elif damage == "manifest cut short":
        manifest.write_bytes(manifest.read_bytes()[:100])
        expected = f"{manifest}: unreadable ("
    else:
        manifest.unlink()
        expected = f"{manifest}: missing"
    again, built, (warning,) = entry.prepared_again()
    assert built and warning.startswith(expected) and warning.endswith("; preparing it again")
    assert_same_batches(again, clean)


def test_a_file_cut_short_is_caught_by_the_process_that_verified_it(
    corpus: Path, tokenizer: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checksums are verified once per process, but sizes each time an entry is opened."""
    store = Store(tmp_path / "store")
    first, _ = prepare_train(store, corpus, tokenizer)
    what = truncate(first.path / "src_len.npy")
    with caplog.at_level(logging.WARNING, logger="nmt"):
        _, built = prepare_train(store, corpus, tokenizer)
    assert built and warnings(caplog) == [
        f"{first.path / 'src_len.npy'}: {what}; preparing it again"
    ]


def test_checksums_are_verified_once_per_process(
    corpus: Path, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[str] = []
    real = store_module.checksum

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(store_module, "checksum", counted)
    store = Store(tmp_path / "store")
    first, built = prepare_train(store, corpus, tokenizer)
    files = sorted(first.manifest["files"])
    assert built and sorted(hashed) == files, "each file hashed once, when sealed"
    hashed.clear()
    _, built = prepare_train(Store(store.root), corpus, tokenizer)
    assert not built and hashed == [], "its builder does not hash it again"
    as_a_new_process(monkeypatch)
    for _ in range(2):
        _, built = prepare_train(store, corpus, tokenizer)
        assert not built
    assert sorted(hashed) == files, "a new process hashes each file once, then never again"
    assert store.stages.seconds["verify"] > 0


def _config(root: Path) -> Config:
    write_corpus(root, {"train": 300, "dev": 8})
    return from_dict(
        {
            "data": {**data_section(root), "cache_dir": str(root / "shared")},
            "tokenizer": {"vocab_size": 40, "type": "bpe"},
            "run": {"dir": str(root / "run"), "tensorboard": False},
        }
    )


def test_a_run_on_a_prepared_store_logs_the_seconds_spent_verifying_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    first, _ = load_corpora(config, tmp_path / "run1", None)
    assert first.built == ["train", "dev"] and "verify" not in first.stages
    as_a_new_process(monkeypatch)
    with caplog.at_level(logging.INFO, logger="nmt"):
        second, _ = load_corpora(config, tmp_path / "run2", None)
    assert second.built == [] and second.stages["verify"] > 0
    found = [r.getMessage() for r in caplog.records if "data: found prepared" in r.getMessage()]
    assert found == [
        f"data: found prepared, verify {second.stages['verify']:.2f}s ({tmp_path / 'shared'})"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nmt"):
        third, _ = load_corpora(config, tmp_path / "run3", None)
    assert "verify" not in third.stages and "data: found prepared" not in caplog.text


def test_a_damaged_tokenizer_in_the_store_is_trained_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    load_corpora(config, tmp_path / "run1", None)
    (model,) = (tmp_path / "shared" / "prepared").glob("tokenizer-*/src.model")
    what = overwrite(model)
    as_a_new_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nmt"):
        corpora, again = load_corpora(config, tmp_path / "run2", None)
    assert warnings(caplog) == [f"{model}: {what}; preparing it again"]
    assert "tokenizer" in corpora.stages and again.src_vocab_size == 40
    (entry,) = (tmp_path / "shared" / "prepared").glob("tokenizer-*")
    assert (entry / "src.model").read_bytes() == again.src_proto


# ----------------------------------------------------------------------------- cannot rebuild


@pytest.mark.parametrize("refusal", ["read-only folder", "read-only file system"])
def test_a_damaged_entry_that_cannot_be_removed_is_an_error(
    refusal: str,
    corpus: Path,
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(tmp_path / "store")
    first, _ = prepare_train(store, corpus, tokenizer)
    path = first.path / "src_len.npy"
    overwrite(path)
    as_a_new_process(monkeypatch)
    if refusal == "read-only file system":

        def rename(self: Path, target: Any) -> Path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

        monkeypatch.setattr(Path, "rename", rename)
    store.prepared.chmod(0o555 if refusal == "read-only folder" else 0o755)
    try:
        if refusal == "read-only folder" and os.access(store.prepared, os.W_OK):
            pytest.skip("a read-only folder does not stop this user (root) writing")
        with pytest.raises(DataError) as error:
            prepare_train(store, corpus, tokenizer)
    finally:
        store.prepared.chmod(0o755)
    message = str(error.value)
    assert message.startswith(f"{path}: checksum differs from its manifest")
    assert f"make data.cache_dir ({store.root}) writable or point data.cache_dir" in message
    assert "\n" not in message
    assert all((first.path / name).is_file() for name in first.manifest["files"]), "untouched"


# ----------------------------------------------------------------------------- full disk


@pytest.mark.parametrize("where", ["np.save", "manifest", "map"])
def test_a_full_disk_is_an_error_naming_the_file_and_leaves_nothing(
    where: str, corpus: Path, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    named = {"np.save": "src_len.npy", "manifest": "manifest.json", "map": "ids.arrow"}[where]
    if where == "np.save":
        real_save = np.save

        def save(file: Any, array: Any, *args: Any, **kwargs: Any) -> None:
            if Path(file).name == named:
                full()
            real_save(file, array, *args, **kwargs)

        monkeypatch.setattr(store_module.np, "save", save)
    elif where == "manifest":
        monkeypatch.setattr(store_module, "atomic_write_text", full)
    else:
        from datasets import arrow_writer

        monkeypatch.setattr(arrow_writer.ArrowWriter, "write_batch", full)
        monkeypatch.setattr(arrow_writer.ArrowWriter, "write_table", full)
    store = Store(tmp_path / "store")
    with pytest.raises(DataError) as error:
        prepare_train(store, corpus, tokenizer)
    message = str(error.value)
    assert f"/{named}: cannot write prepared data (No space left on device)" in message
    assert message.startswith(str(store.prepared)) and "free space" in message
    assert "\n" not in message
    assert list(store.prepared.iterdir()) == [], "no temporary folder left behind"


def test_a_write_error_that_already_names_its_file_is_not_said_twice(
    corpus: Path, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An atomic write's own one-line error (an NMTError that is also an OSError) becomes
    the DataError as it is, not wrapped in a second message."""

    class Refused(NMTError, OSError):
        pass

    said = "x/manifest.json: cannot write it (No space left on device); free some space"

    def refuse(*args: Any) -> None:
        raise Refused(said)

    monkeypatch.setattr(store_module, "atomic_write_text", refuse)
    store = Store(tmp_path / "store")
    with pytest.raises(DataError) as error:
        prepare_train(store, corpus, tokenizer)
    assert str(error.value) == said and list(store.prepared.iterdir()) == []


# ----------------------------------------------------------------------------- twins


def test_a_twin_that_published_first_wins(
    corpus: Path,
    tokenizer: Tokenizer,
    clean: list[list[np.ndarray]],
    tmp_path: Path,
) -> None:
    """While this process tokenises, another (two processes: other shards) publishes the
    same entry; this one then uses the twin's entry and removes its own."""
    store = Store(tmp_path / "store")
    twins = []

    def rows_while_a_twin_publishes() -> Any:
        twins.append(prepare_train(Store(store.root), corpus, tokenizer, num_proc=2)[0])
        return read_pairs(TEXT, str(corpus / "train"), corpus / "cache")

    loser, built = prepare_train(store, corpus, tokenizer, rows=rows_while_a_twin_publishes)
    (twin,) = twins
    assert built and loser.path == twin.path and len(twin.manifest["shards"]) == 2
    assert loser.manifest == twin.manifest, "the winner's manifest, not the loser's"
    assert [p.name for p in store.prepared.iterdir()] == [twin.path.name]
    assert_same_batches(loser, clean)


def test_a_damaged_twin_entry_is_replaced_by_ours(
    corpus: Path,
    tokenizer: Tokenizer,
    clean: list[list[np.ndarray]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store(tmp_path / "store")
    damaged = []

    def rows_while_a_twin_publishes_garbage() -> Any:
        twin, _ = prepare_train(Store(store.root), corpus, tokenizer, num_proc=2)
        damaged.append(twin.path / "trg_len.npy")
        overwrite(damaged[0])
        as_a_new_process(monkeypatch)
        return read_pairs(TEXT, str(corpus / "train"), corpus / "cache")

    with caplog.at_level(logging.WARNING, logger="nmt"):
        ours, built = prepare_train(
            store, corpus, tokenizer, rows=rows_while_a_twin_publishes_garbage
        )
    assert built and ours.manifest["shards"] == ["ids.arrow"], "this process's own entry"
    assert warnings(caplog) == [
        f"{damaged[0]}: checksum differs from its manifest (damaged on disk?); preparing it again"
    ]
    assert_same_batches(ours, clean)
    assert [p.name for p in store.prepared.iterdir()] == [ours.path.name]


def ids_digest(prepared: Prepared) -> str:
    """One hash of a prepared split's kept rows, lengths and every pair's ids."""
    corpus = TokenizedCorpus(prepared)
    digest = xxhash.xxh3_128()
    for array in (corpus.row_ids, corpus.src_lengths, corpus.trg_lengths):
        digest.update(array.tobytes())
    for tensor in corpus.batch(np.arange(len(corpus))).tensors():
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def prepare_in_rounds(work: Path, me: str, rounds: int) -> None:
    """A child process: in each round, say it is ready, wait for the go, prepare
    ``work/store-{round}``; prints what it got, as JSON."""
    proto = (work / "tokenizer.model").read_bytes()
    tokenizer = Tokenizer(proto, proto)
    rows = read_pairs(TEXT, str(work / "corpus" / "train"), work / f"cache-{me}")
    results = []
    for round in range(rounds):
        (work / f"ready-{round}-{me}").touch()
        while not (work / f"go-{round}").exists():
            time.sleep(0.005)
        store = Store(work / f"store-{round}")
        prepared, built = prepare_train(store, work / "corpus", tokenizer, rows=lambda: rows)
        files = prepared.manifest["files"]
        results.append({"built": built, "files": files, "ids": ids_digest(prepared)})
    print(json.dumps(results))


def test_two_processes_preparing_one_store_at_once_agree_with_one_alone(
    corpus: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Two processes start preparing the same entry at the same moment, three times over:
    both end with the entry one process prepares alone, and no temporary folder is left."""
    rounds = 3
    (tmp_path / "corpus").symlink_to(corpus)
    (tmp_path / "tokenizer.model").write_bytes(tokenizer.src_proto)
    code = "import sys; from tests.data.test_store_integrity import prepare_in_rounds as p; "
    code += "from pathlib import Path; p(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), str(me), str(rounds)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(2)
    ]
    try:
        for round in range(rounds):
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"ready-{round}-{me}").exists() for me in range(2)):
                assert all(child.poll() is None for child in children), "a child failed"
                assert time.monotonic() < deadline, "the children never got ready"
                time.sleep(0.01)
            (tmp_path / f"go-{round}").touch()
        outputs = [child.communicate(timeout=300) for child in children]
    finally:
        for child in children:
            child.kill()
    for child, (_, stderr) in zip(children, outputs, strict=True):
        assert child.returncode == 0, stderr
    results = [json.loads(stdout) for stdout, _ in outputs]
    alone, _ = prepare_train(Store(tmp_path / "alone"), corpus, tokenizer)
    for round in range(rounds):
        prepared = tmp_path / f"store-{round}" / "prepared"
        assert [p.name for p in prepared.iterdir()] == [alone.path.name], "no temporary folders"
        manifest = json.loads((prepared / alone.path.name / "manifest.json").read_text())
        assert manifest["files"] == alone.manifest["files"], "byte for byte what one prepares"
        for child in results:
            assert child[round]["files"] == alone.manifest["files"]
            assert child[round]["ids"] == ids_digest(alone)
    print(
        "rounds both children built:", [all(c[r]["built"] for c in results) for r in range(rounds)]
    )
