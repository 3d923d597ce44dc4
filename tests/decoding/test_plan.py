"""The decoding plan says what ran: its workers are the threads that decoded at once, its
shortlist the columns searched, its loop the forced pass of scoring; its one line and its
dict; the kernels' and the shortlist's rules."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from searchref import model

from nmt.config import Config
from nmt.decoding import plan as plans
from nmt.decoding import translator as translator_module
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.plan import DecodingPlan, kernels_run, shortlist_used
from nmt.decoding.shortlist import Shortlist
from nmt.decoding.translator import Translator
from nmt.errors import ConfigError
from nmt.fast import compiled

VOCAB = 14
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _sentences(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 9, (count,), generator=generator).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _shortlist() -> Shortlist:
    table = torch.full((VOCAB, 2), -1)
    for piece in range(4, VOCAB):
        table[piece] = torch.tensor([4 + (piece * 3) % 10, 4 + (piece * 5 + 1) % 10])
    return Shortlist(torch.tensor([4, 5]), table)


def _translator(shortlisted: bool = False) -> Translator:
    shortlists = [_shortlist()] if shortlisted else None
    return Translator(model(VOCAB, seed=5), None, Config(), CPU, shortlists=shortlists)  # type: ignore[arg-type]


def _decoding(**update: object):  # type: ignore[no-untyped-def]
    return Config().decoding.model_copy(
        update={"beam_size": 2, "batch_size": 3, "max_len_offset": 3, **update}
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_the_plans_workers_are_the_threads_that_decode_at_once(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch's search records its thread; with 2 workers the first two searches wait
    for each other (a barrier that one thread alone would break), with 1 every batch is
    searched on the caller's thread."""
    searched: list[str] = []
    barrier = threading.Barrier(2, timeout=20)
    search = translator_module.beam_search

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        searched.append(threading.current_thread().name)
        if workers == 2 and len(searched) <= 2:
            barrier.wait()
        return search(*args, **kwargs)

    monkeypatch.setattr(translator_module, "beam_search", recorded)
    translator = _translator()
    translator.decode_ids(_sentences(12), _decoding(workers=workers))
    plan = translator.last_plan
    assert plan is not None and plan.workers == workers
    assert len(searched) == 4  # 12 sentences in batches of 3
    threads = set(searched)
    if workers == 1:
        assert threads == {threading.current_thread().name}
    else:
        assert len(threads) == 2 and all(name.startswith("nmt-decode") for name in threads)
    assert f", {workers} worker{'s' if workers > 1 else ''}," in plan.line()


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_the_plans_shortlist_is_the_search_over_its_columns(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shortlisted plan searches each batch over its columns (batch_columns called per
    batch); an unshortlisted one over the whole output layer (never called)."""
    calls: list[int] = []
    columns = translator_module.batch_columns

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return columns(*args, **kwargs)

    monkeypatch.setattr(translator_module, "batch_columns", counted)
    translator = _translator(shortlisted=True)
    translator.decode_ids(_sentences(7), _decoding(shortlist=mode, workers=1))
    plan = translator.last_plan
    assert plan is not None
    assert plan.shortlist is (mode != "off")
    assert len(calls) == (3 if plan.shortlist else 0)  # 7 sentences in batches of 3
    assert f", shortlist {'on' if plan.shortlist else 'off'}," in plan.line()


def test_scoring_is_a_forced_pass_and_its_line_and_dict() -> None:
    translator = _translator()
    decoding = _decoding()
    plan = translator.plan(decoding, forced=True)
    kernels = "compiled" if compiled.library() is not None else "torch"
    want = DecodingPlan("fp32", "as given: fp32", kernels, "forced", 1, False, "torch")
    assert plan == want
    said = "compiled kernels" if kernels == "compiled" else "torch ops"
    assert plan.line() == (
        f"Decoding plan: fp32 (as given: fp32), {said}, forced pass, 1 worker, shortlist off, torch"
    )
    assert plan.as_dict() == {
        "precision": "fp32",
        "reason": "as given: fp32",
        "kernels": kernels,
        "loop": "forced",
        "workers": 1,
        "shortlist": False,
        "backend": "torch",
        "line": plan.line(),
    }


def test_kernels_run_on_a_cpu_in_fp32_where_the_models_take_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plans.compiled, "library", lambda: object())
    assert kernels_run("torch", CPU, "fp32", True) == "compiled"
    assert kernels_run("torch", CPU, "bf16", True) == "torch"
    assert kernels_run("torch", CPU, "fp32", False) == "torch"
    assert kernels_run("torch", torch.device("cuda"), "fp32", True) == "torch"
    assert kernels_run("onnxruntime", CPU, "fp32", True) == "onnxruntime"
    monkeypatch.setattr(plans.compiled, "library", lambda: None)  # no C compiler
    assert kernels_run("torch", CPU, "fp32", True) == "torch"


def test_when_a_shortlist_is_used() -> None:
    """auto: the models' when they have one, in torch on a CPU; on: an error without one or
    with exported graphs; off: none. The Translator asks the same rule."""

    def decoding(mode: str):  # type: ignore[no-untyped-def]
        return _decoding(shortlist=mode)

    cuda = torch.device("cuda")
    assert shortlist_used(decoding("auto"), CPU, "torch", True)
    assert shortlist_used(decoding("on"), CPU, "torch", True)
    assert not shortlist_used(decoding("off"), CPU, "torch", True)
    assert not shortlist_used(decoding("auto"), CPU, "torch", False)
    assert not shortlist_used(decoding("auto"), CPU, "onnxruntime", True)
    assert not shortlist_used(decoding("auto"), cuda, "torch", True)  # a GPU: the whole layer
    assert shortlist_used(decoding("on"), cuda, "torch", True)
    with pytest.raises(ConfigError, match="--shortlist on: a model's checkpoint has no shortlist"):
        shortlist_used(decoding("on"), CPU, "torch", False)
    with pytest.raises(ConfigError, match="--shortlist on: the exported graphs"):
        shortlist_used(decoding("on"), CPU, "onnxruntime", True)
    m = model(VOCAB, seed=1)
    exported = Translator([], None, Config(), CPU, backend=Ensemble([m]))  # type: ignore[arg-type]
    assert exported.plan(decoding("auto")).backend == "onnxruntime"
    assert exported.decoding_shortlists(decoding("auto")) is None
    with pytest.raises(ConfigError, match="--shortlist on: the exported graphs"):
        exported.decoding_shortlists(decoding("on"))
