"""Batches decoded side by side (``decoding.workers``): the same hypotheses, to the bit, as
one batch after another, whatever the number of workers, with and without a shortlist, in
beam and greedy search, with prefixes; progress heard once per batch on the caller's
thread; a failing batch raised to the caller; torch's thread count given back; how many
workers a device and a backend get; the key's checks in the config and on the command
line."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from clirun import nmt
from searchref import model

from nmt.config import Config, from_dict
from nmt.decoding.options import SearchOptions
from nmt.decoding.shortlist import Shortlist
from nmt.decoding.steering import Steering
from nmt.decoding.translator import Translator
from nmt.decoding.workers import in_workers, worker_count
from nmt.errors import ConfigError

VOCAB = 14


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Torch on 2 threads here, for the workers to share; the suite's count again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _sentences(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (count,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _shortlist() -> Shortlist:
    table = torch.full((VOCAB, 2), -1)
    for piece in range(4, VOCAB):  # each source piece brings two others
        table[piece] = torch.tensor([4 + (piece * 3) % 10, 4 + (piece * 5 + 1) % 10])
    return Shortlist(torch.tensor([4, 5]), table)


def _outputs(hyps: list[list]) -> list[list[tuple]]:
    return [[(h.tokens, h.score, h.log_prob) for h in sentence] for sentence in hyps]


@pytest.mark.parametrize("shortlisted", [False, True])
@pytest.mark.parametrize("beam", [1, 4])
def test_workers_give_the_hypotheses_of_one_batch_after_another(
    shortlisted: bool, beam: int
) -> None:
    """23 sentences in batches of 3 (8 batches, padding in each), n-best 2 of beam 4 or
    greedy: 1, 2 and 3 workers give the same tokens, scores and log-probabilities, exactly."""
    m = model(VOCAB, seed=21, eos=1.5)
    shortlists = [_shortlist()] if shortlisted else None
    config = Config()
    translator = Translator(m, None, config, torch.device("cpu"), shortlists=shortlists)  # type: ignore[arg-type]
    sentences = _sentences(23, seed=22)
    search = SearchOptions(n_best=min(beam, 2))
    want = None
    for workers in (1, 2, 3):
        decoding = config.decoding.model_copy(
            update={"beam_size": beam, "batch_size": 3, "workers": workers, "max_len_offset": 3}
        )
        got = _outputs(translator.decode_ids(sentences, decoding, search))
        assert all(got), "every sentence has hypotheses"
        want = want or got
        assert got == want, f"{workers} workers"
    assert torch.get_num_threads() == 2


def test_each_worker_decodes_in_the_translators_precision() -> None:
    """autocast's state is per thread: bf16 with 2 workers gives bf16's outputs with 1,
    exactly, and not fp32's scores."""
    m = model(VOCAB, seed=29)
    config = Config()
    sentences = _sentences(12, seed=30)
    decoding = config.decoding.model_copy(update={"beam_size": 3, "batch_size": 3})
    scores = {}
    for precision, workers in (("bf16", 1), ("bf16", 2), ("fp32", 1)):
        translator = Translator(m, None, config, torch.device("cpu"), precision)  # type: ignore[arg-type]
        chosen = decoding.model_copy(update={"workers": workers})
        scores[precision, workers] = _outputs(translator.decode_ids(sentences, chosen))
    assert scores["bf16", 2] == scores["bf16", 1]
    bf16 = [h[1] for sentence in scores["bf16", 1] for h in sentence]
    fp32 = [h[1] for sentence in scores["fp32", 1] for h in sentence]
    assert bf16 != fp32


def test_prefixes_reach_their_sentences_under_workers() -> None:
    """Each sentence's prefix forced in whichever thread decodes its batch."""
    m = model(VOCAB, seed=23)
    config = Config()
    translator = Translator(m, None, config, torch.device("cpu"))  # type: ignore[arg-type]
    sentences = _sentences(12, seed=24)
    prefixes = [[4 + i % 9, 4 + (i * 7) % 9] for i in range(12)]
    decoding = config.decoding.model_copy(update={"beam_size": 3, "batch_size": 2, "workers": 2})
    hyps = translator.decode_ids(sentences, decoding, SearchOptions(), None, Steering(prefixes))
    for prefix, sentence in zip(prefixes, hyps, strict=True):
        assert sentence[0].tokens[:2] == prefix


