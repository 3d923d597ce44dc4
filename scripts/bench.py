#!/usr/bin/env python3
"""nmt's speed benchmark: training tokens/s, peak memory, decoding speed and FLOP/s.

Four named configs at the sizes users of peer toolkits train (bi-GRU encoder 512 units per
direction, embeddings 256, decoder 512, joint sentencepiece unigram vocabulary 8000, token
batches of 4,000, the demo corpus ``data/bible``) differ only in the decoder:

    bahdanau           Bahdanau pre-step decoder, additive attention, GRU
    luong-feed         Luong post-step decoder, general score, input feeding, GRU
    luong-nofeed       the same without input feeding (the decoder RNN runs in one call)
    luong-nofeed-lstm  the same with an LSTM encoder and decoder

For each config, in a subprocess of its own (so that its peak memory is its own) set up as
``nmt train`` sets itself up (``nmt.training.process.setup_process``), the benchmark trains
on real length-bucketed batches of the training split, the same batches in the same order
for every config, with the model and step of ``nmt train`` (``nmt.training.run.allocate_model``,
``nmt.training.step.train_step``: ``model.loss``, backward, clip, Adam, under
``nmt.runtime.autocast``; with training.deferred_reads, a GPU's default, each update read
once the next one's backward is queued, as ``nmt train`` reads it): a few warm-up steps whose matmul FLOPs are counted, then timed
windows of steps, each giving target and source+target tokens/s. It also measures the
machine's matmul rate (a 2048^3 matmul in fp32 and bf16), the padding fraction of the batches,
greedy and beam-5 decoding at batch sizes 1 and 64 with a trained model (``runs/demo`` when it
exists), and the whole ``nmt translate --beam 5`` command on the test set, start-up included.

Usage::

    .venv/bin/python scripts/bench.py                          # all configs
    .venv/bin/python scripts/bench.py --configs luong-nofeed --quick
    .venv/bin/python scripts/bench.py --device cuda --markdown > results.md
    .venv/bin/python scripts/bench.py --configs luong-nofeed \\
        --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 --env MALLOC_MMAP_THRESHOLD_=262144
    .venv/bin/python scripts/bench.py --report runs/bench/bench-cpu.json --markdown

The sentencepiece model and the tokenised corpus are cached in the work directory
(``runs/bench``) and reused. Results go to stdout as tables (progress to stderr) and to
``runs/bench/bench-<device>.json``; docs/benchmarks.md explains every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from nmt import checkpoint, files  # noqa: E402
from nmt.allocator import limit_kernel_cache  # noqa: E402
from nmt.commands.export import ExportRequest, export_command  # noqa: E402
from nmt.config import Config, apply_override, from_dict  # noqa: E402
from nmt.data.batching import (  # noqa: E402
    batch_shape,
    bucket_batches,
    length_sorted_batches,
    padding_fraction,
)
from nmt.data.corpus import read_pairs  # noqa: E402
from nmt.data.prepare import load_corpora  # noqa: E402
from nmt.data.tokenizer import Tokenizer  # noqa: E402
from nmt.decoding.search import runs_on_device  # noqa: E402
from nmt.decoding.shortlist import Shortlist, batch_columns, forced_pieces  # noqa: E402
from nmt.decoding.steering import Steering  # noqa: E402
from nmt.decoding.translator import Translator  # noqa: E402
from nmt.decoding.workers import worker_count  # noqa: E402
from nmt.fast import compiled  # noqa: E402
from nmt.fast.precision import choose_precision  # noqa: E402
from nmt.model import Seq2Seq, build_model, count_parameters  # noqa: E402
from nmt.runtime import (  # noqa: E402
    choose_device,
    cpu_name,
    eval_mode,
    seed_everything,
    set_threads,
)
from nmt.training.batches import device_batch, epoch_batches  # noqa: E402
from nmt.training.distributed import Distributed  # noqa: E402
from nmt.training.process import setup_process  # noqa: E402
from nmt.training.run import allocate_model  # noqa: E402
from nmt.training.rundir import project_commit  # noqa: E402
from nmt.training.step import (  # noqa: E402
    PendingStep,
    Updater,
    backward,
    queue_update,
    train_step,
)
from nmt.vocab import BOS_ID  # noqa: E402

# The decoder (and its RNN) of each named config; everything else is shared.
CONFIGS: dict[str, dict[str, Any]] = {
    "bahdanau": {
        "rnn": "gru",
        "decoder": {"style": "bahdanau"},
        "attention": {"score": "additive"},
    },
    "luong-feed": {
        "rnn": "gru",
        "decoder": {"style": "luong", "input_feeding": True},
        "attention": {"score": "general"},
    },
    "luong-nofeed": {
        "rnn": "gru",
        "decoder": {"style": "luong", "input_feeding": False},
        "attention": {"score": "general"},
    },
    "luong-nofeed-lstm": {
        "rnn": "lstm",
        "decoder": {"style": "luong", "input_feeding": False},
        "attention": {"score": "general"},
    },
}
# "bench": the sizes of the peer comparison; "large" (--large): a GPU-sized model (a 2-layer
# decoder; 28,000 pieces, near the most the Bible corpus's sentencepiece vocabulary allows,
# short of the 32k such a model would use elsewhere: docs/benchmarks.md) and GPU-sized
# batches; "tiny": for the test of this script.
SIZES: dict[str, dict[str, int]] = {
    "bench": {"embedding": 256, "encoder": 512, "decoder": 512, "vocab": 8000, "batch": 4000},
    "large": {
        "embedding": 512,
        "encoder": 1024,
        "decoder": 1024,
        "decoder_layers": 2,
        "vocab": 28000,
        "batch": 16000,
    },
    "tiny": {"embedding": 16, "encoder": 16, "decoder": 16, "vocab": 100, "batch": 300},
}
UNTRAINED_CONFIG = "luong-nofeed"  # decoded when there is no trained model
SEED = 1
MATMUL_SIZE = 2048
TINY_MATMUL_SIZE = 256
DECODE_SETTINGS = ((1, 1), (1, 64), (5, 1), (5, 64))  # (beam size, batch size)
CONSTRAINT_COUNTS = (1, 3)  # constraint words per sentence, beam 5, batch 64
PARTS = ("matmul", "train", "decode", "translate")  # what a run measures (--parts)
# what the decode and translate parts run on (--backends): torch in the precision nmt
# translate decides (--precision auto), torch over the whole vocabulary (--shortlist off),
# torch one batch at a time (--workers 1), torch in bf16, and the model exported to ONNX
# under onnxruntime, fp32 and with int8 weights (nmt export --quantize int8); and on a GPU
# torch with beam search's plain loop (decoding.device_loop false: a read of the device per
# step) and with the device loop's step not captured (decoding.cuda_graphs false), in the
# decode part alone
BACKENDS = (
    "torch",
    "torch-whole",
    "torch-1worker",
    "torch-2workers",
    "torch-plain-loop",
    "torch-loop-no-graphs",
    "torch-bf16",
    "onnxruntime",
    "onnxruntime-int8",
)
WORKER_BACKENDS = {"torch-1worker": 1, "torch-2workers": 2}  # --workers N (2: on a GPU)
GIB = 2.0**30
T = TypeVar("T")


def log(message: str) -> None:
    """Progress goes to stderr, so that stdout holds only the results."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- options


@dataclass
class Lengths:
    """How much each part runs."""

    warmup: int
    windows: int
    steps: int
    decode_sentences: int
    decode_repeats: int  # each decoding row's runs; its seconds are their median


@dataclass(kw_only=True)
class Options:
    """The command line, parsed and defaulted once (``parse_args``)."""

    configs: str  # comma list of CONFIGS names
    device: str
    precision: str  # --precision; once decided for the configs, what they train in
    threads: int | None
    work_dir: str
    data: str
    json: str | None
    markdown: bool
    quick: bool
    tiny: bool
    large: bool
    lengths: Lengths
    translate_sentences: int | None
    model: str | None
    parts: list[str]
    backends: list[str]
    env: dict[str, str]
    overrides: list[str]
    in_process: bool
    report: str | None
    verbose: bool
    one: str | None  # this process trains that one config (a per-config subprocess)
    one_json: str | None

    @property
    def sizes(self) -> dict[str, int]:
        return SIZES["tiny" if self.tiny else "large" if self.large else "bench"]


