"""A CPU search's ``auto`` precision: measured on the model's own search, not on one matmul.
CPU flags and the matmul probe are mocked (this CPU may have no native bf16); the searches
the probe times are real, or stand-ins that take a set time."""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cpus import described_cpu

import nmt.fast.precision as precision
from nmt.config import DecodingConfig
from nmt.decoding import search_precision
from nmt.decoding.search_precision import SEARCH_STEPS, SOURCE_LENGTH, choose_search_precision
from nmt.decoding.translator import Translator
from nmt.fast.precision import Probe
from nmt.files import read_lines

NATIVE = {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}
AVX2 = {"fpu", "avx2", "fma"}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """A CPU whose flags and matmul probe the test sets; an empty cache of its own."""
    described_cpu(monkeypatch, tmp_path)

    class Machine:
        matmul_calls = 0

        def set(self, flags: set[str], matmul: Probe) -> None:
            monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags))

            def probe(shapes: list[list[int]]) -> Probe:
                self.matmul_calls += 1
                return matmul

            monkeypatch.setattr(precision, "run_probe", probe)

    return Machine()


class Timed:
    """A searcher that takes ``seconds`` a search and records what it was asked."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.calls: list[tuple[list[list[int]], DecodingConfig]] = []

    def decode_ids(self, src_ids: Any, decoding: DecodingConfig) -> list[Any]:
        self.calls.append((list(src_ids), decoding))
        time.sleep(self.seconds)
        return []


def searchers(fp32_s: float, bf16_s: float) -> tuple[dict[str, Timed], Any]:
    made = {"fp32": Timed(fp32_s), "bf16": Timed(bf16_s)}
    return made, made.__getitem__


FAST_MATMULS = Probe(1.0, 0.4, [[1, 2, 3]], screen_only=False)  # bf16 matmuls 2.5x faster


def test_without_native_bf16_the_search_is_fp32_and_nothing_is_timed(
    machine: Any, trained_config: Any
) -> None:
    machine.set(AVX2, FAST_MATMULS)
    made, make = searchers(0.01, 0.001)
    chosen = choose_search_precision(make, trained_config, 1, 40)
    assert chosen.name == "fp32"
    assert chosen.reason == "auto: this CPU has no native bf16 matmuls"
    assert not made["fp32"].calls and not made["bf16"].calls and machine.matmul_calls == 0


def test_emulated_bf16_matmuls_are_fp32_without_timing_a_search(
    machine: Any, trained_config: Any
) -> None:
    machine.set(NATIVE, Probe(0.001, 1.0, [[64, 256, 1024]], screen_only=True))
    made, make = searchers(0.01, 0.001)
    chosen = choose_search_precision(make, trained_config, 1, 40)
    assert chosen.name == "fp32" and not made["bf16"].calls


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "expected"),
    [(0.03, 0.01, "bf16"), (0.01, 0.03, "fp32"), (0.02, 0.019, "fp32")],
)
def test_the_faster_whole_search_wins_not_the_faster_matmul(
    machine: Any, trained_config: Any, fp32_s: float, bf16_s: float, expected: str
) -> None:
    """bf16 matmuls 2.5x faster in every case; the search decides (bf16 must be 1.1x)."""
    machine.set(NATIVE, FAST_MATMULS)
    made, make = searchers(fp32_s, bf16_s)
    chosen = choose_search_precision(make, trained_config, 1, 40)
    assert chosen.name == expected, chosen
    assert chosen.probe is not None
    assert chosen.probe.speedup == pytest.approx(fp32_s / bf16_s, rel=0.5)
    assert "this model's search ran at" in chosen.reason
    decoding = trained_config.decoding
    assert f"{decoding.batch_size} sentences x beam {decoding.beam_size}" in chosen.reason
    # a warm-up and the repeats, each one batch; one repeat where bf16 is clearly slower
    clearly = bf16_s > search_precision.CLEARLY_SLOWER * fp32_s
    repeats = 1 if clearly else search_precision.PROBE_REPEATS
    for searcher in made.values():
        assert len(searcher.calls) == repeats + 1
        src, probed = searcher.calls[0]
        assert len(src) == decoding.batch_size
        assert {len(s) for s in src} == {SOURCE_LENGTH}
        assert min(min(s) for s in src) > 3  # no specials: pieces of the vocabulary
        assert probed.beam_size == decoding.beam_size and probed.workers == 1
        limit = -(-probed.max_len_ratio * SOURCE_LENGTH // 1) + probed.max_len_offset
        assert limit == SEARCH_STEPS


def test_the_verdict_is_cached_per_model_and_search_shape(
    machine: Any, trained_config: Any
) -> None:
    machine.set(NATIVE, FAST_MATMULS)
    made, make = searchers(0.01, 0.02)
    first = choose_search_precision(make, trained_config, 1, 40)
    calls = len(made["fp32"].calls)
    again = choose_search_precision(make, trained_config, 1, 40)
    assert len(made["fp32"].calls) == calls, "the cached verdict is not measured again"
    assert again.name == first.name == "fp32" and "cached probe" in again.reason
    beam = trained_config.model_copy(
        update={"decoding": trained_config.decoding.model_copy(update={"beam_size": 2})}
    )
    choose_search_precision(make, beam, 1, 40)
    assert len(made["fp32"].calls) > calls, "another search shape is measured anew"


def test_a_real_search_decides_and_the_outputs_are_fp32_s(
    machine: Any, run: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a checkpoint, on a CPU whose bf16 matmuls the matmul probe finds 2.5x faster
    (mocked) and whose screen is passed: the model's own searches are timed, in fp32 and
    in bf16 autocast, and their ratio decides, not the matmul probe. Which wins on this
    machine is a timing, which no test asserts: the ratio needed is raised past any, so
    fp32 is chosen with the measured ratio as its reason (the rule at the bar itself: the
    tests above, with timed stand-ins)."""
    machine.set(NATIVE, FAST_MATMULS)
    monkeypatch.setattr(precision, "MIN_WEIGHT", 1)  # the tiny model's matmuls are probed
    monkeypatch.setattr(search_precision, "SPEEDUP_NEEDED", math.inf)
    translator = Translator.from_checkpoints([run], "cpu", "auto")
    assert translator.precision == "fp32", translator.precision_reason
    assert translator.precision_reason.startswith("auto: this model's search ran at ")
    line = translator.plan(translator.config.decoding).line()
    assert line.startswith("Decoding plan: fp32 (auto: this model's search ran at ")
    fp32 = Translator.from_checkpoints([run], "cpu", "fp32")
    lines = read_lines(str(corpus / "test.src"))
    decoding = fp32.config.decoding
    got = [translator.best_text(t) for t in translator.translate(lines, decoding)]
    want = [fp32.best_text(t) for t in fp32.translate(lines, decoding)]
    assert got == want


