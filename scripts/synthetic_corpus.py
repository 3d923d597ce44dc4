#!/usr/bin/env python3
"""Write a synthetic parallel corpus of any size with the length statistics of a real one,
for measuring how nmt's data path scales (docs/benchmarks.md); not a translation task.

    python scripts/synthetic_corpus.py --pairs 4500000 --out runs/synthetic
    make synthetic PAIRS=4500000

writes ``train.{src,trg}`` (``--pairs`` lines) and ``dev.{src,trg}`` (``--dev`` lines) with
the default language codes en and de, as WMT14 en-de would be laid out for nmt:

- sentence lengths in words follow WMT14 en-de's training side: log-normal with a median of
  20 words (mean about 23), a tail to ``--max-words``, and a few one-word lines;
- the target has 0.95 times the source's words, +-12%, as German to English does;
- words are drawn from a Zipf distribution (exponent 1.07) over ``--vocab`` pseudo-words of
  two to four syllables per language, so the tokenizer meets a realistic long tail. The
  target is a word-for-word mapping of the source with local reordering, dropped and
  inserted words (a model can learn it, a little).

The corpus depends only on the arguments (numpy's seeded generator), and is written in
blocks: memory stays flat whatever ``--pairs`` is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ei", "au")]
BLOCK = 100_000  # pairs generated and written at a time


def pseudo_words(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct words of 2-4 syllables."""
    words: dict[str, None] = {}
    while len(words) < count:
        sizes = rng.integers(2, 5, count)
        picks = rng.integers(0, len(SYLLABLES), (count, 4))
        for size, row in zip(sizes, picks, strict=True):
            words.setdefault("".join(SYLLABLES[i] for i in row[:size]))
            if len(words) == count:
                break
    return np.array(list(words), dtype=object)


def zipf_cdf(vocab: int, exponent: float = 1.07) -> np.ndarray:
    weights = 1.0 / np.arange(1, vocab + 1) ** exponent
    return np.cumsum(weights / weights.sum())


def source_lengths(count: int, max_words: int, rng: np.random.Generator) -> np.ndarray:
    lengths = np.rint(rng.lognormal(np.log(20.0), 0.55, count)).astype(np.int64)
    lengths[rng.random(count) < 0.01] = 1  # headings, list items
    return np.clip(lengths, 1, max_words)


def _target(ids: np.ndarray, length: int, rng: np.random.Generator, vocab: int) -> np.ndarray:
    """The source's words mapped, locally reordered, cut or padded to ``length``."""
    out = ids.copy()
    if len(out) > 2:
        swaps = np.flatnonzero(rng.random(len(out) - 1) < 0.15)
        for i in swaps:
            out[i], out[i + 1] = out[i + 1], out[i]
    if length < len(out):
        keep = np.sort(rng.choice(len(out), length, replace=False))
        return out[keep]
    extra = rng.integers(0, min(vocab, 200), length - len(out))  # frequent function words
    return np.insert(out, rng.integers(0, len(out) + 1, len(extra)), extra)


class Languages:
    """The two pseudo-vocabularies and the word-for-word mapping between them."""

    def __init__(self, vocab: int, rng: np.random.Generator):
        self.vocab = vocab
        self.src, self.trg = pseudo_words(vocab, rng), pseudo_words(vocab, rng)
        self.mapping = rng.permutation(vocab)
        self.cdf = zipf_cdf(vocab)


def write_split(
    prefix: Path, pairs: int, args: argparse.Namespace, words: Languages, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    vocab, cdf, mapping = words.vocab, words.cdf, words.mapping
    src_words, trg_words = words.src, words.trg
    with (
        prefix.with_suffix(f".{args.src}").open("w", encoding="utf-8") as src_file,
        prefix.with_suffix(f".{args.trg}").open("w", encoding="utf-8") as trg_file,
    ):
        for start in range(0, pairs, BLOCK):
            count = min(BLOCK, pairs - start)
            lengths = source_lengths(count, args.max_words, rng)
            ratio = np.clip(rng.normal(0.95, 0.12, count), 0.3, 3.0)
            trg_lengths = np.clip(np.rint(lengths * ratio), 1, args.max_words).astype(np.int64)
            ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), vocab - 1)
            ends = np.cumsum(lengths)
            src_lines, trg_lines = [], []
            for end, length, trg_length in zip(ends, lengths, trg_lengths, strict=True):
                sentence = ids[end - length : end]
                src_lines.append(" ".join(src_words[sentence]))
                target = _target(mapping[sentence], int(trg_length), rng, vocab)
                trg_lines.append(" ".join(trg_words[target]))
            src_file.write("\n".join(src_lines) + "\n")
            trg_file.write("\n".join(trg_lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, required=True, help="training pairs")
    parser.add_argument("--dev", type=int, default=3000, help="dev pairs (default 3000)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--src", default="en", help="source language code (file suffix)")
    parser.add_argument("--trg", default="de", help="target language code (file suffix)")
    parser.add_argument("--vocab", type=int, default=200_000, help="words per language")
    parser.add_argument("--max-words", type=int, default=250, help="longest sentence")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.dev < 1 or args.vocab < 200 or args.max_words < 1:
        parser.error("--pairs and --dev must be at least 1, --vocab at least 200")
    args.out.mkdir(parents=True, exist_ok=True)
    words = Languages(args.vocab, np.random.default_rng(args.seed))
    write_split(args.out / "train", args.pairs, args, words, args.seed + 1)
    write_split(args.out / "dev", args.dev, args, words, args.seed + 2)
    print(f"{args.out}: {args.pairs:,} training and {args.dev:,} dev pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
