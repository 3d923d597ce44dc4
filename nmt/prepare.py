"""Before the first step: the run directory, its run info, the tokenizer and the corpora.

Under torchrun, rank 0 prepares first (it trains the tokenizer and fills the datasets cache
in the run directory); the other ranks then receive its tokenizer and read the same corpora,
mostly from that cache.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt import __version__, checkpoint, native
from nmt.config import Config, to_yaml
from nmt.data import TokenizedCorpus, drop_empty, drop_long, read_pairs, tokenize
from nmt.errors import ConfigError, DataError
from nmt.runtime import Distributed, broadcast_object, cpu_name
from nmt.tokenizer import Tokenizer, load_model_file, train_sentencepiece

log = logging.getLogger("nmt")


# ----------------------------------------------------------------------------- run directory


def prepare_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """Create the run dir; return the checkpoint to resume from (or None)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} exists and is a file; choose another --run-dir")
    last = run_dir / "last.pt"
    if last.is_file():
        if not resume:
            raise ConfigError(
                f"run.dir: {run_dir} already holds a training run; pass --resume to continue it "
                f"or --run-dir to start a new one"
            )
        return last
    if resume:
        log.info("no checkpoint in %s; starting a new run", run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_run_info(
    run_dir: Path, config: Config, device: torch.device, precision: str, world_size: int = 1
) -> None:
    """The resolved config (config.yaml) and what the run ran on (environment.json)."""
    checkpoint.atomic_write_text(run_dir / "config.yaml", to_yaml(config))
    info = {
        "nmt_version": __version__,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "precision": precision,
        "world_size": world_size,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # nmt.runtime.MALLOC_TUNABLES
        "native_kernels": native.status()
        if device.type == "cpu" and config.run.fast_kernels
        else None,
    }
    checkpoint.atomic_write_text(run_dir / "environment.json", json.dumps(info, indent=2) + "\n")


# ----------------------------------------------------------------------------- data


def build_tokenizer(config: Config, train_rows: Any) -> Tokenizer:
    cfg = config.tokenizer
    if cfg.model:
        proto = load_model_file(Path(cfg.model))
        return Tokenizer(proto, proto)
    args = (
        cfg.vocab_size,
        cfg.type,
        cfg.character_coverage,
        cfg.max_train_sentences,
        config.training.seed,
    )
    started = time.time()
    if cfg.joint:
        proto = train_sentencepiece([*train_rows["src"], *train_rows["trg"]], *args)
        tokenizer = Tokenizer(proto, proto)
    else:
        tokenizer = Tokenizer(
            train_sentencepiece(train_rows["src"], *args),
            train_sentencepiece(train_rows["trg"], *args),
        )
    log.info(
        "tokenizer: %s %s, vocab %d/%d, trained in %.1fs",
        cfg.type,
        "joint" if cfg.joint else "separate",
        tokenizer.src_vocab_size,
        tokenizer.trg_vocab_size,
        time.time() - started,
    )
    return tokenizer


@dataclass
class Corpora:
    train: TokenizedCorpus
    dev: TokenizedCorpus
    dev_src: list[str]
    dev_trg: list[str]
    dev_src_ids: list[list[int]]


def load_corpora(
    config: Config, run_dir: Path, tokenizer: Tokenizer | None
) -> tuple[Corpora, Tokenizer]:
    """Read, clean and tokenise train and dev; trains the tokenizer when none is given."""
    cache = run_dir / "cache"
    train_rows, empty = drop_empty(read_pairs(config.data, config.data.train, cache))
    if empty:
        log.info("train: dropped %d pairs with an empty side", empty)
    if len(train_rows) == 0:
        raise DataError(
            f"data.train: {config.data.train}: none of its {empty} pairs has text on both "
            f"sides; point data.train at the training corpus"
        )
    tokenizer = tokenizer or build_tokenizer(config, train_rows)
    train_ids, long = drop_long(tokenize(train_rows, tokenizer), config.data.max_length)
    if long:
        log.info(
            "train: dropped %d pairs longer than data.max_length=%d", long, config.data.max_length
        )
    if len(train_ids) == 0:
        raise DataError(
            f"data.max_length: all {long} training pairs are longer than "
            f"{config.data.max_length} pieces on a side; raise it "
            f"(e.g. --override data.max_length=200)"
        )
    dev_rows, dev_empty = drop_empty(read_pairs(config.data, config.data.dev, cache))
    if len(dev_rows) == 0:
        raise DataError(
            f"data.dev: {config.data.dev}: none of its {dev_empty} pairs has text on both "
            f"sides; point data.dev at the development corpus"
        )
    dev_ids = tokenize(dev_rows, tokenizer)
    limit = min(len(dev_rows), config.data.dev_max_sentences or len(dev_rows))
    dev_src, dev_trg = list(dev_rows["src"][:limit]), list(dev_rows["trg"][:limit])
    corpora = Corpora(
        train=TokenizedCorpus(train_ids),
        dev=TokenizedCorpus(dev_ids),
        dev_src=dev_src,
        dev_trg=dev_trg,
        dev_src_ids=[list(ids) for ids in dev_ids["src_ids"][:limit]],
    )
    log.info("data: %d training pairs, %d dev pairs", len(corpora.train), len(corpora.dev))
    return corpora, tokenizer


def load_corpora_in_turn(
    config: Config, run_dir: Path, tokenizer: Tokenizer | None, place: Distributed
) -> tuple[Corpora, Tokenizer]:
    """``load_corpora`` on rank 0 first; the others get its tokenizer, then read the data.

    Only rank 0 trains the tokenizer (and saves it to the run directory); broadcasting it
    also works when the nodes do not share a filesystem.
    """
    if not place.enabled:
        corpora, tokenizer = load_corpora(config, run_dir, tokenizer)
        tokenizer.save(run_dir)
        return corpora, tokenizer
    if place.is_main:
        corpora, tokenizer = load_corpora(config, run_dir, tokenizer)
        tokenizer.save(run_dir)
    state = broadcast_object(tokenizer.state_dict() if place.is_main and tokenizer else None)
    if not place.is_main:
        tokenizer = Tokenizer.from_state_dict(state)
        corpora, tokenizer = load_corpora(config, run_dir, tokenizer)
    assert tokenizer is not None
    return corpora, tokenizer