@pytest.fixture
def trained_config(run: Path) -> Any:
    return Translator.from_checkpoints([run], "cpu", "fp32").config


def test_the_search_probe_times_both_precisions_for_real(run: Path) -> None:
    translator = Translator.from_checkpoints([run], "cpu", "fp32")
    made = {
        name: Translator(
            translator.models, translator.tokenizer, translator.config, torch.device("cpu"), name
        )
        for name in ("fp32", "bf16")
    }
    probe = search_precision.time_search(
        made.__getitem__, translator.config.decoding, translator.tokenizer.src_vocab_size
    )
    assert probe.fp32_s > 0 and probe.bf16_s > 0 and not probe.screen_only


def test_validation_searches_in_the_faster_precision_where_training_chose_bf16(
    machine: Any, run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training's auto chose bf16 on a CPU (its matmuls 2.5x faster, mocked): validation's
    greedy search is probed (emulated bf16 here: fp32 wins); an fp32 or explicit training
    precision is kept without a probe."""
    from nmt.training import validation
    from nmt.training.validation import search_precision

    machine.set(NATIVE, FAST_MATMULS)
    loaded = Translator.from_checkpoints([run], "cpu", "fp32")
    config = loaded.config.model_copy(
        update={"training": loaded.config.training.model_copy(update={"precision": "auto"})}
    )
    greedy = config.decoding.model_copy(update={"beam_size": 1})

    def training(precision_name: str, asked: Any = config) -> Any:
        updater = SimpleNamespace(
            model=loaded.models[0], device=torch.device("cpu"), precision=precision_name
        )
        return SimpleNamespace(config=asked, updater=updater, tokenizer=loaded.tokenizer)

    assert search_precision(training("bf16"), greedy) == "fp32"
    probed: list[Any] = []
    monkeypatch.setattr(validation, "choose_search_precision", lambda *a: probed.append(a))
    assert search_precision(training("fp32"), greedy) == "fp32"
    asked_bf16 = config.model_copy(
        update={"training": config.training.model_copy(update={"precision": "bf16"})}
    )
    assert search_precision(training("bf16", asked_bf16), greedy) == "bf16"
    assert not probed
