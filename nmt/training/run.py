"""A training run's assembly (``Run.build``): the model on its device in the precision chosen
for it, fresh, fine-tuned from ``training.init_from`` or restored from a checkpoint, with its
optimiser, schedule, progress and logs; and its checkpoints (``Run.save``)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nmt.config import Config
from nmt.data.prepare import Corpora
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.shortlist import Shortlist
from nmt.errors import CheckpointError, NMTError, WriteError
from nmt.fast import FastPaths
from nmt.fast.precision import Precision, choose_precision
from nmt.files import human_size
from nmt.model import Seq2Seq, build_model, count_parameters
from nmt.runtime import allow_tf32, seed_everything
from nmt.training.batches import Prefetch
from nmt.training.distributed import Distributed, all_reduce, broadcast_object, gather_objects
from nmt.training.finetune import Initial, freeze, load_initial_weights
from nmt.training.resume import read_checkpoint, restore, restore_rng, rng_state, save_checkpoints
from nmt.training.rundir import load_corpora_in_turn, write_run_info
from nmt.training.schedule import Progress, Schedule, peak_rate
from nmt.training.step import Clock, PendingStep, Updater
from nmt.training.tracking import Tracker
from nmt.training.validation import DevAlignment, load_dev_alignment

log = logging.getLogger("nmt")


@dataclass
class Window:
    """Training statistics since the last log line."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0
    started: float = field(default_factory=time.time)


@dataclass
class Pending:
    """An update queued and not yet read (training.deferred_reads): the step, its target
    tokens (all ranks') and its learning rate, for its bookkeeping once read."""

    step: PendingStep
    tokens: int
    lr: float


@dataclass(kw_only=True)
class Run:
    """Everything one training run works on: a plain bundle, passed to small functions."""

    config: Config
    run_dir: Path
    updater: Updater  # the model, its loss module, optimiser and scaler
    tokenizer: Tokenizer
    corpora: Corpora
    progress: Progress
    schedule: Schedule
    tracker: Tracker
    place: Distributed
    clock: Clock
    window: Window = field(default_factory=Window)
    saved_step: int | None = None  # the step of the run's last.pt, once it has one
    dev_alignment: DevAlignment | None = None  # data.dev_alignment, checked before training
    shortlist: Shortlist | None = None  # decoding's, from the training pairs (main rank)
    prefetch: Prefetch = field(default_factory=lambda: Prefetch(False))  # training.prefetch
    pending: Pending | None = None  # the update queued and not yet read (deferred_reads)
    search_precision: str | None = None  # validation's search, chosen at its first validation

    @classmethod
    def build(
        cls,
        config: Config,
        run_dir: Path,
        place: Distributed,
        device: torch.device,
        *,
        resume_from: Path | None = None,
        initial: Initial | None = None,
    ) -> Run:
        """The run as it starts: its tokenizer and corpora, prepared or found in ``run_dir``,
        and its model restored from ``resume_from`` (the checkpoint to resume), fine-tuned from
        ``initial`` or fresh. The precision is chosen for the model (``training.precision``),
        said in the log and recorded in environment.json."""
        started = time.time()  # training.max_minutes counts data preparation too
        cfg = config.training
        saved, tokenizer, corpora = _load(config, run_dir, place, resume_from, initial)
        dev_alignment = load_dev_alignment(config, corpora)
        shortlist = _shortlist(saved, resume_from, corpora, tokenizer, place, cfg.seed)
        model = allocate_model(config, tokenizer, device, distributed=place.enabled)
        chosen = _choose_precision(config, model, device, place)
        allow_tf32(device, chosen.name)
        log.info("precision: %s", chosen)
        if place.is_main:
            write_run_info(run_dir, config, device, chosen, place.world_size)
        if saved is None and initial is not None:
            load_initial_weights(model, initial)
        freeze(model, cfg.freeze)
        updater = Updater.build(config, model, chosen.name, device, place)
        progress = _start(saved, updater, place, cfg.seed)
        _check_same_start(progress, place, device)
        _log_model(config, updater)
        loss, nll, tokens = progress.window
        return cls(
            config=config,
            run_dir=run_dir,
            updater=updater,
            schedule=Schedule.from_config(cfg, place.world_size),
            tokenizer=tokenizer,
            corpora=corpora,
            progress=progress,
            # a resumed run's logs forget what the killed run logged after its checkpoint
            tracker=Tracker(
                run_dir,
                place.is_main,
                progress.step if saved is not None else None,
                tensorboard=config.run.tensorboard,
            ),
            place=place,
            # the minutes of the invocations it resumes count too
            clock=Clock(started - 60 * progress.minutes, cfg.max_minutes),
            window=Window(loss, nll, int(tokens)),
            saved_step=progress.step if saved is not None else None,
            dev_alignment=dev_alignment,
            shortlist=shortlist,
            prefetch=Prefetch(_prefetch(cfg.prefetch, device)),
        )

    def close(self) -> None:
        """What the run holds besides its files: the batches' background thread."""
        self.prefetch.close()

    def save(self, is_best: bool) -> None:
        """Every rank hands in its random state; rank 0 writes the checkpoints."""
        self.progress.window = [self.window.loss, self.window.nll, float(self.window.tokens)]
        rng_by_rank = gather_objects(rng_state(), self.place)
        if not self.place.is_main:
            return
        updater = self.updater
        state = {
            "model": updater.model.state_dict(),
            "optimizer": updater.optimizer.state_dict(),
            "scaler": updater.scaler.state_dict() if updater.scaler is not None else None,
            "progress": asdict(self.progress),
            "config": self.config.model_dump(mode="json"),
            "tokenizer": self.tokenizer.state_dict(),
            "rng": rng_by_rank[0],
            "shortlist": self.shortlist.state_dict() if self.shortlist is not None else None,
        }
        if self.place.enabled:
            state["rng_by_rank"] = rng_by_rank
        try:
            save_checkpoints(self.run_dir, state, self.config.training.keep_last, is_best)
        except WriteError as exc:
            if Path(str(exc.path)).name.startswith("step-"):  # best.pt and last.pt went first
                self.saved_step = self.progress.step
            exc.needed = f"a checkpoint takes about {human_size(checkpoint_bytes(state))}"
            raise
        self.saved_step = self.progress.step


