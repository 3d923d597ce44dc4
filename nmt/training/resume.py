"""What a training checkpoint holds beyond the weights, and how a run resumes from it.

A checkpoint is self-describing: weights, optimiser and grad-scaler state, the resolved config,
the tokenizer, ``Progress`` (step, epoch, position in the epoch, best score, plateau scale,
skipped steps, validation history) and every rank's random state, so that a resumed run makes
exactly the updates the uninterrupted run would have made.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt import checkpoint
from nmt.config import Config, changed_keys, saved_config
from nmt.data.tokenizer import Tokenizer
from nmt.errors import CheckpointError, ConfigError
from nmt.model import Seq2Seq
from nmt.runtime import seed_everything
from nmt.training.distributed import Distributed
from nmt.training.schedule import Progress

log = logging.getLogger("nmt")


def rng_state() -> dict[str, Any]:
    """This process's random state: dropout masks (torch, CUDA) and numpy."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])


def save_checkpoints(run_dir: Path, state: dict[str, Any], keep_last: int, is_best: bool) -> None:
    """best.pt when it improved, last.pt, and with keep_last > 1 the newest keep_last step-N.pt.

    best.pt goes first: a run killed between the two resumes from the previous last.pt and
    makes the same improving validation again, so best.pt is never left one validation behind
    a last.pt that already counts the new best.
    """
    step = state["progress"]["step"]
    if is_best:
        checkpoint.save(run_dir / "best.pt", state)
    checkpoint.save(run_dir / "last.pt", state)
    if keep_last > 1:
        checkpoint.save(run_dir / f"step-{step:08d}.pt", state)
        for old in sorted(run_dir.glob("step-*.pt"))[:-keep_last]:
            old.unlink()


def check_resume_config(saved: Config, new: Config) -> None:
    """Log what changed since the checkpoint; refuse changes to the model or tokenizer."""
    changed = changed_keys(saved, new)
    if not changed:
        return
    old_values, new_values = saved.model_dump(mode="json"), new.model_dump(mode="json")
    log.info(
        "config changed since the checkpoint: %s",
        ", ".join(
            f"{key} {_lookup(old_values, key)!r} -> {_lookup(new_values, key)!r}" for key in changed
        ),
    )
    frozen = [k for k in changed if k.startswith(("model.", "tokenizer."))]
    if frozen:
        raise ConfigError(
            f"{frozen[0]}: changed since the checkpoint and cannot apply to the saved model "
            f"(changed: {', '.join(frozen)}); restore it or start a new --run-dir"
        )


def _lookup(values: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def read_checkpoint(
    resume_from: Path | None, config: Config
) -> tuple[dict[str, Any] | None, Tokenizer | None]:
    """The checkpoint to resume from and its tokenizer, after checking the config against it."""
    if resume_from is None:
        return None, None
    others = sorted(p.name for p in resume_from.parent.glob("*.pt") if p != resume_from)
    instead = (
        f"--resume reads {resume_from.name}: copy another checkpoint of the run over it "
        f"({', '.join(others[-3:])}) to resume from there"
        if others
        else "the run has no other checkpoint: start a new run in another --run-dir"
    )
    saved = checkpoint.load(resume_from, instead=instead)
    check_resume_config(saved_config(saved["config"], resume_from, saved.get("version")), config)
    log.info("resuming from %s (step %d)", resume_from, saved["progress"]["step"])
    return saved, Tokenizer.from_state_dict(saved["tokenizer"])


def restore(
    saved: dict[str, Any], model: Seq2Seq, optimizer: torch.optim.Optimizer, scaler: Any
) -> Progress:
    """Load weights, optimiser and scaler state in place; returns the saved progress."""
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint does not fit the configured model: {exc}") from None
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    return Progress(**saved["progress"])


def restore_rng(saved: dict[str, Any], place: Distributed, seed: int) -> None:
    """Each rank's random state as saved; reseeded ranks when the world size changed."""
    by_rank = saved.get("rng_by_rank") or [saved["rng"]]
    if len(by_rank) == place.world_size:
        set_rng_state(by_rank[place.rank])
        return
    log.info(
        "resuming %d ranks from a run of %d: dropout streams of ranks > 0 are reseeded",
        place.world_size,
        len(by_rank),
    )
    if place.is_main:
        set_rng_state(saved["rng"])
    else:
        seed_everything(seed + 1000 * place.rank + saved["progress"]["step"])
