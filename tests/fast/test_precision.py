"""precision: auto, decided by the hardware: native bf16 and a probe on a CPU (cached per
CPU, torch, threads and oneDNN cap), native bf16 or fp16 on a GPU; bf16 asked for where it is
slow trains but warns once. CPU flags and the probe are mocked; one test runs the real probe."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from cpus import described_cpu
from synthetic import luong_model_section

import nmt.fast.precision as precision
from nmt.config import from_dict
from nmt.fast.precision import Probe, choose_precision, probe_shapes, run_probe
from nmt.model import build_model

CPU = torch.device("cpu")
NATIVE = {"fpu", "avx2", "fma", "avx512f", "avx512_bf16"}
AVX2 = {"fpu", "avx2", "fma"}


def model_of(embedding: int, hidden: int, vocab: int) -> torch.nn.Module:
    """A Luong model with these sizes (joint vocabulary)."""
    section = luong_model_section()
    section["embedding_size"] = embedding
    section["encoder"]["hidden_size"] = hidden
    section["decoder"]["hidden_size"] = hidden
    config = from_dict({"data": {"train": "unused"}, "model": section})
    return build_model(config.model, vocab, vocab)


@pytest.fixture(scope="module")
def demo_sized() -> torch.nn.Module:
    """The demo's sizes: embeddings and hidden 256, vocabulary 8000."""
    return model_of(256, 256, 8000)


class FakeProbe:
    """run_probe's stand-in: returns ``probe`` and counts its calls."""

    def __init__(self, fp32_s: float, bf16_s: float, screen_only: bool = False):
        self.result = Probe(fp32_s, bf16_s, [[1, 2, 3]], screen_only)
        self.calls = 0

    def __call__(self, shapes: list[list[int]]) -> Probe:
        self.calls += 1
        return self.result


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """A CPU whose flags and probe the test sets; an empty cache of its own."""
    described_cpu(monkeypatch, tmp_path)
    precision._warned.clear()

    class Machine:
        def set(self, flags: set[str], probe: FakeProbe) -> FakeProbe:
            monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags))
            monkeypatch.setattr(precision, "run_probe", probe)
            return probe

    return Machine()


def test_a_cpu_without_native_bf16_trains_in_fp32_without_a_probe(
    machine: Any, demo_sized: torch.nn.Module
) -> None:
    probe = machine.set(AVX2, FakeProbe(1.0, 0.5))
    chosen = choose_precision("auto", CPU, demo_sized, 3000)
    assert chosen.name == "fp32"
    assert chosen.reason == "auto: this CPU has no native bf16"
    assert probe.calls == 0 and chosen.probe is None


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16", "bf16"])
def test_native_bf16_that_the_probe_finds_faster_is_chosen(
    machine: Any, demo_sized: torch.nn.Module, flag: str
) -> None:
    probe = machine.set({"avx2", flag}, FakeProbe(fp32_s=1.5, bf16_s=1.0))
    chosen = choose_precision("auto", CPU, demo_sized, 3000)
    assert chosen.name == "bf16" and probe.calls == 1
    assert chosen.reason == "auto: native bf16 ran at 1.50x fp32's speed in a probe"
    assert chosen.record()["precision_probe"]["bf16_s"] == 1.0


@pytest.mark.parametrize("bf16_s", [1.6, 1.0, 0.95])  # slower, as fast, under 1.1x faster
def test_native_bf16_that_the_probe_finds_slower_or_no_faster_is_not(
    machine: Any, demo_sized: torch.nn.Module, bf16_s: float
) -> None:
    machine.set(NATIVE, FakeProbe(fp32_s=1.0, bf16_s=bf16_s))
    chosen = choose_precision("auto", CPU, demo_sized, 3000)
    assert chosen.name == "fp32"
    assert "native bf16 but runs fp32 matmuls faster" in chosen.reason
    assert f"{1.0 / bf16_s:.2f}x fp32's speed" in chosen.reason