def omitted_when_none() -> Any:
    """A result's field that the JSON leaves out when it was not measured."""
    return field(default=None, metadata={"omit_none": True})


def to_json(value: Any) -> Any:
    """A result (dataclasses, lists, dicts) as JSON values, fields in their order."""
    if is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name))
            for f in fields(value)
            if getattr(value, f.name) is not None or not f.metadata.get("omit_none")
        }
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- configs


def bench_config(name: str, options: Options) -> Config:
    """The named config at bench (or tiny) sizes, validated by the project's schema."""
    sizes = options.sizes
    parts = CONFIGS[name]
    data = Path(options.data)
    raw = {
        "data": {split: str(data / split) for split in ("train", "dev", "test")},
        "tokenizer": {"type": "unigram", "vocab_size": sizes["vocab"], "joint": True},
        "model": {
            "embedding_size": sizes["embedding"],
            "encoder": {
                "rnn": parts["rnn"],
                "hidden_size": sizes["encoder"],
                "bidirectional": True,
            },
            "decoder": {
                **parts["decoder"],
                "rnn": parts["rnn"],
                "hidden_size": sizes["decoder"],
                "layers": sizes.get("decoder_layers", 1),
            },
            "attention": parts["attention"],
        },
        "training": {"batch_tokens": sizes["batch"], "precision": options.precision, "seed": SEED},
        "run": {"device": options.device, "threads": options.threads},
    }
    for override in options.overrides:
        apply_override(raw, override)
    return from_dict(raw, f"bench config {name}")


# ----------------------------------------------------------------------------- data


def load_data(config: Config, work_dir: Path) -> tuple[Any, Tokenizer]:
    """Training corpus and tokenizer through ``nmt.data.prepare.load_corpora``.

    The sentencepiece model is trained once and kept in ``work_dir``; the tokenised corpus is
    cached by ``datasets`` under ``work_dir/cache``.
    """
    logging.getLogger("nmt").setLevel(logging.WARNING)
    tok = config.tokenizer
    source = hashlib.sha256(str(Path(config.data.train).resolve()).encode()).hexdigest()[:8]
    spm_path = work_dir / f"spm-{tok.type}-{tok.vocab_size}-{source}.model"
    tokenizer = None
    if spm_path.is_file():
        proto = spm_path.read_bytes()
        tokenizer = Tokenizer(proto, proto)
    work_dir.mkdir(parents=True, exist_ok=True)
    corpora, tokenizer = load_corpora(config, work_dir, tokenizer)
    if not spm_path.is_file():
        files.atomic_write_bytes(spm_path, lambda f: f.write(tokenizer.src_proto))
    return corpora, tokenizer


def sampled_epoch(corpora: Any, work_dir: Path) -> tuple[Any, float]:
    """The first epoch's training pairs and the seconds it took to sample them: with
    tokenizer.sampling_alpha set, sampled afresh (an earlier bench's sample is removed);
    else the one deterministic segmentation, in no time."""
    if corpora.sampler is None:
        return corpora.train, 0.0
    for old in (work_dir / "cache" / "prepared").glob("sampled*"):
        shutil.rmtree(old, ignore_errors=True)
    started = time.perf_counter()
    corpus = corpora.for_epoch(0)
    return corpus, time.perf_counter() - started


def training_batches(
    corpus: Any, batch_tokens: int, count: int, shaped: bool = False
) -> list[np.ndarray]:
    """The first ``count`` batches of the seeded epochs of ``nmt train`` (same for every
    config; ``shaped``: with the static shapes of CUDA graphs)."""
    batches: list[np.ndarray] = []
    epoch = 0
    while len(batches) < count:
        batches += epoch_batches(corpus, batch_tokens, SEED, epoch, shaped)
        epoch += 1
    return batches[:count]


def test_sentences(config: Config, work_dir: Path) -> tuple[list[str], list[str]]:
    """Non-empty source lines of the test split and their references."""
    assert config.data.test is not None
    rows = read_pairs(config.data, config.data.test, work_dir / "cache")
    pairs = [(s, t) for s, t in zip(rows["src"], rows["trg"], strict=True) if s.strip()]
    return [s for s, _ in pairs], [t for _, t in pairs]


def reference_constraints(references: list[str], count: int, seed: int = 0) -> list[list[str]]:
    """``count`` words of each reference (four letters or more, else any), drawn with a fixed
    seed: the constraints of the constrained-decoding rows, as a terminology list would be."""
    generator = np.random.default_rng(seed)
    out = []
    for line in references:
        words = [w.strip(".,;:!?\"'()") for w in line.split()]
        words = [w for w in words if len(w) >= 4] or [w for w in words if w]
        chosen = generator.choice(len(words), size=min(count, len(words)), replace=False)
        out.append([words[i] for i in sorted(chosen)])
    return out


# ----------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[[], T]) -> tuple[T, float]:
    """``work()`` and its wall clock in seconds, the device's queue drained on both ends."""
    synchronize(device)
    start = time.perf_counter()
    out = work()
    synchronize(device)
    return out, time.perf_counter() - start


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Spread:
    median: float
    min: float
    max: float
    values: list[float]

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), values)


@dataclass
class MatmulRate:
    seconds: float  # the median
    gflops: float
    gflops_best: float


def matmul_rate(
    device: torch.device, dtype: torch.dtype, repeats: int, size: int = MATMUL_SIZE
) -> MatmulRate:
    """Median time of a size^3 matmul (2048^3; smaller with --tiny, for the tests on CPUs
    without native bf16) -> GFLOP/s (2 n^3 floating-point operations)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = [timed(device, lambda: torch.mm(a, b))[1] for _ in range(repeats + 2)][2:]
    flop = 2 * size**3  # the first two runs warm up, untimed
    seconds = statistics.median(times)
    return MatmulRate(seconds, flop / seconds / 1e9, flop / min(times) / 1e9)


BESIDE_REPEATS = 3  # timed products of each decoding run's matmul rate (beside_rate)


def beside_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The matmul rate (GFLOP/s) measured just before a decoding run: ``matmul_rate`` with
    BESIDE_REPEATS timed products (about 0.75 s at 2048^3 on a 2-core CPU)."""
    return matmul_rate(device, dtype, BESIDE_REPEATS, size).gflops


def matmul_rates(
    device: torch.device, precision: str, quick: bool, size: int = MATMUL_SIZE
) -> dict[str, MatmulRate]:
    """fp32 and the training precision (on a GPU also bf16 and fp16). A CPU that trains in
    fp32 skips bf16: emulated bf16 is far slower at this size, and the precision probe has
    already timed it at the model's own shapes."""
    dtypes = {"fp32": torch.float32}
    if precision == "bf16" or device.type == "cuda":
        dtypes["bf16"] = torch.bfloat16
    if precision == "fp16" or device.type == "cuda":
        dtypes["fp16"] = torch.float16
    repeats = 3 if quick else 10
    return {name: matmul_rate(device, dtype, repeats, size) for name, dtype in dtypes.items()}


# ----------------------------------------------------------------------------- FLOP count

GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "GRU": 3, "LSTM": 4}


def rnn_forward_flops_per_row(module: nn.RNNBase) -> int:
    """Forward matmul FLOPs per processed row (sentence x time step): for each layer and
    direction 2 x gates x H x (I + H)."""
    hidden, directions = module.hidden_size, 2 if module.bidirectional else 1
    total = 0
    for layer in range(module.num_layers):
        inputs = module.input_size if layer == 0 else hidden * directions
        total += directions * 2 * GATES[module.mode] * hidden * (inputs + hidden)
    return total


def _rows(data: Any) -> int:
    """Sentences x time steps of an RNN input (packed, batch-first or unbatched)."""
    if isinstance(data, nn.utils.rnn.PackedSequence):
        return int(data.batch_sizes.sum())
    return int(data.shape[0] * data.shape[1]) if data.dim() == 3 else int(data.shape[0])


