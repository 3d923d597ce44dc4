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
    size: int = 16, dropout: float = 0.1, score: str = "general"
) -> dict[str, object]:
    """The config's `model` section of the tiny Luong model the training tests train."""
    return {
        "embedding_size": size,
        "embedding_dropout": dropout,
        "encoder": {"hidden_size": size, "dropout": dropout},
        "decoder": {"style": "luong", "hidden_size": size, "dropout": dropout},
        "attention": {"score": score},
    }
