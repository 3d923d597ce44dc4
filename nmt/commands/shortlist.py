"""The body of `nmt shortlist`: the lexical shortlist (``nmt.decoding.shortlist``) built for a
run trained before `nmt train` built one, and added to its checkpoints.

The shortlist is the one `nmt train` builds at the start of a run: Model 1 on the run's
training pairs (its saved config's ``data`` section, prepared as training prepares them, in
the run's cache) with the checkpoint's own tokenizer. A checkpoint that has one keeps it. Each
checkpoint is written again whole or not at all, so a failure leaves it as it was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from nmt import checkpoint
from nmt.config import saved_config
from nmt.data.prepare import load_corpora
from nmt.data.tokenizer import checkpoint_tokenizer
from nmt.decoding.shortlist import Shortlist
from nmt.errors import CheckpointError

log = logging.getLogger("nmt")


@dataclass(frozen=True)
class ShortlistRequest:
    """What `nmt shortlist` is asked: a run directory (every checkpoint in it) or one
    checkpoint file."""

    run: Path


@dataclass(frozen=True)
class ShortlistResult:
    """The checkpoints given a shortlist, those that had one, and the build's seconds."""

    added: list[Path]
    kept: list[Path]
    seconds: float


def run_checkpoints(run: Path) -> list[Path]:
    """A run directory's checkpoints (best.pt, last.pt, step-N.pt), or the one file given."""
    run = Path(run)
    if run.is_dir():
        found = sorted(run.glob("*.pt"))
        if not found:
            raise CheckpointError(f"{run}: no checkpoints (*.pt) in this run directory")
        return found
    return [checkpoint.resolve(run, "nmt shortlist")]


def shortlist_command(request: ShortlistRequest) -> ShortlistResult:
    """Add the run's shortlist to each of its checkpoints that lacks one."""
    paths = run_checkpoints(request.run)
    states = {path: checkpoint.load(path) for path in paths}
    lacking = [path for path, state in states.items() if state.get("shortlist") is None]
    if not lacking:
        return ShortlistResult([], paths, 0.0)
    first = states[lacking[0]]
    config = saved_config(first["config"], lacking[0], first.get("version"))
    tokenizer = checkpoint_tokenizer(first, lacking[0])
    for path in lacking[1:]:
        if states[path]["tokenizer"] != first["tokenizer"]:
            raise CheckpointError(
                f"{path}: its tokenizer differs from {lacking[0]}'s; give the checkpoints of "
                f"one run"
            )
    started = time.perf_counter()
    corpora, _ = load_corpora(config, lacking[0].parent, tokenizer)
    sizes = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    shortlist = Shortlist.build(corpora.train, *sizes, config.training.seed)
    seconds = time.perf_counter() - started
    for path in lacking:
        state = {k: v for k, v in states[path].items() if k not in ("format", "version")}
        state["shortlist"] = shortlist.state_dict()
        checkpoint.save(path, state)
    return ShortlistResult(lacking, [p for p in paths if p not in lacking], seconds)
