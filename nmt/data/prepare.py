"""Before the first step: the tokenizer (trained on a bounded sample of the training split
unless one is given) and the training and dev splits, prepared once (``nmt.data.store``).

Preparation runs in stages (read, tokenizer, tokenise), each timed in the log and shown with
a progress bar on a terminal. Everything prepared lands in the store under
``data.cache_dir`` (default: the run's ``cache/``): a later run, a resumed run and every
other rank of a torchrun job find it there and start at once, once its checksums are
verified (the stage "verify", in the same log line, or in its own when nothing was prepared).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from nmt.data.corpus import read_pairs, source_files
from nmt.data.sampling import SAMPLER_VERSION
from nmt.data.stages import Stages, on_terminal
from nmt.data.store import (
    STORE_VERSION,
    Encode,
    Prepared,
    Sampling,
    Store,
    TokenizedCorpus,
    digest,
    file_identity,
    writing,
)
from nmt.data.store import prepare as prepare_split
from nmt.data.textfiles import existing, quiet_datasets, read_file
from nmt.data.tokenizer import Tokenizer, load_model_file, train_sentencepiece
from nmt.errors import DataError
from nmt.files import atomic_write_bytes

if TYPE_CHECKING:
    from nmt.config import Config, DataConfig

log = logging.getLogger("nmt")


@dataclass
class Corpora:
    train: TokenizedCorpus  # the deterministic segmentation
    dev: TokenizedCorpus
    dev_src: list[str]
    dev_trg: list[str]
    dev_src_ids: list[list[int]]
    dev_pairs: int = 0  # data.dev's pairs before empty ones are dropped (its lines)
    built: list[str] = field(default_factory=list)  # what this process prepared itself
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    sampler: EpochSampler | None = None  # subword regularisation (tokenizer.sampling_alpha)

    def for_epoch(self, epoch: int) -> TokenizedCorpus:
        """The training pairs of one epoch: sampled anew with subword regularisation, else
        the one deterministic segmentation."""
        return self.sampler.corpus(epoch) if self.sampler else self.train


class Source:
    """One split of the config's corpus: its identity for the store's keys, and its pairs,
    read at most once and only when something must be prepared from them."""

    def __init__(self, cfg: DataConfig, split: str, cache: Path, stages: Stages):
        self.cfg, self.split, self.cache, self.stages = cfg, split, cache, stages
        self._rows: Any = None

    def identity(self) -> Any:
        cfg = self.cfg
        fields = (cfg.src_lang, cfg.trg_lang, cfg.src_field, cfg.trg_field, cfg.utf8_errors)
        if cfg.format == "hub":
            hub = (cfg.hub_name, cfg.hub_config, cfg.hub_revision, self.split)
            return ("hub", fields, hub, self.rows()._fingerprint)
        return (cfg.format, fields, file_identity(source_files(cfg, self.split)))

    def rows(self) -> Any:
        if self._rows is None:
            files = source_files(self.cfg, self.split) if self.cfg.format != "hub" else []
            total = sum(path.stat().st_size for path in files if path.is_file())
            with self.stages.stage("read"), self.stages.bar(f"reading {self.split}", total) as bar:
                self._rows = read_pairs(self.cfg, self.split, self.cache, bar)
        return self._rows


class EpochSampler:
    """Subword regularisation (Kudo 2018; BPE-dropout, Provilkov et al. 2020): each epoch's
    training ids are sampled anew from the kept pairs' text, by the same parallel
    ``Dataset.map`` that prepares a split, once per epoch and not per step. An epoch's sample
    is a function of (training.seed, epoch, pair) alone, so a resumed run, or another rank,
    gets the same ids; the previous epoch's sample is removed when the next is prepared.
    ``data.max_length`` keeps the pairs it kept by the deterministic segmentation."""

    def __init__(
        self,
        config: Config,
        store: Store,
        source: Source,
        tokenizer: Tokenizer,
        train: Prepared,
        show: bool,
    ):
        self.config, self.store, self.source = config, store, source
        self.tokenizer, self.kept, self.show = tokenizer, train.row_ids, show
        self.pieces = float(train.src_lengths.mean() + train.trg_lengths.mean())
        kept = self.kept
        tok = config.tokenizer
        self.family = digest(
            source.identity(), kept.tobytes(), tok.sampling_alpha, tok.sampling_nbest
        )
        self.seconds: dict[int, float] = {}  # epoch -> seconds spent sampling it here

    def corpus(self, epoch: int) -> TokenizedCorpus:
        tok, seed = self.config.tokenizer, self.config.training.seed
        assert tok.sampling_alpha is not None
        base = int(digest("sampling", seed, epoch), 16) % 2**32
        sampling = Sampling(tok.sampling_alpha, tok.sampling_nbest, base)
        started = time.perf_counter()
        prepared, built = prepare_split(
            self.store,
            f"sampled{epoch}",
            {"family": self.family, "epoch": epoch, "sampler": SAMPLER_VERSION},
            lambda: self.source.rows().select(self.kept),
            Encode(self.tokenizer, None, keep_text=False, sampling=sampling),
            self.config.data.num_proc,
            self.show,
        )
        self.store.remove_family("sampled", self.family, keep=prepared.path)
        if built:
            self.seconds[epoch] = time.perf_counter() - started
            log.info(
                "epoch %d: subword segmentations sampled in %.1fs (%.2f pieces per pair, "
                "%.2f deterministic)",
                epoch + 1,
                self.seconds[epoch],
                float(prepared.src_lengths.mean() + prepared.trg_lengths.mean()),
                self.pieces,
            )
        return TokenizedCorpus(prepared)


SAMPLE_BLOCK = 64  # pairs read together when sampling a large split for the tokenizer


def sample_text(rows: Any, pairs: int, seed: int) -> tuple[list[str], list[str]]:
    """The text of at most ``pairs`` pairs with both sides non-empty: all of them in order
    when the split is that small, else a seeded random sample of blocks of 64 consecutive
    pairs. Blocks, not single pairs, so that the sample reads a few pages of the
    memory-mapped corpus per block instead of nearly every page;
    only the sample is held in memory."""
    if len(rows) > pairs:
        blocks = len(rows) // SAMPLE_BLOCK
        wanted = min(blocks, -(-pairs // SAMPLE_BLOCK))
        starts = np.sort(np.random.default_rng(seed).choice(blocks, wanted, replace=False))
        src, trg = [], []
        for start in starts.tolist():  # slices read only their pages (a take reads all)
            block = rows[start * SAMPLE_BLOCK : (start + 1) * SAMPLE_BLOCK]
            src.extend(block["src"])
            trg.extend(block["trg"])
        src, trg = src[:pairs], trg[:pairs]
    else:
        src, trg = rows["src"], rows["trg"]
    kept = [(s, t) for s, t in zip(src, trg, strict=True) if s.strip() and t.strip()]
    return [s for s, _ in kept], [t for _, t in kept]


def _train_tokenizer(config: Config, source: Source) -> Tokenizer:
    cfg = config.tokenizer
    rows = source.rows()
    limit = cfg.max_train_sentences
    src, trg = sample_text(rows, -(-limit // 2) if cfg.joint else limit, config.training.seed)
    if not src:
        raise DataError(
            f"data.train: {config.data.train}: none of the {len(rows)} pairs read has text on "
            f"both sides; point data.train at the training corpus"
        )
    args = (cfg.vocab_size, cfg.type, cfg.character_coverage, limit, config.training.seed)
    if cfg.joint:
        proto = train_sentencepiece([*src, *trg], *args)
        return Tokenizer(proto, proto)
    return Tokenizer(train_sentencepiece(src, *args), train_sentencepiece(trg, *args))


def build_tokenizer(config: Config, source: Source, store: Store, stages: Stages) -> Tokenizer:
    """tokenizer.model, or the one trained earlier on the same text with the same keys, or a
    new one (trained, then kept in the store)."""
    cfg = config.tokenizer
    if cfg.model:
        proto = load_model_file(Path(cfg.model))
        return Tokenizer(proto, proto)
    settings = cfg.model_dump(exclude={"model", "sampling_alpha", "sampling_nbest"})
    key = digest(STORE_VERSION, "tokenizer", source.identity(), settings, config.training.seed)
    found = store.find("tokenizer", key)
    if found is not None:
        path = store.entry("tokenizer", key)
        log.info("tokenizer: trained earlier on the same text, from %s", path)
        return Tokenizer((path / "src.model").read_bytes(), (path / "trg.model").read_bytes())
    with stages.stage("tokenizer"):
        tokenizer = _train_tokenizer(config, source)
    with store.building("tokenizer") as tmp:
        for name, proto in (("src.model", tokenizer.src_proto), ("trg.model", tokenizer.trg_proto)):
            with writing(tmp / name):
                atomic_write_bytes(tmp / name, functools.partial(_write, proto))
        manifest = {"files": ["src.model", "trg.model"], "settings": settings}
        store.publish(tmp, "tokenizer", key, manifest)
    log.info(
        "tokenizer: %s %s, vocab %d/%d, trained in %.1fs",
        cfg.type,
        "joint" if cfg.joint else "separate",
        tokenizer.src_vocab_size,
        tokenizer.trg_vocab_size,
        stages.seconds["tokenizer"],
    )
    return tokenizer


def with_links(source: Source, path: Path, cache: Path) -> Any:
    """The training pairs with a ``links`` column: the guided-alignment file, a line per
    pair (read like a corpus file: UTF-8, lines end at newline, a .gz beside it counts)."""
    rows = source.rows()
    lines = read_file(
        existing(path, "training.guided_alignment"), "text", ("", ""), "strict", cache
    )
    if len(lines) != len(rows):
        raise DataError(
            f"training.guided_alignment: {path} has {len(lines):,} lines but data.train "
            f"{source.split} has {len(rows):,} pairs; give the alignment of the training pairs, "
            f"a line per pair in their order"
        )
    datasets = quiet_datasets()
    return datasets.concatenate_datasets([rows, lines.rename_column("text", "links")], axis=1)


def _write(data: bytes, handle: BinaryIO) -> None:
    handle.write(data)


def _check_train(config: Config) -> Any:
    def check(counts: dict[str, int]) -> None:
        if counts["kept"]:
            return
        if not counts["long"]:
            raise DataError(
                f"data.train: {config.data.train}: none of its {counts['empty']} pairs has "
                f"text on both sides; point data.train at the training corpus"
            )
        raise DataError(
            f"data.max_length: all {counts['long']} training pairs are longer than "
            f"{config.data.max_length} pieces on a side; raise it "
            f"(e.g. --override data.max_length=200)"
        )

    return check


def _check_dev(config: Config) -> Any:
    def check(counts: dict[str, int]) -> None:
        if not counts["kept"]:
            raise DataError(
                f"data.dev: {config.data.dev}: none of its {counts['empty']} pairs has text "
                f"on both sides; point data.dev at the development corpus"
            )

    return check


def load_corpora(
    config: Config, run_dir: Path, tokenizer: Tokenizer | None
) -> tuple[Corpora, Tokenizer]:
    """The tokenizer and the prepared train and dev splits (prepared here if not yet)."""
    data = config.data
    store_dir = Path(data.cache_dir).expanduser() if data.cache_dir else run_dir / "cache"
    stages = Stages(on_terminal())
    store = Store(store_dir, stages)
    train_source = Source(data, data.train, store_dir, stages)
    tokenizer = tokenizer or build_tokenizer(config, train_source, store, stages)
    built = []
    prepared = {}
    guide = config.training.guided_alignment
    for name, source, max_length, check in (
        ("train", train_source, data.max_length, _check_train(config)),
        ("dev", Source(data, data.dev, store_dir, stages), None, _check_dev(config)),
    ):
        parts: dict[str, Any] = {"source": source.identity()}
        rows = source.rows
        if name == "train" and guide:
            parts["guide"] = file_identity([Path(guide)])
            rows = functools.partial(with_links, source, Path(guide), store_dir)
        encode = Encode(
            tokenizer,
            max_length,
            keep_text=name == "dev",
            guide=guide if name == "train" else None,
        )
        with stages.stage("tokenise"):
            prepared[name], new = prepare_split(
                store, name, parts, rows, encode, data.num_proc, stages.show, check
            )
        if new:
            built.append(name)
        else:
            log.info("%s: prepared earlier, from %s", name, prepared[name].path)
    train, dev = prepared["train"], prepared["dev"]
    _log_counts(config, train.counts)
    limit = min(len(dev.row_ids), data.dev_max_sentences or len(dev.row_ids))
    dev_src, dev_trg = dev.text(limit)
    corpora = Corpora(
        train=TokenizedCorpus(train),
        dev=TokenizedCorpus(dev),
        dev_src=dev_src,
        dev_trg=dev_trg,
        dev_src_ids=dev.src_ids(limit),
        dev_pairs=dev.counts["pairs"],
        built=built,
        stages=dict(stages.seconds),
    )
    if config.tokenizer.sampling_alpha is not None:
        corpora.sampler = EpochSampler(config, store, train_source, tokenizer, train, stages.show)
    log.info("data: %d training pairs, %d dev pairs", len(corpora.train), len(corpora.dev))
    if built:
        log.info("data: prepared in %s (%s)", stages.summary(), store_dir)
    elif "verify" in stages.seconds:
        log.info("data: found prepared, verify %.2fs (%s)", stages.seconds["verify"], store_dir)
    return corpora, tokenizer


def _log_counts(config: Config, counts: dict[str, int]) -> None:
    if counts["empty"]:
        log.info("train: dropped %d pairs with an empty side", counts["empty"])
    if counts["long"]:
        log.info(
            "train: dropped %d pairs longer than data.max_length=%d",
            counts["long"],
            config.data.max_length,
        )
