#!/usr/bin/env python3
"""A statistical word alignment of a demo split, the baseline for attention as alignment:
eflomal (Östling & Tiedemann 2016; IBM1 + HMM + fertility, Gibbs sampling) in both
directions, symmetrised with grow-diag-final-and (Koehn et al. 2005), scored against the
shipped reference alignment by ``nmt eval --align``.

eflomal is an optional extra, never needed by nmt itself::

    .venv/bin/pip install -e '.[align]'
    .venv/bin/python scripts/eflomal_baseline.py --split test

eflomal learns from the training split together with the split it aligns (an aligner sees
the text it aligns; no reference links are used). Tokens are the whitespace tokens the
reference indexes, lower-cased and stripped of punctuation at both ends for eflomal only
(a token of punctuation alone stays as it is), so the links index the shipped lines.
Writes ``{out}/{split}.{fwd,rev,gdfa}.align`` and prints the scores of each, and
``{out}/train.{fwd,rev,gdfa}.align``, the training split's alignments, for
``training.guided_alignment`` (an alignment head learns best from ``rev``, the target-to-source
links: docs/alignment.md).
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from nmt.decoding.alignment import grow_diag_final_and

ROOT = Path(__file__).resolve().parent.parent
Link = tuple[int, int]


def normalise(line: str) -> str:
    """The line's tokens as eflomal sees them: same count, lower-cased, punctuation off."""
    out = []
    for token in line.split():
        bare = token.strip(".,;:!?¿¡()[]{}\"'“”‘’«»—–-").lower()
        out.append(bare or token)
    return " ".join(out)


def read_links(line: str) -> set[Link]:
    return {(int(i), int(j)) for i, _, j in (link.partition("-") for link in line.split())}


def pharaoh(links: Iterable[Link]) -> str:
    return " ".join(f"{i}-{j}" for i, j in sorted(links))


def lines_of(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()


def directions(forward: list[str], reverse: list[str]) -> dict[str, list[str]]:
    """eflomal's source-to-target (``fwd``) and target-to-source (``rev``) links, a line per
    pair, and their grow-diag-final-and (``gdfa``), as sorted Pharaoh lines."""
    pairs = [(read_links(f), read_links(r)) for f, r in zip(forward, reverse, strict=True)]
    return {
        "fwd": [pharaoh(f) for f, _ in pairs],
        "rev": [pharaoh(r) for _, r in pairs],
        "gdfa": [pharaoh(grow_diag_final_and(f, r)) for f, r in pairs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "bible")
    parser.add_argument("--split", default="test", choices=("dev", "test", "books"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "eflomal")
    parser.add_argument("--seed-iterations", type=float, default=1.0, help="eflomal --length")
    args = parser.parse_args(argv)
    try:
        import eflomal
    except ImportError:
        parser.error("eflomal is not installed: .venv/bin/pip install -e '.[align]'")
    train = [lines_of(args.data / f"train.{side}.gz") for side in ("es", "en")]
    split = [lines_of(args.data / f"{args.split}.{side}.gz") for side in ("es", "en")]
    src = [normalise(line) for line in train[0] + split[0]]
    trg = [normalise(line) for line in train[1] + split[1]]
    args.out.mkdir(parents=True, exist_ok=True)
    fwd, rev = args.out / "all.fwd", args.out / "all.rev"
    aligner = eflomal.Aligner(model=3, rel_iterations=args.seed_iterations)
    aligner.align(src, trg, links_filename_fwd=str(fwd), links_filename_rev=str(rev))
    first = len(train[0])
    all_forward = fwd.read_text(encoding="utf-8").splitlines()
    all_reverse = rev.read_text(encoding="utf-8").splitlines()
    for name, lines in directions(all_forward[:first], all_reverse[:first]).items():
        guide = args.out / f"train.{name}.align"
        guide.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"training split's {name} links (for training.guided_alignment): {guide}", flush=True)
    outputs = directions(all_forward[first:], all_reverse[first:])
    for name, lines in outputs.items():
        path = args.out / f"{args.split}.{name}.align"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"eflomal {name}:", flush=True)
        subprocess.run(
            [sys.executable, "-m", "nmt", "eval", "--align", str(path)]
            + ["--align-ref", str(args.data / f"{args.split}.align.gz")]
            + ["--align-src", str(args.data / f"{args.split}.es.gz")]
            + ["--align-trg", str(args.data / f"{args.split}.en.gz")],
            check=True,
            cwd=ROOT,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