class _RNNWatch:
    """Forward hooks on an RNN: the FLOPs the counter saw during its calls, and the rows."""

    def __init__(self, counter: Any):
        self.counter = counter
        self.rows = self.seen = self._start = 0

    def before(self, module: nn.Module, inputs: tuple) -> None:
        self.rows += _rows(inputs[0])
        self._start = self.counter.get_total_flops()

    def after(self, module: nn.Module, inputs: tuple, output: Any) -> None:
        self.seen += self.counter.get_total_flops() - self._start


def count_step_flops(
    model: nn.Module, run_step: Callable[[], Any], passes: int = 3
) -> tuple[int, list[str]]:
    """Matmul FLOPs of one training step (forward and backward) by ``FlopCounterMode``.

    The counter sees the matmuls that a GRU (or a packed LSTM) decomposes into on the CPU,
    but not fused RNN kernels (oneDNN's LSTM on unpacked input, cuDNN on a GPU). An RNN whose
    forward calls show less than half their analytic FLOPs ran such a kernel, whose backward
    the counter misses too: it is counted analytically, ``passes`` x the forward (3: forward,
    input gradient, weight gradient; 1 for a forward pass alone). Returns (FLOPs, names of
    the RNNs counted analytically).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    rnns = {name: m for name, m in model.named_modules() if isinstance(m, nn.RNNBase)}
    watches = {name: _RNNWatch(counter) for name in rnns}
    hooks = []
    for name, module in rnns.items():
        hooks.append(module.register_forward_pre_hook(watches[name].before))
        hooks.append(module.register_forward_hook(watches[name].after))
    try:
        with counter:
            run_step()
    finally:
        for hook in hooks:
            hook.remove()
    total, added = counter.get_total_flops(), []
    for name, module in rnns.items():
        watch = watches[name]
        forward = watch.rows * rnn_forward_flops_per_row(module)
        if watch.seen < forward / 2:
            total += passes * forward - watch.seen
            added.append(name)
    return int(total), added


# ----------------------------------------------------------------------------- training


# -> (a reader of the loss per token, target tokens, source tokens)
Step = Callable[[np.ndarray], tuple[Callable[[], float], int, int]]


@dataclass
class Warmup:
    """The counted warm-up steps."""

    flops_per_step: float
    flops_per_target_token: float
    flops_counted_on: str
    rnn_flops_added_analytically: list[str]
    rss_after_warmup_gib: float


@dataclass
class Captures:
    """The CUDA graphs captured before the timed windows."""

    shapes: int  # static batch shapes, each a forward and a backward graph
    capture_seconds: float  # in capturing (warm-up passes included)
    steps_seconds: float  # the untimed steps that captured them, in all


@dataclass
class Window:
    """One timed window of steps."""

    seconds: float
    target_tokens: int
    source_tokens: int
    loss: float  # per target token
    rss_gib: float


@dataclass
class Sampling:
    alpha: float | None  # tokenizer.sampling_alpha
    seconds_per_epoch: float
    target_tokens_per_epoch: int


@dataclass(kw_only=True)
class TrainingResult:
    """One config's training figures."""

    config: dict[str, Any]  # its model section
    batch_tokens: int
    parameters: int
    vocab_size: int
    steps: dict[str, int]
    target_tokens_per_s: Spread
    tokens_per_s: Spread  # source and target
    windows: list[Window]
    padding_fraction: float
    subword_sampling: Sampling
    peak_rss_gib: float
    glibc_tunables: str | None
    native_kernels: str | None
    peak_gpu_memory_gib: float | None
    cuda_graphs: Captures | None
    deferred_reads: bool = False  # each update read once the next is queued (deferred_reads)
    flops_per_step: float
    flops_per_target_token: float
    flops_counted_on: str
    rnn_flops_added_analytically: list[str]
    rss_after_warmup_gib: float
    achieved_gflops: float
    matmul_gflops: float | None = omitted_when_none()  # the matmul rate in its precision
    fraction_of_matmul: float | None = omitted_when_none()


@dataclass
class Failed:
    """A part that did not run to its end: its subprocess's exit status and last line."""

    error: str


def make_step(
    config: Config, model: Seq2Seq, corpus: Any, device: torch.device
) -> tuple[Step, Updater]:
    """One training step of ``nmt train`` (``nmt.training.step.train_step``) on a batch of
    corpus indices: -> (a reader of its loss per target token, target tokens, source
    tokens), and the Updater it steps. With deferred reads (``Updater.defers``) the update
    before is read once this one's backward is queued, as ``nmt train`` reads it, and the
    reader reads this one."""
    updater = Updater.build(config, model, config.training.precision, device, Distributed())
    shaped, budget = model.graphs is not None, config.training.batch_tokens
    queued: list[PendingStep] = []  # the update not yet read

    def step(indices: np.ndarray) -> tuple[Callable[[], float], int, int]:
        batch = device_batch(corpus, indices, device, budget, shaped)
        tokens = int(corpus.trg_lengths[indices].sum())
        sources = int(corpus.src_lengths[indices].sum())
        if not updater.defers:
            loss = train_step(updater, [batch], tokens).loss / tokens
            return (lambda: loss), tokens, sources
        sums = backward(updater, [batch], tokens)
        if queued:
            queued.pop().read()
        pending = queue_update(updater, sums, None, None)
        queued.append(pending)
        return (lambda: pending.read().loss / tokens), tokens, sources

    return step, updater


def counted_warmup(model: Seq2Seq, step: Step, batches: list[np.ndarray], corpus: Any) -> Warmup:
    """Warm-up steps, each under the FLOP counter (a model's CUDA graphs paused: a replay
    shows the counter nothing)."""
    flops, tokens, analytic = 0, 0, set()
    for indices in batches:
        if model.graphs is not None:
            model.graphs.paused = True
        try:
            step_flops, added = count_step_flops(model, lambda i=indices: step(i))
        finally:
            if model.graphs is not None:
                model.graphs.paused = False
        flops += step_flops
        tokens += int(corpus.trg_lengths[indices].sum())
        analytic.update(added)
    return Warmup(
        flops_per_step=flops / len(batches),
        flops_per_target_token=flops / tokens,
        flops_counted_on=f"{len(batches)} warm-up steps, {tokens} target tokens",
        rnn_flops_added_analytically=sorted(analytic),
        rss_after_warmup_gib=(current_rss_bytes() or 0) / GIB,
    )


def capture_shapes(
    model: Seq2Seq, step: Step, batches: list[np.ndarray], corpus: Any, batch_tokens: int
) -> Captures | None:
    """With CUDA graphs: one untimed step on a batch of each static shape the timed windows
    will meet, so that they time replays (a training run captures each shape once, at its
    first batch). -> the shapes and the capture seconds; None without graphs."""
    if model.graphs is None:
        return None
    graphs = model.graphs
    started, seconds = time.perf_counter(), graphs.capture_seconds
    firsts: dict[tuple[int, int], np.ndarray] = {}
    for indices in batches:
        lengths = corpus.src_lengths[indices], corpus.trg_lengths[indices]
        firsts.setdefault(batch_shape(*lengths, batch_tokens), indices)
    for indices in firsts.values():
        step(indices)
    return Captures(
        shapes=len(graphs),
        capture_seconds=graphs.capture_seconds - seconds,
        steps_seconds=time.perf_counter() - started,
    )


def timed_window(step: Step, batches: list[np.ndarray], device: torch.device) -> Window:
    """Wall clock of consecutive steps, batch building included, as in ``nmt train``."""
    results, seconds = timed(device, lambda: [step(indices) for indices in batches])
    target = sum(r[1] for r in results)
    return Window(
        seconds=seconds,
        target_tokens=target,
        source_tokens=sum(r[2] for r in results),
        loss=sum(r[0]() * r[1] for r in results) / target,
        rss_gib=(current_rss_bytes() or 0) / GIB,
    )


