"""Running `nmt` as a user types it, for the tests of bad input: in this process through the
console entry point (``nmt``) or in a fresh interpreter (``nmt_process``), with a tiny corpus
and a tiny trained run."""

from __future__ import annotations

import contextlib
import io
import logging
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from nmt.cli import main

WORDS = "sol luna mar rio casa perro gato libro agua fuego tierra aire".split()


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def error(self) -> str:
        """The one stderr line of a failed command (asserts that there is exactly one)."""
        lines = self.err.strip().splitlines()
        assert self.code == 2, (self.code, self.err)
        assert len(lines) == 1, self.err
        assert lines[0].startswith("error: "), self.err
        return lines[0]


def nmt(*args: str, stdin: bytes = b"") -> Result:
    """Run ``nmt ARGS`` in this process through the console entry point."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdin
    sys.argv = ["nmt", *args]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv, sys.stdin = saved
        logger = logging.getLogger("nmt")
        for handler in list(logger.handlers):  # train's log handlers hold the run dir open
            logger.removeHandler(handler)
            handler.close()
    return Result(code, out.getvalue(), err.getvalue())


def nmt_process(*args: str, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "nmt", *args],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def write_pair(prefix: Path, src: list[str], trg: list[str], newline: str = "\n") -> None:
    for suffix, lines in (("src", src), ("trg", trg)):
        text = "".join(line + newline for line in lines)
        prefix.with_name(f"{prefix.name}.{suffix}").write_bytes(text.encode("utf-8"))


def reversal(size: int, seed: int) -> tuple[list[str], list[str]]:
    """A toy task: reverse the words and upper-case them."""
    rng = random.Random(seed)
    src, trg = [], []
    for _ in range(size):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        src.append(" ".join(words))
        trg.append(" ".join(w.upper() for w in reversed(words)))
    return src, trg


def tiny_config(root: Path, train: str = "train", **data: object) -> dict:
    return {
        "data": {
            "src_lang": "src",
            "trg_lang": "trg",
            "train": str(root / train),
            "dev": str(root / "dev"),
            "test": str(root / "test"),
            **data,
        },
        "tokenizer": {"vocab_size": 40, "type": "bpe"},
        "model": {
            "embedding_size": 8,
            "encoder": {"hidden_size": 8},
            "decoder": {"style": "luong", "hidden_size": 8},
            "attention": {"score": "general"},
        },
        "training": {"epochs": 1, "max_steps": 3, "batch_tokens": 400, "validate_every": 100},
        "decoding": {"max_len_ratio": 1.5, "max_len_offset": 5},
        # no tensorboard: no heatmap drawn at each validation (the tests that read it turn it on)
        "run": {"dir": str(root / "run"), "tensorboard": False},
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def write_corpus(root: Path) -> Path:
    for split, size, seed in (("train", 300, 1), ("dev", 12, 2), ("test", 10, 3)):
        write_pair(root / split, *reversal(size, seed))
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run, trained once per test process on the corpus of ``corpus``."""
    root = write_corpus(tmp_path_factory.mktemp("trained"))
    config = write_config(root / "config.yaml", tiny_config(root))
    result = nmt("train", str(config), "--quiet")
    assert result.code == 0, result.err
    return root / "run"


@pytest.fixture(scope="module")
def run(corpus: Path, trained_run: Path) -> Path:
    """A tiny trained run directory in this module's corpus folder (a few steps: only its
    files matter here): a copy of the one trained run, which a module may change freely."""
    shutil.copytree(trained_run, corpus / "run")
    write_config(corpus / "config.yaml", tiny_config(corpus))
    return corpus / "run"


@pytest.fixture()
def previous(tmp_path: Path) -> Path:
    """An existing output file that a failing command must leave as it was."""
    path = tmp_path / "out.txt"
    path.write_text("previous output\n", encoding="utf-8")
    return path


def unchanged(path: Path) -> bool:
    return path.read_text(encoding="utf-8") == "previous output\n"
