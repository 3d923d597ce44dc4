"""scripts/bench.py runs end to end on a tiny model and writes every figure to its JSON."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from nmt.fast import compiled as native

ROOT = Path(__file__).resolve().parents[2]
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
    assert "| luong-nofeed |" in proc.stdout  # the Markdown table

    result = json.loads(out.read_text())
    machine = result["machine"]
    assert machine["device"] == "cpu" and machine["threads"] == 1
    # --precision auto, decided as nmt train does: the tiny model is too small for bf16
    assert result["precision"]["asked"] == "auto"
    assert result["precision"]["precision"] == machine["precision"] == "fp32"
    assert "too small" in result["precision"]["precision_reason"] and machine["torch"]
    assert result["data"]["training_pairs"] == 400
    assert 0 <= result["data"]["padding_fraction_epoch"] < 1
    assert positive(result["matmul"]["fp32"]["gflops"])
    assert "bf16" not in result["matmul"]  # a CPU that trains in fp32 skips bf16's rate
    assert "--precision auto: fp32 (auto: " in proc.stdout  # the summary says it too
    assert result["decoding"]["precision"].startswith("fp32 (auto: ")

    train = result["training"]["luong-nofeed"]
    assert "error" not in train, train
    for key in ("target_tokens_per_s", "tokens_per_s"):
        stats = train[key]
        assert len(stats["values"]) == 2  # --quick: two timed windows
        assert 0 < stats["min"] <= stats["median"] <= stats["max"]
    assert train["tokens_per_s"]["median"] > train["target_tokens_per_s"]["median"]
    for key in ("peak_rss_gib", "flops_per_step", "flops_per_target_token", "achieved_gflops"):
        assert positive(train[key]), key
    assert 0 < train["fraction_of_matmul"] < 1
    if sys.platform.startswith("linux") and "GLIBC_TUNABLES" not in os.environ:
        from nmt.fast.allocator import MALLOC_TUNABLES, _glibc

        if _glibc():  # its subprocess runs with the malloc settings `nmt train` restarts with
            assert train["glibc_tunables"] == MALLOC_TUNABLES
            assert f"GLIBC_TUNABLES: {MALLOC_TUNABLES}" in proc.stdout
    assert train["native_kernels"] == native.status()  # the subprocess saw what this one sees
    assert f"RNN step kernels: {native.status()}" in proc.stdout

    decoding = result["decoding"]
    assert decoding["trained"] is False and "untrained" in decoding["note"]
    searches = {(r["beam_size"], r["batch_size"]) for r in decoding["results"]}
    assert searches == {(1, 1), (1, 64), (5, 1), (5, 64)}
    constrained = [r.get("constraints_per_sentence") for r in decoding["results"]]
    assert [c for c in constrained if c] == [1, 3]
    for row in decoding["results"]:
        assert row["sentences"] == 16
        assert positive(row["sentences_per_s"]) and positive(row["target_tokens_per_s"])
    command_result = result["translate_command"]
    assert "error" not in command_result, command_result
    assert command_result["output_lines"] == command_result["sentences"] == 16
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