def bench_training(name: str, options: Options) -> TrainingResult:
    """Train one config as ``nmt train`` does (its process setup, model and step): counted
    warm-up steps, then timed windows."""
    config = bench_config(name, options)
    setup_process(config, restart=options.one is not None)  # a subprocess of its own
    device = choose_device(config.run.device)
    work_dir, lengths = Path(options.work_dir), options.lengths
    corpora, tokenizer = load_data(config, work_dir)
    corpus, sampling_s = sampled_epoch(corpora, work_dir)
    seed_everything(SEED)
    model = allocate_model(config, tokenizer, device).train()
    step, updater = make_step(config, model, corpus, device)
    total = lengths.warmup + lengths.windows * lengths.steps
    shaped = model.graphs is not None
    batches = training_batches(corpus, config.training.batch_tokens, total, shaped)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = counted_warmup(model, step, batches[: lengths.warmup], corpus)
    captures = capture_shapes(
        model, step, batches[lengths.warmup :], corpus, config.training.batch_tokens
    )
    windows = []
    for w in range(lengths.windows):
        first = lengths.warmup + w * lengths.steps
        windows.append(timed_window(step, batches[first : first + lengths.steps], device))
        rate = windows[-1].target_tokens / windows[-1].seconds
        log(f"{name}: window {w + 1}/{lengths.windows}: {rate:,.0f} target tok/s")
    target_rates = [w.target_tokens / w.seconds for w in windows]
    return TrainingResult(
        config=config.model.model_dump(mode="json"),
        batch_tokens=config.training.batch_tokens,
        parameters=count_parameters(model),
        vocab_size=tokenizer.trg_vocab_size,
        steps={"warmup": lengths.warmup, "windows": lengths.windows, "per_window": lengths.steps},
        target_tokens_per_s=Spread.of(target_rates),
        tokens_per_s=Spread.of([(w.target_tokens + w.source_tokens) / w.seconds for w in windows]),
        windows=windows,
        padding_fraction=padding_fraction(
            batches,
            corpus.src_lengths,
            corpus.trg_lengths,
            config.training.batch_tokens if shaped else None,
        ),
        cuda_graphs=captures,
        deferred_reads=updater.defers,
        subword_sampling=Sampling(
            config.tokenizer.sampling_alpha, sampling_s, int(corpus.trg_lengths.sum())
        ),
        **_process_figures(config, device),
        **vars(warmup),
        achieved_gflops=warmup.flops_per_target_token * statistics.median(target_rates) / 1e9,
    )


def _process_figures(config: Config, device: torch.device) -> dict[str, Any]:
    """The training process's peak memory, malloc settings and RNN step kernels."""
    gpu = device.type == "cuda"
    return {
        "peak_rss_gib": peak_rss_bytes() / GIB,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "native_kernels": compiled.status() if not gpu and config.run.fast_kernels else None,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / GIB if gpu else None,
    }


def child_arguments(options: Options) -> list[str]:
    """The settings a per-config subprocess needs, as command-line arguments."""
    lengths = options.lengths
    out = ["--device", options.device, "--precision", options.precision]
    out += ["--work-dir", options.work_dir, "--data", options.data]
    out += ["--warmup", str(lengths.warmup), "--windows", str(lengths.windows)]
    out += ["--steps", str(lengths.steps)]
    if options.threads:
        out += ["--threads", str(options.threads)]
    if options.tiny:
        out.append("--tiny")
    if options.large:
        out.append("--large")
    for override in options.overrides:
        out += ["--override", override]
    return out


def child_environment(options: Options) -> dict[str, str]:
    env = {**os.environ, **options.env}
    if options.threads:
        env.setdefault("OMP_NUM_THREADS", str(options.threads))
    return env


def run_config(name: str, options: Options) -> TrainingResult | Failed:
    """``bench_training`` in a subprocess of its own (or in this process with --in-process);
    the subprocess sets itself up as ``nmt train`` does, restart included."""
    if options.in_process:
        return bench_training(name, options)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--one", name, "--one-json", str(out)]
        proc = subprocess.run(
            command + child_arguments(options),
            env=child_environment(options),
            stdout=subprocess.DEVNULL,
            stderr=None if options.verbose else subprocess.PIPE,
            text=True,
        )
        if proc.returncode or not out.is_file():
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            return Failed(f"exit status {proc.returncode}: {tail[0]}")
        return training_from_json(json.loads(out.read_text()))


def training_from_json(data: dict[str, Any]) -> TrainingResult:
    """A training result back from its subprocess's JSON."""
    data = {**data, "windows": [Window(**w) for w in data["windows"]]}
    data["subword_sampling"] = Sampling(**data["subword_sampling"])
    if data.get("cuda_graphs") is not None:
        data["cuda_graphs"] = Captures(**data["cuda_graphs"])
    for key in ("target_tokens_per_s", "tokens_per_s"):
        data[key] = Spread(**data[key])
    return TrainingResult(**data)


# ----------------------------------------------------------------------------- decoding


@dataclass(kw_only=True)
class DecodeRow:
    """One search setting's speed on the test sentences."""

    search: str
    beam_size: int
    batch_size: int
    backend: str  # "torch fp32", "torch bf16", "onnxruntime fp32", "onnxruntime int8"
    constraints_per_sentence: int | None = omitted_when_none()
    sentences: int
    seconds: float  # the median of seconds_each
    seconds_each: list[float] | None = omitted_when_none()  # every run, in order
    sentences_per_s: float
    target_tokens_per_s: float
    mean_output_tokens: float
    # the FLOP bound: the model's matmul FLOPs for these outputs (the encoder once per
    # sentence, the decoder step and output layer once per hypothesis and output token)
    hypothesis_steps: int | None = omitted_when_none()  # beam size x output tokens
    mflop_per_hypothesis_step: float | None = omitted_when_none()
    achieved_gflops: float | None = omitted_when_none()
    matmul_gflops: float | None = omitted_when_none()  # the matmul rate it decoded in
    fraction_of_flop_bound: float | None = omitted_when_none()
    # the same against the matmul rate measured just before each run (``beside_rate``): on
    # a shared machine the rate moves by tens of percent within minutes, the bench's opening
    # measurement with it; the median over the runs of each run's fraction
    matmul_gflops_beside: float | None = omitted_when_none()  # the median of those rates
    matmul_gflops_each: list[float] | None = omitted_when_none()  # each run's, in order
    fraction_of_flop_bound_beside: float | None = omitted_when_none()
    # with a shortlist: the output layer's columns per batch, on average (the FLOPs above
    # count the whole vocabulary, the work of a search without one)
    mean_columns: float | None = omitted_when_none()
    workers: int = 1  # batches decoded at once (decoding.workers)


@dataclass(kw_only=True)
class DecodingModel:
    """The checkpoint decoded, and whether it was trained."""

    model: str
    trained: bool
    note: str


@dataclass(kw_only=True)
class DecodingResult(DecodingModel):
    test_set: str
    precision: str  # as nmt translate decides it
    results: list[DecodeRow]


@dataclass(kw_only=True)
class TranslateCommand(DecodingModel):
    """The whole ``nmt translate`` command; ``error`` instead of the figures if it failed."""

    backend: str = "torch"  # as --backends names it
    error: str | None = omitted_when_none()
    command: str | None = omitted_when_none()
    sentences: int | None = omitted_when_none()
    output_lines: int | None = omitted_when_none()
    seconds: float | None = omitted_when_none()
    sentences_per_s: float | None = omitted_when_none()
    peak_rss_gib: float | None = omitted_when_none()


def untrained_checkpoint(options: Options) -> Path:
    """A freshly initialised bench model saved as a checkpoint, with the shortlist of its
    training pairs as nmt train saves one, so decoding and the translate command can run
    without a trained model."""
    config = bench_config(UNTRAINED_CONFIG, options)
    corpora, tokenizer = load_data(config, Path(options.work_dir))
    sizes = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    shortlist = Shortlist.build(corpora.train, *sizes, config.training.seed)
    seed_everything(SEED)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    tiny = "tiny-" if options.tiny else "large-" if options.large else ""
    path = Path(options.work_dir) / f"untrained-{tiny}{UNTRAINED_CONFIG}"
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "config": config.model_dump(mode="json"),
        "tokenizer": tokenizer.state_dict(),
        "shortlist": shortlist.state_dict(),
    }
    checkpoint.save(path / "best.pt", state)
    return path


def decoding_model(options: Options) -> tuple[Path, bool]:
    """(run directory or checkpoint, trained?): --model, else runs/demo, else untrained."""
    if options.model and options.model != "untrained":
        if not Path(options.model).exists():
            sys.exit(f"--model {options.model}: no such run directory or checkpoint")
        return Path(options.model), True
    demo = ROOT / "runs" / "demo"
    if options.model is None and any((demo / n).is_file() for n in ("best.pt", "last.pt")):
        return demo, True
    return untrained_checkpoint(options), False


