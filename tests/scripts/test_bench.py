"""scripts/bench.py runs end to end on a tiny model and writes every figure to its JSON."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from nmt.fast import compiled as native

ROOT = Path(__file__).resolve().parents[2]
FP32_REASONS = (
    "auto: this CPU has no native bf16",
    "auto: the model's matmuls are too small for bf16 to pay",
)
# decoding's auto on a CPU (nmt.decoding.search_precision)
SEARCH_FP32_REASONS = ("auto: this CPU has no native bf16 matmuls",)
WORDS = "sol luna mar rio casa perro gato libro agua fuego tierra aire".split()


def write_corpus(root: Path) -> None:
    """A small Spanish-like -> English-like word corpus as {train,dev,test}.{es,en}."""
    rng = random.Random(3)
    for split, size in (("train", 400), ("dev", 20), ("test", 24)):
        src, trg = [], []
        for _ in range(size):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
            src.append(" ".join(words))
            trg.append(" ".join(w.upper() for w in reversed(words)))
        (root / f"{split}.es").write_text("\n".join(src) + "\n", encoding="utf-8")
        (root / f"{split}.en").write_text("\n".join(trg) + "\n", encoding="utf-8")


def positive(value: float) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_quick_tiny_run_writes_every_figure(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data)
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench.py"),
        "--tiny",
        "--quick",
        "--decode-repeats",
        "2",
        "--configs",
        "luong-nofeed",
        "--model",
        "untrained",
        "--data",
        str(data),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        "--threads",
        "1",
        "--markdown",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]

    result = json.loads(out.read_text())
    machine = result["machine"]
    assert machine["device"] == "cpu" and machine["threads"] == 1 and machine["torch"]
    # --precision auto, decided as nmt train decides it: fp32 for a model this small, on a
    # CPU with native bf16 or without
    chosen = result["precision"]
    assert chosen["asked"] == "auto" and chosen["precision_probe"] is None
    assert chosen["precision_reason"] in FP32_REASONS
    assert chosen["precision"] == machine["precision"] == "fp32"
    assert f"--precision auto: fp32 ({chosen['precision_reason']})" in proc.stdout
    # decoding's auto: the search's own probe where the CPU has native bf16 matmuls
    decoded = result["decoding"]["precision"]
    assert decoded.endswith(", as nmt translate)"), decoded
    searched = decoded.startswith("fp32 (auto: this model's search ran at ")
    assert searched or decoded in {f"fp32 ({r}, as nmt translate)" for r in SEARCH_FP32_REASONS}
    assert result["data"]["training_pairs"] == 400
    assert 0 <= result["data"]["padding_fraction_epoch"] < 1
    rate = result["matmul"]["fp32"]
    assert positive(rate["gflops"]) and rate["gflops"] <= rate["gflops_best"]
    assert set(result["matmul"]) == {"fp32"}  # a CPU that trains in fp32 skips bf16's rate

    train = result["training"]["luong-nofeed"]
    assert "error" not in train, train
    assert train["steps"] == {"warmup": 1, "windows": 2, "per_window": 2}  # --quick
    assert train["vocab_size"] == result["data"]["vocab_size"]
    windows = train["windows"]
    assert len(windows) == 2
    for key, tokens in (
        ("target_tokens_per_s", [w["target_tokens"] for w in windows]),
        ("tokens_per_s", [w["target_tokens"] + w["source_tokens"] for w in windows]),
    ):
        stats = train[key]
        assert stats["values"] == [
            t / w["seconds"] for t, w in zip(tokens, windows, strict=True)
        ], key
        assert stats["median"] == statistics.median(stats["values"])
        assert (stats["min"], stats["max"]) == (min(stats["values"]), max(stats["values"]))
    # an untrained model's loss per target token: about log(vocabulary), and finite
    for window in windows:
        assert 0 < window["loss"] < math.log(train["vocab_size"]) + 1, window
    for key in ("peak_rss_gib", "flops_per_step", "flops_per_target_token"):
        assert positive(train[key]), key
    warmup_tokens = int(train["flops_counted_on"].split(", ")[1].split()[0])
    assert math.isclose(train["flops_per_step"], train["flops_per_target_token"] * warmup_tokens)
    median_rate = train["target_tokens_per_s"]["median"]
    assert train["achieved_gflops"] == train["flops_per_target_token"] * median_rate / 1e9
    assert train["matmul_gflops"] == rate["gflops"]
    assert train["fraction_of_matmul"] == train["achieved_gflops"] / rate["gflops"]
    # the Markdown table shows the JSON's figures
    target = train["target_tokens_per_s"]
    table_row = (
        f"| luong-nofeed | {target['median']:,.0f} | {target['min']:,.0f}-{target['max']:,.0f} "
        f"| {train['tokens_per_s']['median']:,.0f} | {train['peak_rss_gib']:,.2f} |"
    )
    assert table_row in proc.stdout
    from nmt.allocator import MALLOC_TUNABLES, _glibc

    # its subprocess runs with the malloc settings `nmt train` restarts with
    if _glibc() and os.environ.get("GLIBC_TUNABLES", MALLOC_TUNABLES) == MALLOC_TUNABLES:
        assert train["glibc_tunables"] == MALLOC_TUNABLES
        assert f"GLIBC_TUNABLES: {MALLOC_TUNABLES}" in proc.stdout
    assert train["native_kernels"] == native.status()  # the subprocess saw what this one sees
    assert f"RNN step kernels: {native.status()}" in proc.stdout

    decoding = result["decoding"]
    assert decoding["trained"] is False and "untrained" in decoding["note"]
    searches = [
        (r["search"], r["beam_size"], r["batch_size"], r.get("constraints_per_sentence"))
        for r in decoding["results"]
    ]
    assert searches == [
        ("greedy", 1, 1, None),
        ("greedy", 1, 64, None),
        ("beam 5", 5, 1, None),
        ("beam 5", 5, 64, None),
        ("beam 5, 1 constraint", 5, 64, 1),
        ("beam 5, 3 constraints", 5, 64, 3),
    ]
    for row in decoding["results"]:
        assert row["sentences"] == 16 and positive(row["seconds"])
        assert len(row["seconds_each"]) == 2  # --decode-repeats 2: the median of both
        assert row["seconds"] == statistics.median(row["seconds_each"])
        assert row["sentences_per_s"] == 16 / row["seconds"]
        tokens = row["mean_output_tokens"] * 16
        assert math.isclose(row["target_tokens_per_s"], tokens / row["seconds"])
        assert 1 <= row["mean_output_tokens"]  # every output has at least its EOS
        # the FLOP bound: the model's FLOPs for the outputs against the fp32 matmul rate
        assert row["hypothesis_steps"] == round(row["beam_size"] * tokens)
        assert positive(row["mflop_per_hypothesis_step"])
        flops = row["mflop_per_hypothesis_step"] * 1e6 * row["hypothesis_steps"]
        assert math.isclose(row["achieved_gflops"], flops / row["seconds"] / 1e9)
        assert row["matmul_gflops"] == rate["gflops"]
        assert row["fraction_of_flop_bound"] == row["achieved_gflops"] / rate["gflops"]
        # and against the rate measured just before each run, run by run
        rates = row["matmul_gflops_each"]
        assert len(rates) == 2 and all(positive(r) for r in rates)
        assert row["matmul_gflops_beside"] == statistics.median(rates)
        beside = [flops / t / 1e9 / r for t, r in zip(row["seconds_each"], rates, strict=True)]
        assert math.isclose(row["fraction_of_flop_bound_beside"], statistics.median(beside))
    command_result = result["translate_command"]
    assert "error" not in command_result, command_result
    assert command_result["output_lines"] == command_result["sentences"] == 16
    assert command_result["command"].startswith("nmt translate --model ")
    assert command_result["model"] == decoding["model"]
    assert command_result["sentences_per_s"] == 16 / command_result["seconds"]
    assert positive(command_result["sentences_per_s"])


def test_rnn_flops_are_counted_or_added() -> None:
    """A GRU's matmuls are counted as they run; an LSTM on unpacked input runs in a fused
    oneDNN kernel FlopCounterMode does not see, and the analytic count (3 x the forward
    matmuls) takes its place."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, requires_grad=True)
    gru, lstm = torch.nn.GRU(4, 8, batch_first=True), torch.nn.LSTM(4, 8, batch_first=True)
    flops, added = bench.count_step_flops(gru, lambda: gru(x)[0].sum().backward())
    forward = 2 * 3 * 8 * (4 + 8) * 2 * 5  # 2 x gates x H x (I + H) x rows
    assert added == [] and 2 * forward <= flops <= 3 * forward  # counted, backward included
    flops, added = bench.count_step_flops(lstm, lambda: lstm(x)[0].sum().backward())
    if added:  # oneDNN's fused LSTM: counted analytically
        assert flops == 3 * 2 * 4 * 8 * (4 + 8) * 2 * 5


