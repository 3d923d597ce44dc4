"""Whether a change to nmt's code changed what it computes: every config's translations, scores
and alignments, and the demo's first training updates, from two trees side by side.

A refactor that claims "no change in behaviour" runs this twice, once per tree, into one
folder, then compares:

    python scripts/same_outputs.py --out runs/same --label new --train        # models, then outputs
    PYTHONPATH=/path/to/old/tree python scripts/same_outputs.py --out runs/same --label old
    python scripts/same_outputs.py --out runs/same --compare old new

``--train`` trains every config of ``configs/`` briefly (``--updates`` updates in fp32, on
the demo corpus) into ``OUT/models/<config>``, and the demo config ``--demo-updates`` updates
into ``OUT/<label>/demo-train`` (its checkpoint's parameters are compared bit for bit). Without
``--train`` a label reuses the models and trains only its own demo run (none with
``--demo-updates 0``, for a label produced in parts with ``--configs``). Each label then
writes, per config, ``nmt translate`` (beam 5, with --scores and --alignments to a file), ``nmt score
--tokens`` and ``nmt align`` of the first ``--lines`` lines of the test split, in fp32.
``--compare`` lists every file that differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
NMT = [sys.executable, "-P", "-m", "nmt"]  # -P: PYTHONPATH picks the tree, not the cwd


def run(args: list[str], log: Path) -> None:
    """One nmt command; its stderr to log, stop on failure."""
    with log.open("a") as err:
        err.write("$ " + " ".join(args) + "\n")
        err.flush()
        done = subprocess.run(NMT + args, stderr=err, stdout=subprocess.DEVNULL, cwd=ROOT)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): nmt {' '.join(args)}; see {log}")


def first_lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line for _, line in zip(range(n), f, strict=False)]


def train(config: Path, run_dir: Path, updates: int, log: Path, every: int) -> None:
    overrides = [
        f"training.max_steps={updates}",
        "training.max_minutes=null",
        "training.precision=fp32",
        f"training.save_every={every}",
        f"training.validate_every={10 * updates}",
        "training.keep_last=1",
        "run.device=cpu",
    ]
    args = ["train", str(config), "--run-dir", str(run_dir), "--quiet"]
    run(args + [x for o in overrides for x in ("--override", o)], log)


def outputs(model: Path, src: Path, trg: Path, into: Path, log: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model), "--input", str(src)]
    fp32 = ["--precision", "fp32", "--device", "cpu"]
    run(
        ["translate", *common, *fp32, "--beam", "5", "--scores"]
        + ["--alignments", str(into / "links.txt"), "--output", str(into / "translate.txt")],
        log,
    )
    run(
        ["score", *common, "--target", str(trg), "--tokens", *fp32]
        + ["--output", str(into / "score.txt")],
        log,
    )
    run(["align", *common, "--target", str(trg), "--output", str(into / "align.txt")], log)


def produce(args: argparse.Namespace) -> None:
    out: Path = args.out
    label = out / args.label
    label.mkdir(parents=True, exist_ok=True)
    log = label / "log.txt"
    src, trg = out / "test.es", out / "test.en"
    if not src.exists():
        src.write_text("".join(first_lines(ROOT / "data/bible/test.es.gz", args.lines)))
        trg.write_text("".join(first_lines(ROOT / "data/bible/test.en.gz", args.lines)))
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    if args.configs:
        configs = [c for c in configs if c.stem in args.configs.split(",")]
    for config in configs:
        model = out / "models" / config.stem
        if args.train and not (model / "best.pt").exists():
            print(f"training {config.stem}", flush=True)
            train(config, model, args.updates, out / "models.log", args.updates)
        print(f"decoding {config.stem}", flush=True)
        outputs(model, src, trg, label / config.stem, log)
    if not args.demo_updates:
        return
    print(f"demo's first {args.demo_updates} updates", flush=True)
    train(
        ROOT / "configs/demo.yaml", label / "demo-train", args.demo_updates, log, args.demo_updates
    )


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=False)
    return checkpoint["model"]  # type: ignore[no-any-return]


def compare(out: Path, old: str, new: str) -> int:
    differ = []
    for path in sorted((out / old).rglob("*.txt")):
        if path.name == "log.txt":
            continue
        other = out / new / path.relative_to(out / old)
        if not other.exists() or other.read_bytes() != path.read_bytes():
            differ.append(str(path.relative_to(out / old)))
    a, b = parameters(out / old / "demo-train"), parameters(out / new / "demo-train")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    files = len(list((out / old).rglob("*.txt"))) - 1
    print(f"{files - len(differ)} of {files} output files byte-identical")
    print(f"demo's parameters after its updates: {'bit-identical' if same else 'DIFFERENT'}")
    for name in differ:
        print(f"differs: {name}")
    return 0 if same and not differ else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs/same")
    parser.add_argument("--label")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--configs", help="comma-separated config names (default: all)")
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument(
        "--demo-updates", type=int, default=100, help="0: no demo training run this time"
    )
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(args.out, *args.compare))
    if not args.label:
        parser.error("--label or --compare is needed")
    produce(args)


if __name__ == "__main__":
    main()