def decode_row(
    translator: Translator,
    src_ids: list[list[int]],
    device: torch.device,
    setting: tuple[int, int],
    constrained: tuple[int, Steering] | None = None,
    backend: str | None = None,
    counter: Translator | None = None,
    repeats: int = 1,
    matmul_size: int = MATMUL_SIZE,
) -> DecodeRow:
    """The test sentences decoded with one (beam size, batch size), timed ``repeats`` times
    (the median counts: one run on a shared machine is noisy); ``constrained``:
    (constraints per sentence, the constraints); ``backend``: the row's name of what decoded
    (default: torch in the translator's precision); ``counter``: the translator whose torch
    model counts the FLOPs (default: ``translator``, which has none under onnxruntime).
    Before each run the matmul rate in the decoding precision is measured again
    (``beside_rate``, ``matmul_size``^3), for the row's fraction of the FLOP bound beside it."""
    beam_size, batch_size = setting
    decoding = translator.config.decoding.model_copy(
        update={"beam_size": beam_size, "batch_size": batch_size}
    )
    count, steering = constrained or (None, None)
    each, rates = [], []
    dtype = torch.bfloat16 if translator.precision == "bf16" else torch.float32
    for _ in range(repeats):
        rates.append(beside_rate(device, dtype, matmul_size))
        hypotheses, seconds = timed(
            device, lambda: translator.decode_ids(src_ids, decoding, steering=steering)
        )
        each.append(seconds)
    seconds = statistics.median(each)
    tokens = sum(len(nbest[0].tokens) + 1 for nbest in hypotheses if nbest)  # with EOS
    search = "greedy" if beam_size == 1 else f"beam {beam_size}"
    if count is not None:
        search += f", {count} constraint{'s' if count > 1 else ''}"
    backend = backend or backend_name("torch", translator)
    log(
        f"decoding {search}, batch {batch_size}, {backend}: "
        f"{len(src_ids) / seconds:.1f} sentences/s"
    )
    outputs = [
        (ids, nbest[0].tokens) for ids, nbest in zip(src_ids, hypotheses, strict=True) if nbest
    ]
    counter = counter or translator
    flops = decode_flops(counter, outputs, beam_size) if counter.model else None
    shortlists = translator.decoding_shortlists(decoding)
    batches = length_sorted_batches([len(s) for s in src_ids], batch_size)
    workers = worker_count(decoding.workers, device, [len(b) for b in batches])
    columns = None
    if shortlists is not None:
        sizes = [
            len(
                batch_columns(
                    shortlists,
                    [src_ids[i] for i in batch],
                    decoding.shortlist_frequent,
                    decoding.shortlist_per_word,
                    forced_pieces(
                        steering.subset(batch.tolist()) if steering else None, len(batch)
                    ),
                )[0]
            )
            for batch in batches
        ]
        columns = sum(sizes) / len(sizes)
    return DecodeRow(
        search=search,
        beam_size=beam_size,
        batch_size=batch_size,
        backend=backend,
        constraints_per_sentence=count,
        sentences=len(src_ids),
        seconds=seconds,
        seconds_each=each if repeats > 1 else None,
        sentences_per_s=len(src_ids) / seconds,
        target_tokens_per_s=tokens / seconds,
        mean_output_tokens=tokens / len(src_ids),
        hypothesis_steps=beam_size * tokens,
        mflop_per_hypothesis_step=None if flops is None else flops / (beam_size * tokens) / 1e6,
        achieved_gflops=None if flops is None else flops / seconds / 1e9,
        matmul_gflops_beside=statistics.median(rates),
        matmul_gflops_each=rates if repeats > 1 else None,
        fraction_of_flop_bound_beside=None
        if flops is None
        else statistics.median(flops / t / 1e9 / r for t, r in zip(each, rates, strict=True)),
        mean_columns=columns,
        workers=workers,
    )


def decode_flops(
    translator: Translator, outputs: list[tuple[list[int], list[int]]], beam_size: int
) -> float:
    """The matmul FLOPs a search for these outputs needs at the least: each source encoded
    once (encoder, key projection, bridge) and, for each of the K hypotheses, one decoder
    step and output layer per output token (EOS included), counted by ``FlopCounterMode`` on
    a forward pass of a (source, output) pair alone (no padding).

    Both counts are linear in the source length |x|, the decoder's also in the steps |y|+1
    (encoder a + b|x|, decoder (|y|+1)(c + d|x|)): three pairs give a, b, c and d, and a
    fourth checks them; where it disagrees (a score whose work grows otherwise), every
    pair of lengths is counted."""
    model = translator.model
    assert model is not None
    lengths = [(len(src_ids), len(tokens) + 1) for src_ids, tokens in outputs]
    with torch.no_grad(), eval_mode(model):

        def count(source: int, steps: int) -> tuple[int, int]:
            return _pair_flops(model, [4] * source, [4] * (steps - 1), translator.device)

        (e1, d11), (e2, d21) = count(1, 1), count(2, 1)
        b, d = e2 - e1, d21 - d11
        a, c = e1 - b, d11 - d

        def formula(key: tuple[int, int]) -> tuple[int, int]:
            source, steps = key
            return a + b * source, steps * (c + d * source)

        flops_of = formula
        if count(3, 4) != formula((3, 4)):
            flops_of = {key: count(*key) for key in set(lengths)}.__getitem__
    return float(sum(e + beam_size * dec for e, dec in map(flops_of, lengths)))


def _pair_flops(
    model: Seq2Seq, src_ids: list[int], tokens: list[int], device: torch.device
) -> tuple[int, int]:
    """(encoder FLOPs, decoder and output layer FLOPs) of one (source, output) pair."""
    src = torch.tensor([src_ids], device=device)
    lengths = torch.tensor([len(src_ids)], device=device)
    trg_in = torch.tensor([[BOS_ID, *tokens]], device=device)
    encoder, _ = count_step_flops(model, lambda: model.encode(src, lengths), 1)
    both, _ = count_step_flops(model, lambda: model.log_probs(model(src, lengths, trg_in)[0]), 1)
    return encoder, both - encoder


def bench_decoding(
    model_path: Path,
    sources: list[str],
    references: list[str],
    device: torch.device,
    options: Options,
) -> tuple[str, list[DecodeRow]]:
    """Greedy and beam 5, batch sizes 1 and 64, through ``Translator.decode_ids``; then beam 5
    (batch 64) with 1 and 3 constraints per sentence, words of its reference (Post & Vilar's
    search). In the precision ``nmt translate`` decides (``--precision auto``); returns it
    and the rows. Each other backend of ``--backends`` adds the four unconstrained rows."""
    translator = Translator.from_checkpoint(model_path, device.type, "auto")
    src_ids = translator.tokenizer.encode_src(sources)
    # one greedy pass at each batch size of the rows before any run is timed: the
    # Translator's tables, and each worker's first batch
    for batch_size in sorted({batch for _, batch in DECODE_SETTINGS}):
        warm = translator.config.decoding.model_copy(
            update={"beam_size": 1, "batch_size": batch_size}
        )
        translator.decode_ids(src_ids[: 2 * batch_size], warm)
    repeats = options.lengths.decode_repeats
    size = TINY_MATMUL_SIZE if options.tiny else MATMUL_SIZE
    rows = [
        decode_row(translator, src_ids, device, setting, repeats=repeats, matmul_size=size)
        for setting in DECODE_SETTINGS
    ]
    if device.type == "cuda":  # the same again: its search steps kept from the first pass
        again = backend_name("torch", translator) + ", second pass"
        rows += [
            decode_row(
                translator, src_ids, device, s, None, again, repeats=repeats, matmul_size=size
            )
            for s in DECODE_SETTINGS
        ]
    for count in CONSTRAINT_COUNTS:
        phrases = reference_constraints(references, count)
        steering = Steering(
            constraints=[
                [translator.target_ids(p, f"reference {n}") for p in row]
                for n, row in enumerate(phrases, start=1)
            ]
        )
        rows.append(
            decode_row(
                translator,
                src_ids,
                device,
                (5, 64),
                (count, steering),
                repeats=repeats,
                matmul_size=size,
            )
        )
    for backend in options.backends:
        other = backend_translator(backend, translator, model_path, device, options)
        if other is None:
            continue
        other.decode_ids(src_ids[:4], warm)
        name = backend_name(backend, other)
        for setting in DECODE_SETTINGS:
            rows.append(
                decode_row(other, src_ids, device, setting, None, name, translator, repeats, size)
            )
    precision = f"{translator.precision} ({translator.precision_reason}, as nmt translate)"
    return precision, rows


