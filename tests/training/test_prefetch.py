"""training.prefetch: the next update's batches made on a background thread (``Prefetch``).
The batches it hands back are those the loop would make itself, made on its thread; batches
it was not handed are made at once; its thread's error reaches the loop where the loop would
have met it; and a run with it on trains to the same weights, bit for bit, as a run without
(accumulation, an epoch boundary, subword sampling's new corpus each epoch)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import nmt, tiny_config, write_config

from nmt import checkpoint
from nmt.config import from_dict
from nmt.data.batching import Batch, make_batch
from nmt.training import batches as batches_module
from nmt.training.batches import Prefetch, host_batch


class _Corpus:
    """Reversal pairs of varied lengths; each batch notes the thread that made it."""

    def __init__(self, size: int = 20, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.src, self.trg = [], []
        for _ in range(size):
            seq = rng.integers(4, 14, size=int(rng.integers(2, 9))).tolist()
            self.src.append([*seq, 3])
            self.trg.append(seq[::-1])
        self.src_lengths = np.array([len(s) for s in self.src])
        self.trg_lengths = np.array([len(t) + 1 for t in self.trg])
        self.threads: list[str] = []
        self.fail_on: int | None = None

    def batch(self, indices: np.ndarray) -> Batch:
        self.threads.append(threading.current_thread().name)
        if self.fail_on is not None and self.fail_on in indices.tolist():
            raise OSError(f"pair {self.fail_on}: damaged")
        rows = indices.tolist()
        return make_batch([self.src[i] for i in rows], [self.trg[i] for i in rows], indices)


def _equal(a: Batch, b: Batch) -> bool:
    return all(
        torch.equal(getattr(a, name), getattr(b, name))
        for name in ("src", "src_lengths", "trg_in", "trg_out")
    )


@pytest.mark.parametrize("shaped", [False, True])
def test_batches_handed_ahead_are_made_on_the_thread_as_the_loop_makes_them(shaped: bool) -> None:
    corpus = _Corpus()
    shard = [np.array([0, 3, 5]), np.array([7, 1])]
    prefetch = Prefetch(True)
    try:
        prefetch.ahead(corpus, shard, 200, shaped)
        got = prefetch.take(corpus, shard, 200, shaped)
    finally:
        prefetch.close()
    assert corpus.threads and all(name.startswith("nmt-batches") for name in corpus.threads)
    want = [host_batch(corpus, indices, 200, shaped) for indices in shard]
    assert len(got) == len(want) and all(_equal(g, w) for g, w in zip(got, want, strict=True))


def test_other_batches_are_made_at_once_on_the_callers_thread() -> None:
    corpus = _Corpus()
    first, second = [np.array([0, 1])], [np.array([2, 3])]
    prefetch = Prefetch(True)
    try:
        prefetch.ahead(corpus, first, 200, False)
        got = prefetch.take(corpus, second, 200, False)  # not what it was handed
        corpus.threads.clear()
        # equal index values in another array are other batches (an epoch's own arrays)
        prefetch.ahead(corpus, first, 200, False)
        again = prefetch.take(corpus, [np.array([0, 1])], 200, False)
        # and the same arrays under another setting too
        prefetch.ahead(corpus, first, 200, False)
        shaped = prefetch.take(corpus, first, 200, True)
    finally:
        prefetch.close()
    assert _equal(got[0], host_batch(corpus, second[0], 200, False))
    assert _equal(again[0], host_batch(corpus, first[0], 200, False))
    assert _equal(shaped[0], host_batch(corpus, first[0], 200, True))
    assert threading.current_thread().name in corpus.threads


def test_the_threads_error_is_raised_where_its_batch_is_taken() -> None:
    corpus = _Corpus()
    corpus.fail_on = 4
    shard = [np.array([4, 5])]
    prefetch = Prefetch(True)
    try:
        prefetch.ahead(corpus, shard, 200, False)  # no error yet
        with pytest.raises(OSError, match="pair 4: damaged"):
            prefetch.take(corpus, shard, 200, False)
        prefetch.ahead(corpus, shard, 200, False)  # handed ahead, never taken: dropped
    finally:
        prefetch.close()


def test_off_it_makes_every_batch_when_taken() -> None:
    corpus = _Corpus()
    shard = [np.array([0, 2])]
    prefetch = Prefetch(False)
    prefetch.ahead(corpus, shard, 200, False)
    assert corpus.threads == []
    got = prefetch.take(corpus, shard, 200, False)
    assert corpus.threads == [threading.current_thread().name]
    assert _equal(got[0], host_batch(corpus, shard[0], 200, False))
    prefetch.close()


def test_the_setting_and_its_default() -> None:
    from nmt.training.run import _prefetch

    assert from_dict({}).training.prefetch is None
    assert _prefetch(None, torch.device("cpu")) is False
    assert _prefetch(None, torch.device("cuda")) is True
    assert _prefetch(True, torch.device("cpu")) is True
    assert _prefetch(False, torch.device("cuda")) is False


def test_a_run_with_prefetch_trains_as_one_without(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accumulate 2, two epochs with sampled segmentations (a new corpus each epoch): the
    same weights and logged losses to the bit, the batches after each update's first made on
    the background thread."""
    threads: list[str] = []
    made = batches_module.host_batch

    def noted(*args: object) -> Batch:
        threads.append(threading.current_thread().name)
        return made(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(batches_module, "host_batch", noted)
    runs = {}
    for setting in ("false", "true"):
        root = tmp_path / setting
        root.mkdir()
        config = tiny_config(corpus)
        config["training"].update(
            {"accumulate": 2, "epochs": 2, "max_steps": 30, "log_every": 1, "validate_every": 10}
        )
        config["tokenizer"].update({"type": "unigram", "sampling_alpha": 0.2})
        config["run"] = {"dir": str(root / "run"), "device": "cpu", "tensorboard": False}
        path = write_config(root / "c.yaml", config)
        threads.clear()
        result = nmt("train", str(path), "--quiet", "-O", f"training.prefetch={setting}")
        assert result.code == 0, result.err
        runs[setting] = root / "run"
        on_thread = sum(name.startswith("nmt-batches") for name in threads)
        if setting == "false":
            assert on_thread == 0
        else:  # all but the first update of each epoch
            assert on_thread >= len(threads) - 2 * 2 > 0
    off, on = (checkpoint.load(runs[s] / "last.pt") for s in ("false", "true"))
    assert off["progress"]["epoch"] == on["progress"]["epoch"] >= 1
    assert off["progress"]["step"] == on["progress"]["step"]
    for name, weight in off["model"].items():
        assert torch.equal(on["model"][name], weight), name
    logged = [_metrics(runs[s] / "metrics.jsonl") for s in ("false", "true")]
    assert len(logged[0]) >= 15 and logged[0] == logged[1]


def _metrics(path: Path) -> list[dict[str, object]]:
    """metrics.jsonl's rows without what the clock says (time, speed)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    clock = {"time", "target_tokens_per_s"}
    return [{k: v for k, v in row.items() if k not in clock} for row in rows]
