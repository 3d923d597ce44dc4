"""What each of training's speed paths earns: the bench's training steps, each path turned
off alone, paired with everything on.

A speed path keeps its lines where training is measurably faster (or lighter) with it. For
each bench configuration this builds the model afresh per variant (the same seed), runs a
warm-up step and then ``--steps`` steps on the bench's batches, with every path on and with
each path below off, alternated round by round, and prints each variant's median target
tokens/s, everything on's over it, and the first timed step's loss beside everything on's:

    python scripts/ablate_training.py --configs bahdanau,luong-nofeed --rounds 3
    python scripts/ablate_training.py --precision bf16      # on a CPU with native bf16
    python scripts/ablate_training.py --device cuda --precision auto \
        --paths fused_loss,gradient_sinks,weight_sink     # a GPU's paths (CUDA graphs on)

A path is turned off by replacing, for its variant alone (the model's build included), the
function through which it runs with the plain path's; each replacement counts its calls (a
path a configuration never reaches shows 0). Paths:

- ``recurrence_kernels``: the RNNs through nmt's compiled step kernels (``fast.recurrence``);
- ``loss_kernel``: the output layer's softmax statistics in one compiled pass (``fast.loss``);
- ``fused_loss``: the output layer and its loss fused, no (N, V) float32 logits
  (``OutputLayerLoss``);
- ``dropout_16bit``: dropout masks from 16 random bits (``fast.dropout``);
- ``additive_recompute``: the additive score's tanh layer recomputed in backward
  (``fast.additive``);
- ``gradient_sinks``: the attention memory's gradient once per batch (``fast.sinks``);
- ``weight_sink``: Luong's W_c gradient once per batch under input feeding (``fast.sinks``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402
from ablate_search import swapped  # noqa: E402

from nmt.fast import FastPaths, additive, compiled, loss, recurrence, sinks  # noqa: E402
from nmt.runtime import choose_device, seed_everything  # noqa: E402
from nmt.training.process import setup_process  # noqa: E402
from nmt.training.run import allocate_model  # noqa: E402


def _plain_loss(*args: Any, **kwargs: Any) -> Any:
    features, weight, target, eps, _fused, native, *rows = args
    return ORIGINAL_LOSS(features, weight, target, eps, False, native, *rows, **kwargs)


def _plain_energies(q: Any, keys: Any, v: Any, recompute: bool) -> Any:
    return ORIGINAL_ENERGIES(q, keys, v, recompute=False)


ORIGINAL_LOSS = loss.output_layer_loss
ORIGINAL_ENERGIES = additive.additive_energies
PATHS: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "recurrence_kernels": (recurrence, "runs_here", lambda rnn, inputs: False),
    "loss_kernel": (compiled, "softmax_xent", lambda *args: False),
    "fused_loss": (loss, "output_layer_loss", _plain_loss),
    "dropout_16bit": (FastPaths, "dropout", lambda self, p: nn.Dropout(p)),
    "additive_recompute": (additive, "additive_energies", _plain_energies),
    "gradient_sinks": (FastPaths, "step_products", lambda self, training: sinks.PLAIN_PRODUCTS),
    "weight_sink": (FastPaths, "step_linear", lambda self, linear, training: linear),
}


def run_variant(
    config: Any, corpus: Any, tokenizer: Any, device: torch.device, steps: int
) -> tuple[float, float]:
    """A fresh model's warm-up step (with CUDA graphs, and one untimed step per shape the
    timed ones meet), then the timed ones -> (target tokens/s, the first timed step's loss
    per target token)."""
    seed_everything(bench.SEED)
    model = allocate_model(config, tokenizer, device).train()
    step, _ = bench.make_step(config, model, corpus, device)
    tokens = config.training.batch_tokens
    batches = bench.training_batches(corpus, tokens, steps + 1, model.graphs is not None)
    step(batches[0])
    bench.capture_shapes(model, step, batches[1:], corpus, tokens)
    bench.synchronize(device)
    started = time.perf_counter()
    results = [step(indices) for indices in batches[1:]]
    bench.synchronize(device)
    seconds = time.perf_counter() - started
    return sum(r[1] for r in results) / seconds, float(results[0][0]())


def ablate(args: argparse.Namespace, name: str, paths: list[str]) -> dict[str, Any]:
    """One configuration's figures, per variant (``everything_on`` first)."""
    variants = ["everything_on", *paths]
    argv = ["--device", args.device, "--precision", args.precision, "--configs", name]
    argv += ["--work-dir", args.work_dir, "--data", args.data] + ["--tiny"] * args.tiny
    for override in args.override:
        argv += ["--override", override]
    options = bench.parse_args(argv)
    config = bench.bench_config(name, options)
    device = choose_device(config.run.device)
    corpora, tokenizer = bench.load_data(config, Path(args.work_dir))
    decided, options = bench.resolve_precision(options, name, device, tokenizer.trg_vocab_size)
    config = bench.bench_config(name, options)
    setup_process(config, restart=False)
    speeds: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, float] = {}
    calls = {v: {"calls": 0} for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            off = PATHS.get(variant)
            with swapped(*off, calls[variant]) if off else contextlib.nullcontext():
                speed, first = run_variant(config, corpora.train, tokenizer, device, args.steps)
            speeds[variant].append(speed)
            losses[variant] = first
    on = statistics.median(speeds["everything_on"])
    return {
        "precision": decided,
        "variants": {
            v: {
                "tokens_per_s": speeds[v],
                "median_tokens_per_s": statistics.median(speeds[v]),
                "on_over_off": on / statistics.median(speeds[v]),
                "calls": calls[v]["calls"],
                "first_loss": losses[v],
            }
            for v in variants
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--configs", default="bahdanau,luong-feed,luong-nofeed", help="bench configurations")
    add("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    add("--precision", default="fp32", help="training precision (fp32, bf16, fp16, auto)")
    add("--override", action="append", default=[], help="config override (repeatable)")
    add("--steps", type=int, default=4, help="timed steps per variant and round")
    add("--rounds", type=int, default=3, help="rounds, each variant once per round")
    add("--paths", default=",".join(PATHS), help="the paths to turn off")
    add("--work-dir", default="runs/bench")
    add("--data", default="data/bible")
    add("--tiny", action="store_true", help="the bench's tiny sizes (for tests)")
    add("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    args.rounds, args.steps = max(1, args.rounds), max(1, args.steps)
    report: dict[str, Any] = {"device": args.device, "precision": args.precision}
    report.update(threads=torch.get_num_threads(), configs={})
    for name in args.configs.split(","):  # each printed and written once done
        figures = report["configs"][name] = ablate(args, name, paths)
        print(f"{name} ({figures['precision']['precision']}), target tokens/s:", flush=True)
        for variant, row in figures["variants"].items():
            print(
                f"  {variant:20s} {row['median_tokens_per_s']:8,.0f}  {row['on_over_off']:5.2f}x"
                f"  calls {row['calls']:5d}  first loss {row['first_loss']:.6f}",
                flush=True,
            )
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