def backend_name(backend: str, translator: Translator) -> str:
    """A row's backend: "torch fp32 shortlist" (the model's lexical shortlist, which
    ``nmt translate`` uses by default), "torch fp32" (the whole vocabulary), "onnxruntime
    int8", ..."""
    if backend.startswith("onnxruntime"):
        return "onnxruntime int8" if backend.endswith("int8") else "onnxruntime fp32"
    shortlisted = translator.decoding_shortlists(translator.config.decoding) is not None
    name = f"torch {translator.precision}" + (" shortlist" if shortlisted else "")
    if backend == "torch-plain-loop":
        return name + ", plain loop"
    if backend == "torch-loop-no-graphs":
        return name + ", device loop without graphs"
    if backend == "torch-2workers":
        return name + ", 2 workers"
    return name + (", 1 worker" if backend == "torch-1worker" else "")


def backend_translator(
    backend: str, default: Translator, model_path: Path, device: torch.device, options: Options
) -> Translator | None:
    """The translator of another ``--backends`` entry, None where it is the default's
    (torch) or the same (torch-bf16 where auto chose bf16)."""
    if backend == "torch" or (backend == "torch-bf16" and default.precision == "bf16"):
        return None
    if backend == "torch-bf16":
        return Translator.from_checkpoint(model_path, device.type, "bf16")
    if backend in WORKER_BACKENDS:
        workers = WORKER_BACKENDS[backend]
        if default.config.decoding.workers == workers or (workers == 2 and device.type == "cpu"):
            return None  # the default's already (a CPU's auto: two at a time)
        other = Translator.from_checkpoint(model_path, device.type, default.precision)
        decoding = other.config.decoding.model_copy(update={"workers": workers})
        other.config = other.config.model_copy(update={"decoding": decoding})  # --workers N
        return other
    if backend in ("torch-plain-loop", "torch-loop-no-graphs"):
        if not runs_on_device(default.config.decoding, device, None):
            return None  # the default takes the plain loop already (a CPU)
        other = Translator.from_checkpoint(model_path, device.type, default.precision)
        change = (
            {"device_loop": False} if backend.endswith("plain-loop") else {"cuda_graphs": False}
        )
        decoding = other.config.decoding.model_copy(update=change)
        other.config = other.config.model_copy(update={"decoding": decoding})
        return other
    if backend == "torch-whole":
        if default.decoding_shortlists(default.config.decoding) is None:  # the default
            # row already decodes the whole vocabulary (no shortlist, or a GPU's auto)
            return None
        whole = Translator.from_checkpoint(model_path, device.type, default.precision)
        whole.shortlists = None  # as --shortlist off
        return whole
    return Translator.from_exported(exported_model(model_path, backend, options))


def exported_model(model_path: Path, backend: str, options: Options) -> Path:
    """``nmt export`` of the decoding model for an onnxruntime backend, under the work
    directory (made again by every bench run: an export takes seconds)."""
    quantize = "int8" if backend.endswith("int8") else None
    output = Path(options.work_dir) / "exports" / f"{model_path.name}-{quantize or 'fp32'}"
    output.parent.mkdir(parents=True, exist_ok=True)
    log(f"exporting {model_path} to {output}" + (" with int8 weights" if quantize else ""))
    export_command(ExportRequest(model_path, output, "onnx", quantize))
    return output


def nmt_command() -> list[str]:
    script = Path(sys.executable).parent / "nmt"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "nmt"]


def bench_translate_command(
    options: Options,
    model: DecodingModel,
    sources: list[str],
    device: torch.device,
    backend: str = "torch",
) -> TranslateCommand:
    """Wall clock of the whole ``nmt translate --beam 5`` command, start-up included, on one
    of ``BACKENDS`` (an onnxruntime one translates the export ``exported_model`` made)."""
    work_dir = Path(options.work_dir)
    input_path = work_dir / f"translate-input-{len(sources)}.txt"
    output_path = work_dir / "translate-output.txt"
    input_path.write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    source = model.model
    if backend.startswith("onnxruntime"):
        source = str(exported_model(Path(model.model), backend, options))
    command = [*nmt_command(), "translate", "--model", source, "--beam", "5"]
    command += ["--input", str(input_path), "--output", str(output_path)]
    if backend.startswith("onnxruntime"):
        command += ["--backend", "onnxruntime"]
    else:
        command += ["--device", device.type]
    if backend == "torch-bf16":
        command += ["--precision", "bf16"]
    if backend == "torch-whole":
        command += ["--shortlist", "off"]
    if backend in WORKER_BACKENDS:
        command += ["--workers", str(WORKER_BACKENDS[backend])]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=child_environment(options), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    with proc.stderr:
        stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return TranslateCommand(
            **vars(model), backend=backend, error=f"exit status {proc.returncode}: {tail[0]}"
        )
    return TranslateCommand(
        **vars(model),
        backend=backend,
        command=" ".join(["nmt", *command[len(nmt_command()) :]]),
        sentences=len(sources),
        output_lines=output_path.read_text(encoding="utf-8").count("\n"),
        seconds=seconds,
        sentences_per_s=len(sources) / seconds,
        peak_rss_gib=usage.ru_maxrss * 1024 / GIB,
    )


# ----------------------------------------------------------------------------- the run


@dataclass(kw_only=True)
class Machine:
    device: str
    device_name: str
    cpu_count: int | None
    threads: int
    torch: str
    python: str
    precision: str  # the training precision, once decided
    environment: dict[str, str]  # the variables that change the figures
    git_commit: str | None


@dataclass(kw_only=True)
class Settings:
    sizes: dict[str, int]
    quick: bool
    lengths: Lengths
    env: dict[str, str]
    overrides: list[str]
    subprocess_per_config: bool


@dataclass(kw_only=True)
class DataSummary:
    train: str
    training_pairs: int
    vocab_size: int
    batch_tokens: int
    batches_per_epoch: int
    padding_fraction_epoch: float
    seconds: float  # to prepare it


@dataclass(kw_only=True)
class BenchResult:
    """Everything one bench run measured: the JSON file, and what the tables show."""

    date: str
    machine: Machine
    load_average_start: tuple[float, float, float]
    settings: Settings
    data: DataSummary | None = None
    precision: dict[str, Any] | None = None  # --precision asked and what it became, and why
    matmul: dict[str, MatmulRate] | None = omitted_when_none()
    training: dict[str, TrainingResult | Failed] | None = omitted_when_none()
    decoding: DecodingResult | None = omitted_when_none()
    translate_command: TranslateCommand | None = omitted_when_none()
    # the same command on each other backend of --backends
    translate_backends: list[TranslateCommand] | None = omitted_when_none()
    load_average_end: tuple[float, float, float] | None = None
    runtime_s: float | None = None


