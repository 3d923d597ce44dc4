"""Where a training step's time goes: a few steps of one bench configuration under
``torch.profiler``, after warm-up steps (and, with CUDA graphs, after every shape the profiled
steps meet was captured).

Prints the wall clock per step, the device's busy time per step (the sum of its kernels'
times on a GPU, whose gaps are launches and host work the GPU waits on), and the operations
that take the most host time and the most device time; ``--json`` writes the same figures.

    .venv/bin/python scripts/profile_step.py --device cuda --config bahdanau
    .venv/bin/python scripts/profile_step.py --device cuda --config bahdanau \\
        --override training.cuda_graphs=false --json runs/profile-eager.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402

from nmt.runtime import choose_device, seed_everything  # noqa: E402
from nmt.training.process import setup_process  # noqa: E402
from nmt.training.run import allocate_model  # noqa: E402

TOP = 12  # operations listed per table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--config", default="bahdanau", choices=sorted(bench.CONFIGS))
    add("--device", default="auto", choices=("auto", "cpu", "cuda"))
    add("--precision", default="auto")
    add("--steps", type=int, default=5, help="profiled steps (5)")
    add("--warmup", type=int, default=3, help="unprofiled steps first (3)")
    add("--work-dir", default="runs/bench")
    add("--data", default="data/bible")
    add("--tiny", action="store_true", help="the bench's tiny sizes (for tests)")
    add("--large", action="store_true", help="the bench's large sizes")
    add("--override", action="append", default=[], help="config override (repeatable)")
    add("--json", help="write the figures here")
    return parser.parse_args(argv)


def bench_options(args: argparse.Namespace) -> Any:
    """The bench's options for one configuration at these sizes."""
    argv = ["--device", args.device, "--precision", args.precision, "--configs", args.config]
    argv += ["--work-dir", args.work_dir, "--data", args.data]
    argv += ["--tiny"] * args.tiny + ["--large"] * args.large
    for override in args.override:
        argv += ["--override", override]
    return bench.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    options = bench_options(args)
    config = bench.bench_config(args.config, options)
    device = choose_device(config.run.device)
    corpora, tokenizer = bench.load_data(config, Path(args.work_dir))
    decided, options = bench.resolve_precision(
        options, args.config, device, tokenizer.trg_vocab_size
    )  # as nmt train decides training.precision: auto
    config = bench.bench_config(args.config, options)
    setup_process(config, restart=False)
    corpus = corpora.train
    seed_everything(bench.SEED)
    model = allocate_model(config, tokenizer, device).train()
    step, _ = bench.make_step(config, model, corpus, device)
    shaped = model.graphs is not None
    total = args.warmup + args.steps
    batches = bench.training_batches(corpus, config.training.batch_tokens, total, shaped)
    for indices in batches[: args.warmup]:
        step(indices)
    captures = bench.capture_shapes(
        model, step, batches[args.warmup :], corpus, config.training.batch_tokens
    )
    bench.synchronize(device)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        tokens = sum(step(indices)[1] for indices in batches[args.warmup :])
        bench.synchronize(device)
    seconds = time.perf_counter() - started
    events = prof.key_averages()
    device_key = "self_device_time_total"
    device_us = sum(getattr(e, device_key, 0) for e in events)
    result = {
        "config": args.config,
        "device": str(device),
        "precision": config.training.precision,
        "cuda_graphs": captures is not None,
        "steps": args.steps,
        "target_tokens": tokens,
        "target_tokens_per_s": tokens / seconds,
        "wall_ms_per_step": 1000 * seconds / args.steps,
        "device_busy_ms_per_step": device_us / 1000 / args.steps if device.type == "cuda" else None,
        "top_host": _top(events, "self_cpu_time_total", args.steps),
        "top_device": _top(events, device_key, args.steps) if device.type == "cuda" else [],
    }
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def _top(events: Any, key: str, steps: int) -> list[dict[str, Any]]:
    ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:TOP]
    return [
        {"name": e.key, "ms_per_step": getattr(e, key, 0) / 1000 / steps, "calls": e.count / steps}
        for e in ranked
    ]


def _print(result: dict[str, Any]) -> None:
    busy = result["device_busy_ms_per_step"]
    print(
        f"{result['config']} on {result['device']} ({result['precision']}, CUDA graphs "
        f"{'on' if result['cuda_graphs'] else 'off'}): {result['wall_ms_per_step']:.1f} ms a "
        f"step, {result['target_tokens_per_s']:,.0f} target tokens/s"
        + (f"; the device busy {busy:.1f} ms a step" if busy is not None else "")
    )
    for title, rows in (("host", result["top_host"]), ("device", result["top_device"])):
        if rows:
            print(f"most {title} time (ms a step, calls a step):")
        for row in rows:
            print(f"  {row['ms_per_step']:8.2f} {row['calls']:8.1f}  {row['name']}")


if __name__ == "__main__":
    main()