def test_the_decision_is_cached_and_redone_when_the_cpu_or_torch_changes(
    machine: Any, demo_sized: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    probe = machine.set(NATIVE, FakeProbe(fp32_s=2.0, bf16_s=1.0))
    first = choose_precision("auto", CPU, demo_sized, 3000)
    again = choose_precision("auto", CPU, demo_sized, 3000)
    assert probe.calls == 1 and first.name == again.name == "bf16"
    assert "cached probe" in again.reason and "cached" not in first.reason
    assert len(list((tmp_path / "cache").glob("precision-*.json"))) == 1

    monkeypatch.setattr(precision, "cpu_description", lambda: "model name: Other CPU")
    choose_precision("auto", CPU, demo_sized, 3000)
    assert probe.calls == 2
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    choose_precision("auto", CPU, demo_sized, 3000)
    assert probe.calls == 3
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the cap changes what bf16 runs on
    choose_precision("auto", CPU, demo_sized, 3000)
    assert probe.calls == 4
    choose_precision("auto", CPU, demo_sized, 3000)
    assert probe.calls == 4


def test_a_damaged_cache_file_is_probed_again(
    machine: Any, demo_sized: torch.nn.Module, tmp_path: Path
) -> None:
    probe = machine.set(NATIVE, FakeProbe(fp32_s=2.0, bf16_s=1.0))
    choose_precision("auto", CPU, demo_sized, 3000)
    (cached,) = (tmp_path / "cache").glob("precision-*.json")
    cached.write_text('{"fp32_s": 2.0, "bf1')
    assert choose_precision("auto", CPU, demo_sized, 3000).name == "bf16"
    assert probe.calls == 2


def test_a_cache_that_cannot_be_written_costs_only_a_probe(
    machine: Any, demo_sized: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NMT_CACHE_DIR", str(blocker / "cache"))
    probe = machine.set(NATIVE, FakeProbe(fp32_s=2.0, bf16_s=1.0))
    assert choose_precision("auto", CPU, demo_sized, 3000).name == "bf16"
    assert choose_precision("auto", CPU, demo_sized, 3000).name == "bf16"
    assert probe.calls == 2


@pytest.mark.parametrize(
    ("native", "name", "reason"),
    [
        (True, "bf16", "auto: GPU X has native bf16"),
        (False, "fp16", "auto: GPU X has no native bf16; fp16 with loss scaling"),
    ],
)
def test_cuda_auto_is_native_bf16_else_fp16(
    monkeypatch: pytest.MonkeyPatch, native: bool, name: str, reason: str
) -> None:
    asked: list[dict[str, Any]] = []

    def supported(**kwargs: Any) -> bool:
        asked.append(kwargs)
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    chosen = choose_precision("auto", torch.device("cuda", 0))
    assert (chosen.name, chosen.reason) == (name, reason)
    # emulated bf16 (a T4 or V100 under CUDA 11+) does not count as support
    assert asked == [{"including_emulation": False}]
    assert choose_precision("fp32", torch.device("cuda", 0)).name == "fp32"


def test_bf16_asked_for_on_a_cpu_without_it_trains_but_warns_once(
    machine: Any, demo_sized: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    machine.set(AVX2, FakeProbe(fp32_s=0.01, bf16_s=0.6, screen_only=True))
    with caplog.at_level(logging.WARNING, logger="nmt"):
        first = choose_precision("bf16", CPU, demo_sized, 3000)
        second = choose_precision("bf16", CPU, demo_sized, 3000)
    assert first.name == second.name == "bf16"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "training.precision: bf16 runs 60.0x slower than fp32 here (this CPU has no native "
        "bf16); set training.precision to auto (or fp32) to run at full speed"
    ]


def test_bf16_asked_for_where_onednn_is_capped_names_the_cap(
    machine: Any, demo_sized: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    machine.set(NATIVE, FakeProbe(fp32_s=0.01, bf16_s=0.5, screen_only=True))
    chosen = choose_precision("bf16", CPU, demo_sized, 64, source="--precision")
    assert chosen.reason == (
        "--precision: bf16, 50.0x slower than fp32 here (its bf16 matmuls are emulated, oneDNN "
        "capped by ONEDNN_MAX_CPU_ISA=AVX2)"
    )
    auto = choose_precision("auto", CPU, demo_sized, 64)
    assert auto.name == "fp32" and "emulated, oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX2" in (
        auto.reason
    )


def test_bf16_asked_for_where_it_is_faster_says_nothing(
    machine: Any, demo_sized: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    machine.set(NATIVE, FakeProbe(fp32_s=1.5, bf16_s=1.0))
    with caplog.at_level(logging.WARNING, logger="nmt"):
        chosen = choose_precision("bf16", CPU, demo_sized, 3000)
    assert (chosen.name, chosen.reason) == ("bf16", "training.precision: bf16")
    assert not caplog.records


def test_a_model_too_small_for_bf16_is_fp32_without_a_probe(machine: Any) -> None:
    probe = machine.set(NATIVE, FakeProbe(fp32_s=2.0, bf16_s=1.0))
    chosen = choose_precision("auto", CPU, model_of(8, 16, 40), 200)
    assert chosen.name == "fp32" and "too small" in chosen.reason and probe.calls == 0


def test_the_probe_times_the_model_s_largest_matmuls(demo_sized: torch.nn.Module) -> None:
    # the tied output layer (256 -> 8000) first, then the largest RNN and linear weights
    shapes = probe_shapes(demo_sized, 3000)
    assert shapes[0] == [512, 256, 8000]  # rows capped at PROBE_ROWS
    assert len(shapes) == precision.PROBE_SHAPES
    assert all(i * o <= 256 * 8000 for _, i, o in shapes)
    assert probe_shapes(demo_sized, 64)[0] == [64, 256, 8000]  # a search step's rows


def test_the_real_probe_times_both_precisions() -> None:
    probe = run_probe([[32, 64, 256]])
    assert probe.fp32_s > 0 and probe.bf16_s > 0
    assert probe.shapes == ([[32, 64, 256]] if not probe.screen_only else [list(precision.SCREEN)])


def test_time_both_interleaves_warms_up_and_gives_up_on_a_slow_bf16(monkeypatch):
    """Medians of interleaved runs after one warm-up each, on a clock the runs advance;
    a bf16 run past ``give_up`` times fp32's ends the timing."""
    clock = [0.0]
    calls: list[str] = []
    monkeypatch.setattr(precision.time, "perf_counter", lambda: clock[0])

    def run(name: str, seconds: list[float]):
        def call() -> None:
            calls.append(name)
            clock[0] += seconds.pop(0)

        return call

    fp32 = run("fp32", [9.0, 1.0, 2.0, 3.0])
    bf16 = run("bf16", [9.0, 0.5, 0.5, 0.4])
    assert precision.time_both(fp32, bf16, repeats=3) == (2.0, 0.5)
    assert calls == ["fp32", "bf16"] * 4
    calls.clear()
    fp32 = run("fp32", [9.0, 1.0, 1.0])
    bf16 = run("bf16", [9.0, 2.5, 2.5])
    assert precision.time_both(fp32, bf16, repeats=2, give_up=2.0) == (1.0, 2.5)
    assert calls == ["fp32", "bf16"] * 2