def _shortlist(
    saved: dict[str, Any] | None,
    resume_from: Path | None,
    corpora: Corpora,
    tokenizer: Tokenizer,
    place: Distributed,
    seed: int,
) -> Shortlist | None:
    """The run's lexical shortlist (``nmt.decoding.shortlist``), which its checkpoints carry
    for decoding: a resumed run's own, else built from its training pairs. Only the rank that
    writes checkpoints holds one; no random number of the run is drawn."""
    if not place.is_main:
        return None
    sizes = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    if saved is not None and saved.get("shortlist") is not None:
        assert resume_from is not None
        return Shortlist.from_state_dict(saved["shortlist"], *sizes, resume_from)
    started = time.perf_counter()
    shortlist = Shortlist.build(corpora.train, *sizes, seed)
    log.info(
        "shortlist: %d translations per source piece, %d frequent pieces, built in %.1fs",
        shortlist.table.size(1),
        shortlist.frequent.numel(),
        time.perf_counter() - started,
    )
    return shortlist


def _load(
    config: Config,
    run_dir: Path,
    place: Distributed,
    resume_from: Path | None,
    initial: Initial | None,
) -> tuple[dict[str, Any] | None, Tokenizer, Corpora]:
    """The checkpoint to resume (None: a new run), the tokenizer (the checkpoint's, the
    fine-tuned model's, or trained now) and the corpora, prepared or found in ``run_dir``."""
    saved, tokenizer = read_checkpoint(resume_from, config)
    if saved is None and initial is not None:
        tokenizer = initial.tokenizer
    seed_everything(config.training.seed)
    corpora, tokenizer = load_corpora_in_turn(config, run_dir, tokenizer, place)
    return saved, tokenizer, corpora


