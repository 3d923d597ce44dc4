"""What each of search's speed paths earns: the whole search of a file, each path turned off
alone, paired with everything on.

A speed path keeps its lines where the whole command is measurably faster with it. This
decodes every line of ``--input`` (default: the model's test split) with a trained model in
fp32 on the CPU, as ``nmt translate`` does (its batches, workers and shortlist), once with
every path on and once with each path below off, alternated round by round (a warm-up round
first, whose translations are compared with everything on's), and prints each median, its
ratio to everything on, and whether the translations were the same:

    python scripts/ablate_search.py --model runs/demo --beams 1,5 --rounds 3 --json ablate.json

A path is turned off by replacing, for its runs alone, the function or table through which
it runs with the plain path's (each replacement counts its calls: a path a model never
reaches shows 0). Paths:

- ``packed``: products by fixed weights from oneDNN's prepared layout (``fast.packed``);
- ``attend_kernel``: a dot-product score's whole attention step in one compiled kernel;
- ``top_k_kernel``: the compiled top-k and row maximum (``fast.topk``);
- ``log_softmax_kernel``: the compiled log-softmax, in place;
- ``rnn_cell_kernel``: the decoder RNN's gates in one compiled call per layer;
- ``decoder_gate_table``: the decoder's first-layer input gates looked up (``StepTables.gates``);
- ``encoder_gate_table``: the encoder's, looked up (``StepTables.source``);
- ``luong_fold``: W_c's context half multiplied into the memory once per batch
  (``LuongDecoder.for_search``);
- ``workers``: two batches decoded side by side (``decoding.workers``);
- ``shortlist``: the lexical shortlist (``decoding.shortlist``: it may change a translation).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nmt.decoding import translator as translator_module  # noqa: E402
from nmt.decoding.translator import Translator  # noqa: E402
from nmt.fast import attend, compiled, packed  # noqa: E402
from nmt.model import decoder, luong  # noqa: E402

Switch = Callable[[Translator, dict[str, int]], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def swapped(
    owner: Any, name: str, plain: Callable[..., Any], calls: dict[str, int]
) -> Iterator[None]:
    """``owner.name`` replaced by ``plain``, counting its calls under ``calls["calls"]``."""
    original = getattr(owner, name)  # a path renamed away fails here, loudly

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["calls"] += 1
        return plain(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


def replaced(owner: Any, name: str, plain: Callable[..., Any]) -> Switch:
    return lambda _translator, calls: swapped(owner, name, plain, calls)


def without_table(field: str) -> Switch:
    """A Translator whose members' ``StepTables`` lack ``field``."""

    @contextlib.contextmanager
    def off(translator: Translator, calls: dict[str, int]) -> Iterator[None]:
        tables = translator._step_tables()
        calls["calls"] += sum(getattr(table, field) is not None for table in tables)
        translator._tables = [dataclasses.replace(t, **{field: None}) for t in tables]
        try:
            yield
        finally:
            translator._tables = tables

    return off


def _nothing(
    translator: Translator, calls: dict[str, int]
) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


PATHS: dict[str, Switch] = {
    "packed": replaced(packed, "available", lambda: False),
    "attend_kernel": replaced(attend.KernelProducts, "attend", lambda self, *args: None),
    "top_k_kernel": replaced(compiled, "top_k", lambda values, k: None),
    "log_softmax_kernel": replaced(compiled, "log_softmax_", lambda logits, allowed: False),
    "rnn_cell_kernel": replaced(compiled, "rnn_cell", lambda *tensors: None),
    "decoder_gate_table": without_table("gates"),
    "encoder_gate_table": without_table("source"),
    "luong_fold": replaced(luong.LuongDecoder, "for_search", decoder.Decoder.for_search),
    "workers": replaced(translator_module, "worker_count", lambda *args: 1),
    "shortlist": replaced(translator_module, "shortlist_used", lambda *args: False),
}


def source_lines(base: Translator, given: Path | None) -> list[str]:
    """``given``'s lines, else the model's test split's source side."""
    if given is None:
        config = base.config
        assert config.data.test is not None, "the model's config names no test split: --input"
        prefix = Path(config.data.test)
        plain = prefix.with_name(f"{prefix.name}.{config.data.src_lang}")
        given = plain if plain.exists() else plain.with_name(plain.name + ".gz")
    opener = gzip.open if given.suffix == ".gz" else open
    with opener(given, "rt", encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in lines]


def ablate(
    base: Translator, lines: list[str], beams: list[int], rounds: int, paths: list[str]
) -> dict[str, Any]:
    """Every figure: per beam, per path (``everything_on`` first), each round's seconds, the
    median, its ratio to everything on's, the replaced path's calls and whether the
    translations were everything on's."""
    variants = ["everything_on", *paths]
    report: dict[str, Any] = {"sentences": len(lines), "beams": {}}
    for beam in beams:
        decoding = base.config.decoding.model_copy(update={"beam_size": beam})
        translators = {
            name: Translator(
                base.models,
                base.tokenizer,
                base.config,
                base.device,
                "fp32",
                None,
                None,
                base.shortlists,
            )
            for name in variants
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        calls = {name: {"calls": 0} for name in variants}
        texts: dict[str, list[str]] = {}
        for round_ in range(rounds + 1):
            for name in variants:
                translator = translators[name]
                switch = PATHS.get(name, _nothing)
                with switch(translator, calls[name]):
                    start = time.perf_counter()
                    out = translator.translate(lines, decoding)
                    elapsed = time.perf_counter() - start
                if round_ == 0:
                    texts[name] = [translator.best_text(t) for t in out]
                else:
                    seconds[name].append(elapsed)
        on = statistics.median(seconds["everything_on"])
        plan = translators["everything_on"].last_plan
        report["beams"][str(beam)] = {
            "plan": plan.line() if plan is not None else None,
            "paths": {
                name: {
                    "seconds": seconds[name],
                    "median_s": statistics.median(seconds[name]),
                    "off_over_on": statistics.median(seconds[name]) / on,
                    "calls": calls[name]["calls"],
                    "same_translations": texts[name] == texts["everything_on"],
                }
                for name in variants
            },
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a run directory or checkpoint")
    parser.add_argument("--input", type=Path, help="source lines (default: the test split)")
    parser.add_argument("--beams", default="1,5", help="beam sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--paths", default=",".join(PATHS), help="the paths to turn off")
    parser.add_argument("--lines", type=int, help="the first this many lines alone")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    base = Translator.from_checkpoint(args.model, "cpu", "fp32")
    lines = source_lines(base, args.input)[: args.lines]
    beams = [int(b) for b in args.beams.split(",")]
    report = ablate(base, lines, beams, max(1, args.rounds), paths)
    report.update(model=str(args.model), threads=torch.get_num_threads())
    for beam, figures in report["beams"].items():
        print(f"beam {beam}, {report['sentences']} sentences; {figures['plan']}")
        for name, row in figures["paths"].items():
            print(
                f"  {name:20s} {row['median_s']:7.2f} s  {row['off_over_on']:5.2f}x  "
                f"calls {row['calls']:6d}  same translations: {row['same_translations']}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
