#!/usr/bin/env python3
"""Which attention aligns best: every score function with both decoders, each trained with the
demo config, scored for translation (test BLEU, chrF, beam 5) and for alignment (test AER
against the shipped reference, all words and content words, `nmt align --extract argmax`,
and content words with `--extract intersect` and `--extract gdfa`).

Each row is one `nmt train` of a base config (default configs/demo.yaml) with the row's
decoder and score overridden, then `nmt eval --split test`, `nmt align` and `nmt eval
--align` on the test split. Every row trains for the same number of updates (``--steps``,
default 2,000: what the demo config makes of its 17 minutes on a 2-core CPU, with its
learning rate held for 80% of them and then decayed to 0), not for the demo's 17 minutes:
the table fills up over several sittings, and a CPU's speed varies from one to the next
(the demo made 3,503 updates in 17 minutes on one 2-core machine and 996 on another), so
a clock budget would compare machines, not attention. ``--steps 0`` keeps the config's
clock budget::

    .venv/bin/python scripts/attention_table.py                     # every row not yet run
    .venv/bin/python scripts/attention_table.py --rows luong:dot bahdanau:additive
    .venv/bin/python scripts/attention_table.py --table             # the table of those run

A row's results go to ``{out}/{decoder}-{score}/result.json``; rows with one are skipped, so
the table fills up over several sittings. Each row records its wall clock and the machine
it ran on; rows run one at a time.

Decoders: ``luong`` is the base config's post-step decoder (the demo's: no input feeding),
``bahdanau`` the pre-step one (Bahdanau et al. 2015). Scores whose query and key must be the
same size (dot, scaled_dot, cosine) get a 128-unit encoder per direction, so that its
256-wide annotations match the 256-wide decoder state the tied embeddings need; the table
marks those rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nmt.config import load
from nmt.data.textfiles import existing
from nmt.errors import NMTError

ROOT = Path(__file__).resolve().parent.parent

DECODERS = ("luong", "bahdanau")
SCORES = (
    "additive",
    "general",
    "dot",
    "scaled_dot",
    "cosine",
    "location",
    "multihead",
    "local-m",
    "local-p",
)
SAME_SIZE = ("dot", "scaled_dot", "cosine")  # query and key of one size
ROWS = [f"{decoder}:{score}" for decoder in DECODERS for score in SCORES]


def row_overrides(row: str, key_size: int) -> list[str]:
    """The -O overrides of one row (``decoder:score``); ``key_size``: the decoder state
    size, which a same-size score needs from the bidirectional encoder."""
    decoder, score = row.split(":")
    overrides = [f"model.decoder.style={decoder}", f"model.attention.score={score}"]
    if score in SAME_SIZE:
        overrides.append(f"model.encoder.hidden_size={key_size // 2}")
    return overrides


def budget_overrides(steps: int) -> list[str]:
    """The overrides of a budget of ``steps`` updates (0: the config's own budget)."""
    if steps == 0:
        return []
    return [f"training.max_steps={steps}", "training.max_minutes=null"]


def machine(run: Path) -> str:
    """The machine a row trained on, as its run's environment.json names it: the GPU (with
    torch's version), or the CPU and its cores."""
    environment = json.loads((run / "environment.json").read_text())
    if environment["device"].startswith("cuda"):
        return f"{environment['device_name']}, torch {environment['torch_version']}"
    return f"{environment['device_name']}, {len(_cores())} cores"


def _cores() -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def _nmt(*args: str) -> str:
    """Run ``python -m nmt ARGS``; its stdout, or exit with its one-line error."""
    result = subprocess.run(
        [sys.executable, "-m", "nmt", *args], capture_output=True, text=True, check=False
    )
    if result.returncode:
        lines = result.stderr.strip().splitlines() or [f"exit status {result.returncode}"]
        sys.exit(f"nmt {args[0]}: {lines[-1]}")
    return result.stdout


def _training_figures(run: Path) -> dict[str, Any]:
    """Updates, and the best dev BLEU (greedy), from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    dev = [r["bleu"] for r in records if r["split"] == "dev"]
    return {"updates": max(steps, default=0), "best_dev_bleu": max(dev, default=0.0)}


def run_row(
    row: str, config: Path, out: Path, gold: Path, extra: list[str], steps: int = 0
) -> dict[str, Any]:
    """Train, translate and align one row; its figures, also written to result.json."""
    cfg = load(config)
    data = cfg.data
    if data.test is None:
        sys.exit(f"{config}: data.test is not set; the table scores the test split")
    src = existing(Path(f"{data.test}.{data.src_lang}"), "data.test")
    trg = existing(Path(f"{data.test}.{data.trg_lang}"), "data.test")
    directory = out / row.replace(":", "-")
    run = directory / "run"
    key_size = cfg.model.decoder.hidden_size
    overrides = [*row_overrides(row, key_size), *budget_overrides(steps), *extra]
    same_size = row.split(":")[1] in SAME_SIZE
    encoder = key_size // 2 if same_size else cfg.model.encoder.hidden_size
    started = time.time()
    _nmt("train", str(config), "--run-dir", str(run), "--quiet", *(f"-O{o}" for o in overrides))
    minutes = (time.time() - started) / 60
    scores = json.loads(
        _nmt("eval", "--model", str(run), "--split", "test", "--beam", "5", "--json")
    )
    aligned, intersected, grown = (
        _aligned(run, directory / name, method, src, trg, gold)
        for name, method in (
            ("test.align", "argmax"),
            ("test.intersect.align", "intersect"),
            ("test.gdfa.align", "gdfa"),
        )
    )
    system = scores["systems"][0]
    result = {
        "row": row,
        "overrides": overrides,
        "config": _shown(config),
        "encoder_hidden": encoder,
        "minutes": round(minutes, 2),
        "machine": machine(run),
        **_training_figures(run),
        "test_bleu": system["bleu"],
        "test_chrf": system["chrf"],
        "bleu_signature": scores["signatures"]["bleu"],
        "aer": 100 * aligned["aer"],
        "content_precision": 100 * aligned["content_words"]["precision"],
        "content_recall": 100 * aligned["content_words"]["recall"],
        "content_aer": 100 * aligned["content_words"]["aer"],
        "content_aer_intersect": 100 * intersected["content_words"]["aer"],
        "content_aer_gdfa": 100 * grown["content_words"]["aer"],
    }
    (directory / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _shown(path: Path) -> str:
    """A path as the table records it: relative to the project where it lies inside."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def _aligned(run: Path, links: Path, method: str, src: Path, trg: Path, gold: Path) -> Any:
    """`nmt align --extract METHOD` of the test split, scored: `nmt eval --align --json`."""
    _nmt("align", "--model", str(run), "-i", str(src), "-t", str(trg), "-o", str(links),
         "--extract", method)  # fmt: skip
    return json.loads(
        _nmt(
            "eval",
            "--align",
            str(links),
            "--align-ref",
            str(gold),
            "--align-src",
            str(src),
            "--align-trg",
            str(trg),
            "--json",
        )  # fmt: skip
    )


def _short(machine: str) -> str:
    """A machine as the table names it: ``NVIDIA H200``, ``Intel Xeon, 2 cores``."""
    name, _, rest = machine.partition(",")
    name = " ".join(w for w in name.replace("(R)", "").split() if w != "Processor")
    return f"{name},{rest}" if rest.strip().endswith("cores") else name


def table(out: Path) -> str:
    """The Markdown table of the rows run so far, in ROWS order."""
    lines = [
        "| decoder | score | updates | machine | minutes | test BLEU | chrF | content-word P | R "
        "| AER | AER, intersect | AER, gdfa | all-word AER |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in ROWS:
        path = out / row.replace(":", "-") / "result.json"
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        decoder, score = row.split(":")
        note = f" (encoder 2x{r['encoder_hidden']})" if score in SAME_SIZE else ""
        lines.append(
            f"| {decoder} | {score}{note} | {r['updates']:,} | {_short(r['machine'])} | "
            f"{r['minutes']:.0f} | "
            f"{r['test_bleu']:.2f} | "
            f"{r['test_chrf']:.1f} | {r['content_precision']:.1f} | {r['content_recall']:.1f} | "
            f"{r['content_aer']:.1f} | {r['content_aer_intersect']:.1f} | "
            f"{r['content_aer_gdfa']:.1f} | {r['aer']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs") / "attention_table")
    parser.add_argument("--gold", type=Path, default=None, help="default: {data.test}.align.gz")
    parser.add_argument("--rows", nargs="+", default=None, help=f"of: {' '.join(ROWS)}")
    parser.add_argument(
        "--steps", type=int, default=2000, help="updates per row (0: the config's budget)"
    )
    parser.add_argument("--table", action="store_true", help="print the table and stop")
    parser.add_argument("-O", "--override", action="append", default=[], help="for every row")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.out))
        return 0
    rows = args.rows or ROWS
    if args.steps < 0:
        parser.error(f"--steps {args.steps}: expected 0 (the config's budget) or more")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {' '.join(unknown)}; expected decoder:score of {ROWS}")
    try:
        cfg = load(args.config)
        gold = args.gold or existing(Path(f"{cfg.data.test}.align"), "--gold")
    except NMTError as exc:
        parser.error(str(exc))
    for row in rows:
        if (args.out / row.replace(":", "-") / "result.json").is_file():
            print(f"{row}: done earlier", file=sys.stderr)
            continue
        print(f"{row}: training", file=sys.stderr)
        result = run_row(row, args.config, args.out, gold, args.override, args.steps)
        print(
            f"{row}: {result['updates']} updates, test BLEU {result['test_bleu']:.2f}, "
            f"content-word AER {result['content_aer']:.1f}",
            file=sys.stderr,
        )
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
