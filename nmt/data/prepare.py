"""Before the first step: the tokenizer (trained on the training split unless one is given)
and the cleaned, tokenised training and dev corpora."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nmt.data.corpus import TokenizedCorpus, drop_empty, drop_long, read_pairs, tokenize
from nmt.data.tokenizer import Tokenizer, load_model_file, train_sentencepiece
from nmt.errors import DataError

if TYPE_CHECKING:
    from nmt.config import Config

log = logging.getLogger("nmt")


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
