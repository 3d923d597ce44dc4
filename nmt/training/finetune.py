"""Fine-tuning: a run that starts from another run's weights and tokenizer
(``training.init_from``), with parts of the model kept fixed (``training.freeze``).

What starts afresh: the optimiser's state (Adam's moments), the learning-rate schedule and
its plateau scale, the step and epoch counts, the best dev score, early stopping and the
random state (from ``training.seed``). What is taken: every weight and the tokenizer; the
config's own tokenizer section is not used. `--resume` of a fine-tuning run reads its own
last.pt, like any run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nmt import checkpoint
from nmt.config import Config
from nmt.data.tokenizer import Tokenizer, checkpoint_tokenizer
from nmt.errors import ConfigError
from nmt.model import build_model

log = logging.getLogger("nmt")

# parameter-name prefixes of each part, matched in this order (a tied output layer is the
# target embedding: named_parameters lists it once, as decoder.embed.weight)
PARTS = (
    ("embeddings", ("encoder.embed.", "decoder.embed.")),
    ("attention", ("decoder.attention.",)),
    ("encoder", ("encoder.", "bridge.")),
    ("decoder", ("decoder.", "generator.")),
    ("alignment_head", ("aligner.",)),  # never frozen: it learns from the guidance alone
)
HEAD = "aligner."  # model.alignment_head's parameters: may be added or dropped by fine-tuning


@dataclass
class Initial:
    """The checkpoint a fine-tuning run starts from."""

    path: Path
    weights: dict[str, Any]
    tokenizer: Tokenizer
    step: int


def read_initial(config: Config) -> Initial | None:
    """training.init_from's checkpoint (a run directory: its best.pt), or None."""
    source = config.training.init_from
    if not source:
        return None
    path = checkpoint.resolve(Path(source), "training.init_from")
    state = checkpoint.load(path)
    tokenizer = checkpoint_tokenizer(state, path)
    return Initial(path, state["model"], tokenizer, checkpoint.step_of(state))


def check_initial_weights(config: Config, initial: Initial) -> None:
    """Before anything is written: the config's model (built without memory, on the meta
    device) has the checkpoint's parameter names and shapes."""
    with torch.device("meta"):
        model = build_model(
            config.model, initial.tokenizer.src_vocab_size, initial.tokenizer.trg_vocab_size
        )
    _check_fits(model, initial)


def load_initial_weights(model: nn.Module, initial: Initial) -> None:
    """Copy every weight of the checkpoint into ``model``; a name or shape that differs is a
    one-line error naming the parameter."""
    _check_fits(model, initial)
    expected = model.state_dict()
    weights = {name: value for name, value in initial.weights.items() if name in expected}
    model.load_state_dict(weights, strict=False)
    log.info("fine-tuning from %s (step %d)", initial.path, initial.step)
    if any(name.startswith(HEAD) for name in expected) and not any(
        name.startswith(HEAD) for name in initial.weights
    ):
        log.info("model.alignment_head: new, learnt from training.guided_alignment")


def _check_fits(model: nn.Module, initial: Initial) -> None:
    expected = model.state_dict()
    for name in sorted(set(expected) | set(initial.weights)):
        if name.startswith(HEAD) and (name not in initial.weights or name not in expected):
            continue  # a head added to a model without one starts fresh; one left out is dropped
        if name not in initial.weights or name not in expected:
            where = "the config's model" if name in expected else "the checkpoint"
            raise ConfigError(
                f"training.init_from: {initial.path}: the parameter {name} is only in {where}; "
                f"the model section must describe the checkpoint's architecture (use its "
                f"config.yaml's model section)"
            )
        have, want = tuple(initial.weights[name].shape), tuple(expected[name].shape)
        if have != want:
            raise ConfigError(
                f"training.init_from: {initial.path}: the parameter {name} has shape {have} "
                f"there but {want} in this config's model; make the model section's sizes "
                f"those of the checkpoint"
            )


def part_of(name: str) -> str:
    """The freezable part a parameter belongs to."""
    for part, prefixes in PARTS:
        if name.startswith(prefixes):
            return part
    raise AssertionError(f"parameter {name} belongs to no part")


def freeze(model: nn.Module, parts: Sequence[str]) -> int:
    """Keep the parameters of ``parts`` fixed (no gradient, not in the optimiser); returns
    how many values are frozen."""
    if not parts:
        return 0
    frozen = 0
    for name, parameter in model.named_parameters():
        if part_of(name) in parts:
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    log.info("frozen: %s (%d parameters)", ", ".join(parts), frozen)
    return frozen