def machine(device: torch.device, precision: str) -> Machine:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    watched = ("OMP_NUM_THREADS", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_", "GLIBC_TUNABLES")
    return Machine(
        device=device.type,
        device_name=name,
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        precision=precision,
        environment={k: v for k, v in os.environ.items() if k.startswith(watched)},
        git_commit=project_commit(describe=True),
    )


def prepare(options: Options, names: list[str]) -> DataSummary:
    """Train (or load) the tokenizer and tokenise the corpus once, before any subprocess."""
    started = time.perf_counter()
    config = bench_config(names[0], options)
    corpora, tokenizer = load_data(config, Path(options.work_dir))
    corpus = corpora.train
    batches = bucket_batches(
        corpus.src_lengths, corpus.trg_lengths, config.training.batch_tokens, SEED, 0
    )
    return DataSummary(
        train=config.data.train,
        training_pairs=len(corpus),
        vocab_size=tokenizer.trg_vocab_size,
        batch_tokens=config.training.batch_tokens,
        batches_per_epoch=len(batches),
        padding_fraction_epoch=padding_fraction(batches, corpus.src_lengths, corpus.trg_lengths),
        seconds=time.perf_counter() - started,
    )


def run(options: Options, names: list[str]) -> BenchResult:
    started = time.perf_counter()
    device = choose_device(options.device)
    set_threads(options.threads)
    result = BenchResult(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=machine(device, options.precision),
        load_average_start=os.getloadavg(),
        settings=Settings(
            sizes=options.sizes,
            quick=options.quick,
            lengths=options.lengths,
            env=options.env,
            overrides=options.overrides,
            subprocess_per_config=not options.in_process,
        ),
    )
    log("preparing data (the first run trains sentencepiece)")
    result.data = prepare(options, names)
    result.precision, options = resolve_precision(options, names[0], device, result.data.vocab_size)
    result.machine.precision = options.precision
    log(f"precision: {options.precision} ({result.precision['precision_reason']})")
    if "matmul" in options.parts or "decode" in options.parts:  # decode: its FLOP bound
        log(f"matmul rate ({MATMUL_SIZE}^3)")
        size = TINY_MATMUL_SIZE if options.tiny else MATMUL_SIZE
        result.matmul = matmul_rates(device, options.precision, options.quick, size)
    if "train" in options.parts:
        result.training = {}
        for name in names:
            log(f"training {name}")
            result.training[name] = run_config(name, options)
        add_matmul_fractions(result)
    if "decode" in options.parts or "translate" in options.parts:
        add_decoding(result, options, device)
        add_flop_bound(result)
    result.load_average_end = os.getloadavg()
    result.runtime_s = time.perf_counter() - started
    return result


def resolve_precision(
    options: Options, name: str, device: torch.device, vocab_size: int
) -> tuple[dict[str, Any], Options]:
    """``--precision`` as nmt train decides it, for the first config's model (the configs share
    their sizes); returns the decision and the options every config then trains with."""
    config = bench_config(name, options)
    model = build_model(config.model, vocab_size, vocab_size)  # a joint vocabulary
    rows = config.training.batch_tokens // 2  # as nmt train: about a batch's target tokens
    chosen = choose_precision(options.precision, device, model, rows, source="--precision")
    decided = {"asked": config.training.precision, **chosen.record()}
    return decided, replace(options, precision=chosen.name)


def add_matmul_fractions(result: BenchResult) -> None:
    """Achieved FLOP/s as a fraction of the matmul rate in the training precision."""
    rates = result.matmul or {}
    peak = rates.get(result.machine.precision, rates.get("fp32"))
    for entry in (result.training or {}).values():
        if isinstance(entry, TrainingResult) and peak:
            entry.matmul_gflops = peak.gflops
            entry.fraction_of_matmul = entry.achieved_gflops / peak.gflops


def add_flop_bound(result: BenchResult) -> None:
    """Each decoding row's achieved FLOP/s as a fraction of the matmul rate in the precision
    it decoded in (fp32's where that one was not measured): the fraction of the FLOP bound."""
    rates = result.matmul or {}
    if result.decoding is None or not rates:
        return
    for row in result.decoding.results:
        precision = row.backend.split(" ")[-1]  # int8 rows: against fp32's rate
        peak = rates.get(precision, rates.get("fp32"))
        if peak is not None and row.achieved_gflops is not None:
            row.matmul_gflops = peak.gflops
            row.fraction_of_flop_bound = row.achieved_gflops / peak.gflops


def add_decoding(result: BenchResult, options: Options, device: torch.device) -> None:
    model_path, trained = decoding_model(options)
    config = bench_config(UNTRAINED_CONFIG, options)
    sources, references = test_sentences(config, Path(options.work_dir))
    note = "trained" if trained else "untrained (outputs run to max length)"
    model = DecodingModel(model=str(model_path), trained=trained, note=note)
    if "decode" in options.parts:
        first = sources[: options.lengths.decode_sentences]
        log(f"decoding the first {len(first)} test sentences with {model_path} ({note})")
        precision, rows = bench_decoding(
            model_path, first, references[: len(first)], device, options
        )
        result.decoding = DecodingResult(
            **vars(model),
            test_set=f"first {len(first)} of {len(sources)} sentences of {config.data.test}",
            precision=precision,
            results=rows,
        )
    if "translate" in options.parts:
        quick = options.lengths.decode_sentences if options.quick else None
        chosen = sources[: options.translate_sentences or quick]
        log(f"nmt translate --beam 5 on {len(chosen)} test sentences")
        result.translate_command = bench_translate_command(options, model, chosen, device)
        decode_only = ("torch", "torch-plain-loop", "torch-loop-no-graphs")
        others = [b for b in options.backends if b not in decode_only]
        if others:
            result.translate_backends = [
                bench_translate_command(options, model, chosen, device, backend)
                for backend in others
            ]


# ----------------------------------------------------------------------------- reports


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def training_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    gpu = result["machine"]["device"] == "cuda"
    for name, entry in result.get("training", {}).items():
        if "error" in entry:
            rows.append([name, entry["error"], "", "", "", "", "", ""])
            continue
        target, both = entry["target_tokens_per_s"], entry["tokens_per_s"]
        memory = entry["peak_gpu_memory_gib"] if gpu else entry["peak_rss_gib"]
        fraction = entry.get("fraction_of_matmul")
        notes = []
        if entry["rnn_flops_added_analytically"]:
            notes.append("analytic: " + ", ".join(entry["rnn_flops_added_analytically"]))
        graphs = entry.get("cuda_graphs")
        if graphs:
            notes.append(
                f"CUDA graphs: {graphs['shapes']} shapes, {graphs['capture_seconds']:.1f} s "
                f"to capture, padding {100 * entry['padding_fraction']:.0f}%"
            )
        if entry.get("deferred_reads"):
            notes.append("deferred reads")
        note = "; ".join(notes)
        rows.append(
            [
                name,
                _fmt(target["median"]),
                f"{_fmt(target['min'])}-{_fmt(target['max'])}",
                _fmt(both["median"]),
                _fmt(memory, 2),
                _fmt(entry["flops_per_target_token"] / 1e6, 1),
                _fmt(entry["achieved_gflops"], 1),
                "-" if fraction is None else f"{100 * fraction:.1f}%",
                note,
            ]
        )
    return rows


TRAINING_HEADER = [
    "config",
    "target tok/s (median)",
    "min-max",
    "src+tgt tok/s",
    "peak mem GiB",
    "MFLOP/target tok",
    "GFLOP/s",
    "of matmul",
    "note",
]
DECODING_HEADER = [
    "search",
    "backend",
    "batch",
    "sentences/s",
    "target tok/s",
    "seconds",
    "MFLOP/hyp step",
    "GFLOP/s",
    "of FLOP bound",
    "beside",
    "columns",
    "workers",
]


def decoding_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            entry["search"],
            entry.get("backend", "torch"),
            str(entry["batch_size"]),
            _fmt(entry["sentences_per_s"], 1),
            _fmt(entry["target_tokens_per_s"]),
            _fmt(entry["seconds"], 1),
            _fmt(entry.get("mflop_per_hypothesis_step"), 2),
            _fmt(entry.get("achieved_gflops"), 1),
            _percent(entry.get("fraction_of_flop_bound")),
            _percent(entry.get("fraction_of_flop_bound_beside")),
            _fmt(entry.get("mean_columns")),
            str(entry.get("workers", 1)),
        ]
        for entry in result.get("decoding", {}).get("results", [])
    ]
    commands = [result.get("translate_command"), *result.get("translate_backends", [])]
    for command in commands:
        if not command or "error" in command:
            continue
        rows.append(
            [
                f"nmt translate --beam 5, whole command ({command['sentences']} sentences)",
                command.get("backend", "torch"),
                "-",
                _fmt(command["sentences_per_s"], 1),
                "-",
                _fmt(command["seconds"], 1),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
        )
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def summary_lines(result: dict[str, Any]) -> list[str]:
    m, data = result["machine"], result["data"]
    lines = [
        f"{m['device_name']} ({m['device']}), {m['threads']} threads, torch {m['torch']}, "
        f"{m['precision']} autocast; {result['date']}; git {m['git_commit']}",
        f"data: {data['training_pairs']:,} training pairs, vocabulary {data['vocab_size']}, "
        f"{data['batches_per_epoch']} batches of <= {data['batch_tokens']} tokens per epoch, "
        f"padding {100 * data['padding_fraction_epoch']:.1f}%",
    ]
    chosen = result.get("precision")
    if chosen:
        probe = chosen.get("precision_probe")
        timed = (
            f"; probe fp32 {1e3 * probe['fp32_s']:.1f} ms, bf16 {1e3 * probe['bf16_s']:.1f} ms"
            if probe
            else ""
        )
        lines.append(
            f"--precision {chosen['asked']}: {chosen['precision']} ({chosen['precision_reason']}"
            f"{timed})"
        )
    if "matmul" in result:
        rates = ", ".join(f"{k} {v['gflops']:,.0f}" for k, v in result["matmul"].items())
        lines.append(f"matmul {MATMUL_SIZE}^3 GFLOP/s: {rates}")
    decoding = result.get("decoding") or result.get("translate_command")
    if decoding:
        lines.append(f"decoding model: {decoding['model']}, {decoding['note']}")
    if "decoding" in result:
        lines.append(f"decoding set: {result['decoding']['test_set']}")
        lines.append(f"decoding precision: {result['decoding'].get('precision', 'fp32')}")
    command = result.get("translate_command")
    if command:
        lines.append(
            f"translate command: {command.get('error') or command['command']} "
            f"({command.get('sentences', '?')} sentences)"
        )
    trained = [r for r in result.get("training", {}).values() if "error" not in r]
    tunables = sorted({str(r.get("glibc_tunables")) for r in trained})
    if tunables != ["None"] and tunables:
        lines.append(f"training processes' GLIBC_TUNABLES: {', '.join(tunables)}")
    kernels = sorted({str(r.get("native_kernels")) for r in trained})
    if kernels != ["None"] and kernels:
        lines.append(f"RNN step kernels: {'; '.join(kernels)}")
    load = result.get("load_average_start")
    lines.append(
        f"load average at start {load[0]:.2f} (cores {m['cpu_count']}); "
        f"runtime {result.get('runtime_s', 0):.0f} s"
    )
    return lines


def print_tables(result: dict[str, Any], stream: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, width=160)
    for line in summary_lines(result):
        console.print(line, highlight=False)
    for title, header, rows in (
        ("training", TRAINING_HEADER, training_rows(result)),
        ("decoding", DECODING_HEADER, decoding_rows(result)),
    ):
        if rows:
            table = Table(title=title, title_justify="left")
            for column in header:
                table.add_column(column, justify="left" if column in header[:1] else "right")
            for row in rows:
                table.add_row(*row[: len(header)])
            console.print(table)


def markdown(result: dict[str, Any]) -> str:
    out = [f"- {line}" for line in summary_lines(result)]
    for header, rows in (
        (TRAINING_HEADER, training_rows(result)),
        (DECODING_HEADER, decoding_rows(result)),
    ):
        if rows:
            out += ["", "| " + " | ".join(header) + " |"]
            out.append("| --- " + "| ---: " * (len(header) - 1) + "|")
            out += ["| " + " | ".join(row[: len(header)]) + " |" for row in rows]
    return "\n".join(out) + "\n"


def report(result: dict[str, Any], as_markdown: bool) -> None:
    """Tables on stdout; with --markdown the Markdown on stdout and the tables on stderr."""
    print_tables(result, sys.stderr if as_markdown else sys.stdout)
    if as_markdown:
        sys.stdout.write(markdown(result))


# ----------------------------------------------------------------------------- command line


def environment_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env {text!r}: expected KEY=VALUE")
    return key, value


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)}")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: auto")
    add(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="training autocast (weights stay fp32); default auto, decided as nmt train does",
    )
    add("--threads", type=int, help="torch threads (default: torch's, all cores)")
    add("--work-dir", default="runs/bench", help="tokenizer, corpus cache, JSON (runs/bench)")
    add("--data", default="data/bible", help="corpus dir with {train,dev,test}.{es,en}[.gz]")
    add("--json", help="results file (default WORK_DIR/bench-<device>.json)")
    add("--markdown", action="store_true", help="print a Markdown table (docs/benchmarks.md)")
    add("--quick", action="store_true", help="a fast smoke run: few steps, few sentences")
    add("--tiny", action="store_true", help="tiny model and vocabulary (for tests)")
    add(
        "--large",
        action="store_true",
        help="a GPU-sized model: bi-GRU 1024, 2-layer decoder 1024, 28k pieces, 16k-token batches",
    )
    add("--warmup", type=int, help="warm-up steps, FLOPs counted (3; quick 1)")
    add("--windows", type=int, help="timed windows (5; quick 2)")
    add("--steps", type=int, help="steps per timed window (5; quick 2)")
    add("--decode-sentences", type=int, help="test sentences decoded in-process (200; quick 16)")
    add(
        "--decode-repeats",
        type=int,
        help="runs of each decoding row, the median reported (3; quick 1)",
    )
    add(
        "--translate-sentences",
        type=int,
        help="test sentences for the nmt translate command (all; quick 16)",
    )
    add(
        "--model",
        help="run dir or checkpoint to decode with; 'untrained' for a fresh bench model "
        "(default: runs/demo when it exists)",
    )
    add("--parts", default=",".join(PARTS), help=f"comma list of: {', '.join(PARTS)}")
    add(
        "--backends",
        default="torch",
        help=f"what decode and translate run on, comma list of: {', '.join(BACKENDS)} "
        "(default torch)",
    )
    add(
        "--env",
        action="append",
        type=environment_pair,
        default=[],
        metavar="KEY=VALUE",
        help="environment of the per-config and translate subprocesses (repeatable)",
    )
    add(
        "--override",
        action="append",
        dest="overrides",
        default=[],
        metavar="KEY=VALUE",
        help="config override of every bench config, as nmt train --override (repeatable),\n"
        "e.g. run.fast_kernels=false for torch's own RNN and dropout kernels",
    )
    add("--in-process", action="store_true", help="no subprocess per config (peaks then mix)")
    add("--report", metavar="JSON", help="print the tables of an earlier run and exit")
    add("--verbose", action="store_true", help="show the subprocesses' stderr")
    add("--one", help=argparse.SUPPRESS)  # internal: train one config in this process
    add("--one-json", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> Options:
    """The command line as Options, the lengths defaulted (smaller with --quick)."""
    command_line = parser()
    args = command_line.parse_args(argv)
    quick = args.quick
    lengths = Lengths(
        warmup=args.warmup if args.warmup is not None else (1 if quick else 3),
        windows=args.windows or (2 if quick else 5),
        steps=args.steps or (2 if quick else 5),
        decode_sentences=args.decode_sentences or (16 if quick else 200),
        decode_repeats=args.decode_repeats or (1 if quick else 3),
    )
    if lengths.warmup < 1:
        command_line.error("--warmup: at least 1 (the FLOPs are counted on the warm-up steps)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        command_line.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown or not backends:
        command_line.error(f"--backends: unknown {', '.join(sorted(unknown)) or '(none)'}")
    values = {k: v for k, v in vars(args).items() if k not in vars(lengths)}
    values.update(parts=parts, backends=backends, env=dict(args.env))
    return Options(**{**values, "lengths": lengths})


def config_names(options: Options) -> list[str]:
    names = [n.strip() for n in options.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        sys.exit(f"--configs: unknown {', '.join(unknown) or '(none)'}; use {', '.join(CONFIGS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    limit_kernel_cache()  # as `nmt train` and `nmt translate` do, before the first kernel
    options = parse_args(argv)
    if options.report:
        report(json.loads(Path(options.report).read_text()), options.markdown)
        return
    if options.one:
        trained = bench_training(options.one, options)
        Path(str(options.one_json)).write_text(json.dumps(to_json(trained)))
        return
    result = to_json(run(options, config_names(options)))
    device = result["machine"]["device"]
    path = Path(options.json or Path(options.work_dir) / f"bench-{device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"results: {path}")
    report(result, options.markdown)


if __name__ == "__main__":
    main()