def test_the_large_sizes_make_a_valid_two_layer_config() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    options = bench.parse_args(["--large", "--device", "cpu"])
    config = bench.bench_config("luong-feed", options)
    model = config.model
    assert (model.encoder.hidden_size, model.decoder.hidden_size) == (1024, 1024)
    assert model.decoder.layers == 2 and model.encoder.bidirectional
    assert (config.tokenizer.vocab_size, config.training.batch_tokens) == (28000, 16000)
    assert "--large" in bench.child_arguments(options)


@pytest.mark.slow
def test_profile_step_runs_and_writes_its_figures(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data)
    out = tmp_path / "profile.json"
    command = [sys.executable, str(ROOT / "scripts" / "profile_step.py"), "--tiny"]
    command += ["--device", "cpu", "--data", str(data), "--work-dir", str(tmp_path / "work")]
    command += ["--warmup", "1", "--steps", "2", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["config"] == "bahdanau" and result["steps"] == 2
    assert positive(result["wall_ms_per_step"]) and positive(result["target_tokens_per_s"])
    assert result["device_busy_ms_per_step"] is None and not result["cuda_graphs"]
    assert result["top_host"] and all(positive(row["ms_per_step"]) for row in result["top_host"])
    assert "ms a step" in done.stdout


@pytest.mark.slow
def test_decoding_backends_add_their_rows_and_commands(tmp_path: Path) -> None:
    """--backends: torch over the whole vocabulary (the default rows use the model's
    shortlist), torch one batch at a time (the default, on 2 threads, decodes 2 at once),
    torch in bf16 and the model exported under onnxruntime with int8 weights (the fp32 export
    takes the same path), each with the four unconstrained rows and the whole command, all
    decoding the same sentences (the onnxruntime rows' FLOPs counted on the torch model);
    torch-plain-loop and torch-loop-no-graphs add nothing on a CPU, whose default is the plain
    loop."""
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data)
    out = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--quick"]
    command += ["--parts", "matmul,decode,translate", "--model", "untrained"]
    command += ["--backends", "torch,torch-whole,torch-1worker,torch-plain-loop,torch-bf16"]
    command[-1] += ",torch-loop-no-graphs,onnxruntime-int8"  # the loops: a GPU's alone
    command += ["--data", str(data), "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    command += ["--threads", "2", "--translate-sentences", "8"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["decoding"]["results"]
    backends = [r["backend"] for r in rows]
    assert backends[:6] == ["torch fp32 shortlist"] * 6  # four settings, two constrained rows
    others = ["torch fp32", "torch fp32 shortlist, 1 worker", "torch bf16 shortlist"]
    assert backends[6:] == [name for name in [*others, "onnxruntime int8"] for _ in range(4)]
    # the tiny bench's sentences make batches of 8 and 1: auto decodes one at a time there
    assert {row["workers"] for row in rows} == {1}
    for row in rows:
        assert positive(row["sentences_per_s"]) and positive(row["achieved_gflops"]), row
        assert positive(row["fraction_of_flop_bound"]), row
        assert positive(row["fraction_of_flop_bound_beside"]), row
        shortlisted = "shortlist" in row["backend"]
        assert positive(row["mean_columns"]) if shortlisted else "mean_columns" not in row, row
    commands = [result["translate_command"], *result["translate_backends"]]
    names = ["torch", "torch-whole", "torch-1worker", "torch-bf16", "onnxruntime-int8"]
    assert [c["backend"] for c in commands] == names
    for entry in commands:
        assert "error" not in entry, entry
        assert entry["output_lines"] == entry["sentences"] == 8
    assert "--backend onnxruntime" in commands[4]["command"]
    assert "--precision bf16" in commands[3]["command"]
    assert "--workers 1" in commands[2]["command"]
    assert "--shortlist off" in commands[1]["command"]
    assert "onnxruntime int8" in proc.stdout


@pytest.mark.slow
def test_training_with_deferred_reads_times_the_same_updates(tmp_path: Path) -> None:
    """training.deferred_reads (a GPU's default) on a CPU: each update read once the next
    one's backward is queued, as nmt train reads it; the windows' losses are those of the
    bench without it, to the bit."""
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data)
    losses = {}
    for setting in ("false", "true"):
        out = tmp_path / f"bench-{setting}.json"
        command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--quick"]
        command += ["--configs", "bahdanau", "--parts", "train", "--threads", "1"]
        command += ["--override", f"training.deferred_reads={setting}"]
        command += ["--data", str(data), "--work-dir", str(tmp_path / "work"), "--json", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(out.read_text())["training"]["bahdanau"]
        assert result["deferred_reads"] == (setting == "true")
        losses[setting] = [window["loss"] for window in result["windows"]]
    assert len(losses["true"]) >= 2 and all(math.isfinite(x) for x in losses["true"])
    assert losses["true"] == losses["false"]
