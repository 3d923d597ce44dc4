"""The tiny synthetic corpus the CLI, training and distributed tests train on.

A 'translation' that reverses the word order and upper-cases every word: learnable to
near-perfect accuracy by a tiny model in seconds, with a vocabulary of a dozen words.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = "sol luna mar rio casa perro gato libro agua fuego tierra aire".split()


def translate(words: list[str]) -> str:
    return " ".join(w.upper() for w in reversed(words))


def write_corpus(root: Path, sizes: dict[str, int], seed: int = 7) -> Path:
    """Write {split}.src / {split}.trg under ``root`` for each split in ``sizes``."""
    rng = random.Random(seed)
    for split, size in sizes.items():
        src, trg = [], []
        for _ in range(size):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
            src.append(" ".join(words))
            trg.append(translate(words))
        (root / f"{split}.src").write_text("\n".join(src) + "\n", encoding="utf-8")
        (root / f"{split}.trg").write_text("\n".join(trg) + "\n", encoding="utf-8")
    return root


def data_section(root: Path, test: bool = False) -> dict[str, object]:
    """The config's `data` section for a corpus written by `write_corpus`."""
    return {
        "src_lang": "src",
        "trg_lang": "trg",
        "train": str(root / "train"),
        "dev": str(root / "dev"),
        "test": str(root / "test") if test else None,
    }


def luong_model_section(
    size: int = 16, dropout: float = 0.1, score: str = "general", input_feeding: bool = True
) -> dict[str, object]:
    """The config's `model` section of the tiny Luong model the training tests train; without
    input feeding its decoder runs over all steps at once, 2.5x faster than step by step."""
    decoder = {"style": "luong", "hidden_size": size, "dropout": dropout}
    return {
        "embedding_size": size,
        "embedding_dropout": dropout,
        "encoder": {"hidden_size": size, "dropout": dropout},
        "decoder": decoder if input_feeding else {**decoder, "input_feeding": False},
        "attention": {"score": score},
    }


ALIGNED_WORDS = [*WORDS, "el", "y"]  # with two Spanish function words


def write_aligned_corpus(root: Path, sizes: dict[str, int], seed: int = 5) -> Path:
    """The reversal task as {split}.es / {split}.en, with a reference alignment
    {split}.align for every split but train: source word k links to target word n-1-k,
    sure, but possible where the source word is "el"; pair 3 of each has no reference line.
    The Spanish function words "el" and "y" give the content-word figures something to
    leave out."""
    rng = random.Random(seed)
    for split, size in sizes.items():
        src, trg, gold = [], [], []
        for index in range(size):
            words = [rng.choice(ALIGNED_WORDS) for _ in range(rng.randint(2, 6))]
            src.append(" ".join(words))
            trg.append(translate(words))
            n = len(words)
            links = [f"{k}{'?' if w == 'el' else '-'}{n - 1 - k}" for k, w in enumerate(words)]
            gold.append("" if index == 3 else " ".join(links))
        (root / f"{split}.es").write_text("".join(s + "\n" for s in src), encoding="utf-8")
        (root / f"{split}.en").write_text("".join(t + "\n" for t in trg), encoding="utf-8")
        if split != "train":
            (root / f"{split}.align").write_text("".join(g + "\n" for g in gold), "utf-8")
    return root


def aligned_config(root: Path) -> dict:
    """A config of a tiny Luong model for a corpus written by ``write_aligned_corpus``:
    20 fp32 updates on the CPU, validating every 10."""
    return {
        "data": {
            "src_lang": "es",
            "trg_lang": "en",
            "train": str(root / "train"),
            "dev": str(root / "dev"),
            "test": str(root / "test"),
        },
        "tokenizer": {"vocab_size": 44, "type": "bpe"},
        "model": luong_model_section(),
        "training": {
            "epochs": 5,
            "max_steps": 20,
            "batch_tokens": 400,
            "validate_every": 10,
            "precision": "fp32",
        },
        "decoding": {"max_len_ratio": 1.5, "max_len_offset": 5},
        "run": {"dir": str(root / "run"), "device": "cpu", "tensorboard": False},
    }