def test_progress_hears_each_batch_on_the_callers_thread() -> None:
    m = model(VOCAB, seed=25)
    config = Config()
    translator = Translator(m, None, config, torch.device("cpu"))  # type: ignore[arg-type]
    heard: list[tuple[int, threading.Thread]] = []
    decoding = config.decoding.model_copy(update={"beam_size": 2, "batch_size": 4, "workers": 2})
    translator.decode_ids(
        _sentences(18, seed=26),
        decoding,
        progress=lambda n: heard.append((n, threading.current_thread())),
    )
    assert sorted(n for n, _ in heard) == [3, 3, 4, 4, 4]  # 18 in five even batches
    assert {thread for _, thread in heard} == {threading.current_thread()}


def test_a_failing_item_is_raised_and_the_thread_count_given_back() -> None:
    threads_seen: list[int] = []

    def run(item: int) -> int:
        threads_seen.append(torch.get_num_threads())
        if item == 3:
            raise ValueError("item 3")
        return item * item

    assert sorted(in_workers(range(6), lambda i: i * i, 2)) == [(i, i * i) for i in range(6)]
    with pytest.raises(ValueError, match="item 3"):
        list(in_workers(range(6), run, 2))
    assert set(threads_seen) == {1}  # each of 2 workers with 1 of the 2 threads
    assert torch.get_num_threads() == 2
    seen_after: list[int] = []
    thread = threading.Thread(target=lambda: seen_after.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen_after == [2]  # a thread started later gets the caller's count again


def test_how_many_workers() -> None:
    """auto: 2 of 2 threads for batches of 16 sentences or more on average, else 1; a
    number is taken as given, up to the batches; auto on a GPU is 1."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert worker_count("auto", cpu, [64] * 5) == 2
    assert worker_count("auto", cpu, [16, 16, 16]) == 2
    assert worker_count("auto", cpu, [16, 16, 15]) == 1  # small batches: one at a time
    assert worker_count("auto", cpu, [1] * 40) == 1
    assert worker_count(2, cpu, [1] * 40) == 2  # as given
    assert worker_count(3, cpu, [64] * 5) == 3
    assert worker_count(8, cpu, [64] * 5) == 5  # no more than the batches
    assert worker_count("auto", cpu, [64]) == 1
    assert worker_count(4, cuda, [64] * 5) == 4  # on a GPU as given: a stream each
    assert worker_count("auto", cuda, [64] * 5) == 1
    torch.set_num_threads(1)  # the fixture sets the suite's count back
    assert worker_count("auto", cpu, [64] * 5) == 1


@pytest.mark.parametrize("value", [0, -1, "many", True, 1.5])
def test_bad_workers_are_named(value: object) -> None:
    with pytest.raises(ConfigError, match=r"x\.yaml: decoding\.workers: got .*; expected a number"):
        from_dict({"decoding": {"workers": value}}, "x.yaml")


def test_the_workers_option(run: Path, tmp_path: Path) -> None:
    """--workers 2 writes what --workers 1 does; 0 is refused in one line, nothing written."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"sol luna mar {i}\n" for i in range(12)), encoding="utf-8")
    outputs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"out-{workers}.txt"
        result = nmt(
            "translate",
            "-m",
            str(run),
            "-i",
            str(source),
            "-o",
            str(out),
            "--batch-size",
            "3",
            "--workers",
            workers,
            "--scores",
        )
        assert result.code == 0, result.err
        outputs[workers] = out.read_text(encoding="utf-8")
    assert outputs["1"] == outputs["2"]
    assert len(outputs["1"].splitlines()) == 12
    refused = tmp_path / "refused.txt"
    error = nmt(
        "translate", "-m", str(run), "-i", str(source), "-o", str(refused), "--workers", "0"
    )
    assert "--workers: got 0; expected a number of threads" in error.error
    assert not refused.exists()