def checkpoint_bytes(state: Any) -> int:
    """The bytes of the tensors in a checkpoint's state (what its file is mostly made of)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(checkpoint_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(checkpoint_bytes(v) for v in state)
    return 0


def uses_cuda_graphs(config: Config, device: torch.device, distributed: bool) -> bool:
    """Whether training captures CUDA graphs: ``training.cuda_graphs`` on one GPU
    (DistributedDataParallel's hooks stay eager); of the whole loss or of a step-by-step
    decoder's unroll (``training.cuda_graphs_scope``, ``Seq2Seq.graphs``)."""
    return config.training.cuda_graphs and device.type == "cuda" and not distributed


def allocate_model(
    config: Config, tokenizer: Tokenizer, device: torch.device, *, distributed: bool = False
) -> Seq2Seq:
    """The model on ``device``, with the fast paths of ``run.fast_kernels`` (and CUDA graphs
    with ``training.cuda_graphs`` on one GPU: ``uses_cuda_graphs``); a model too large for its
    memory is an NMTError naming the sizes to lower, not an allocator's traceback."""
    graphs = uses_cuda_graphs(config, device, distributed)
    scope = config.training.cuda_graphs_scope
    fast = FastPaths(cpu_kernels=config.run.fast_kernels, graphs=scope if graphs else "off")
    try:
        return build_model(
            config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size, fast
        ).to(device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
            raise
    m = config.model
    sizes = (
        f"model.embedding_size={m.embedding_size}, model.encoder.hidden_size="
        f"{m.encoder.hidden_size}, model.encoder.layers={m.encoder.layers}, "
        f"model.decoder.hidden_size={m.decoder.hidden_size}, model.decoder.layers="
        f"{m.decoder.layers}, vocabulary {tokenizer.src_vocab_size}/{tokenizer.trg_vocab_size}"
    )
    raise NMTError(f"the model does not fit in the memory of {device} ({sizes}); lower them")


def _choose_precision(
    config: Config, model: nn.Module, device: torch.device, place: Distributed
) -> Precision:
    """``training.precision`` for this model on this device (``auto`` probes a CPU with
    native bf16, with a batch's target tokens as the matmuls' rows); under torchrun every rank
    takes rank 0's choice."""
    rows = config.training.batch_tokens // 2  # about a batch's target tokens
    if not place.enabled:
        return choose_precision(config.training.precision, device, model, rows)
    mine = (
        choose_precision(config.training.precision, device, model, rows) if place.is_main else None
    )
    return broadcast_object(mine)


def _start(
    saved: dict[str, Any] | None, updater: Updater, place: Distributed, seed: int
) -> Progress:
    """Where the run starts: a checkpoint's progress, with its weights, optimiser and scaler
    state and random state put back, or afresh."""
    if saved is not None:
        progress = restore(saved, updater.model, updater.optimizer, updater.scaler)
        restore_rng(saved, place, seed)
        return progress
    if place.rank:  # same initial weights everywhere, different dropout masks
        seed_everything(seed + place.rank)
    return Progress()


def _check_same_start(progress: Progress, place: Distributed, device: torch.device) -> None:
    """All ranks must start from the same step, or their collectives would not pair up."""
    if not place.enabled:
        return
    high, low = all_reduce([progress.step, -progress.step], device, op="max")
    if high != -low:
        raise CheckpointError(
            f"the ranks start from different steps ({-low:.0f} to {high:.0f}): each read its "
            f"own run directory; put it on a filesystem all machines share"
        )


def _log_model(config: Config, updater: Updater) -> None:
    place = updater.place
    log.info(
        "model: %s decoder, %s attention, %d parameters; %s, %s%s",
        config.model.decoder.style,
        config.model.attention.score,
        count_parameters(updater.model),
        updater.device,
        updater.precision,
        f", {place.world_size} ranks" if place.enabled else "",
    )
    cfg = config.training
    if cfg.lr_reference_tokens is not None:
        tokens = cfg.batch_tokens * cfg.accumulate * place.world_size
        log.info(
            "learning rate %.3g at %d tokens an update (training.lr_reference_tokens), "
            "%.3g at this run's %d: x sqrt(%d / %d)",
            cfg.learning_rate,
            cfg.lr_reference_tokens,
            peak_rate(cfg, place.world_size),
            tokens,
            tokens,
            cfg.lr_reference_tokens,
        )


def _prefetch(setting: bool | None, device: torch.device) -> bool:
    """training.prefetch: as set, or (null) on a GPU alone, where a step is short enough for
    the host's work on the next batches to show."""
    return device.type == "cuda" if setting is None else setting
