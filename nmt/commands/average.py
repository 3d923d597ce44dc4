"""The body of `nmt average`: checkpoint averaging (as in Vaswani et al. 2017, section 6.1, and
Joey NMT's and OpenNMT-py's average scripts) into a normal checkpoint.

Every floating-point weight becomes the mean of that weight over the N checkpoints,
theta = 1/N sum_n theta_n, summed in float64 and stored in the weight's own dtype. The
checkpoints must share the architecture (the saved ``model`` config section), the
tokenizer and every weight's name and shape. The result holds the averaged weights with the
newest checkpoint's config and tokenizer: `nmt translate`, `nmt eval --model` and
`nmt score` read it like any checkpoint. It holds no optimiser state, so it is a model to
use, not a run to resume.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt import checkpoint
from nmt.errors import CheckpointError, ConfigError
from nmt.files import check_output

STEP_FILE = re.compile(r"step-(\d+)\.pt")


@dataclass(frozen=True)
class AverageRequest:
    """What `nmt average` is asked: checkpoint files (or run directories: their best.pt), or
    a run's newest ``last`` step-N.pt files; and where to write the average."""

    checkpoints: Sequence[Path] = ()
    run: Path | None = None
    last: int | None = None
    output: Path = Path("averaged.pt")


def last_checkpoints(run_dir: Path, count: int) -> list[Path]:
    """A run's newest ``count`` step-N.pt files (kept by ``training.keep_last``)."""
    if not run_dir.is_dir():
        raise CheckpointError(f"--run {run_dir}: no such run directory")
    steps = sorted(
        (int(match.group(1)), path)
        for path in run_dir.iterdir()
        if (match := STEP_FILE.fullmatch(path.name))
    )
    if len(steps) < count:
        raise CheckpointError(
            f"--run {run_dir}: --last {count} needs {count} step-N.pt checkpoints but the run "
            f"kept {len(steps)}; train with training.keep_last {count} or more (a step-N.pt "
            f"is written at every validation), or give the checkpoint files"
        )
    return [path for _, path in steps[-count:]]


def average_states(paths: Sequence[Path]) -> dict[str, Any]:
    """Load and average the checkpoints; the newest (highest step, else the last given)
    gives the config and tokenizer."""
    states = [checkpoint.load(path) for path in paths]
    first_path, first = paths[0], states[0]
    for path, state in zip(paths[1:], states[1:], strict=True):
        _check_compatible(first_path, first, path, state)
    newest = max(range(len(states)), key=lambda i: (checkpoint.step_of(states[i]), i))
    averaged = {}
    for name, tensor in first["model"].items():
        if torch.is_floating_point(tensor):
            total = torch.zeros(tensor.shape, dtype=torch.float64)
            for state in states:
                total += state["model"][name].to(torch.float64)
            averaged[name] = (total / len(states)).to(tensor.dtype)
        else:
            for path, state in zip(paths, states, strict=True):
                if not torch.equal(state["model"][name], tensor):
                    raise CheckpointError(
                        f"{path}: {name} (not a float weight, so it cannot be averaged) differs "
                        f"from {first_path}'s"
                    )
            averaged[name] = tensor
    return {
        "model": averaged,
        "config": states[newest]["config"],
        "tokenizer": states[newest]["tokenizer"],
        "shortlist": states[newest].get("shortlist"),
        "averaged_from": [
            {"path": str(path), "step": checkpoint.step_of(state)}
            for path, state in zip(paths, states, strict=True)
        ],
    }


def _check_compatible(
    first_path: Path, first: dict[str, Any], path: Path, state: dict[str, Any]
) -> None:
    """Same architecture, tokenizer, and weight names and shapes as the first checkpoint."""
    model, first_model = state["config"].get("model"), first["config"].get("model")
    if model != first_model:
        keys = sorted(
            k
            for k in set(model or {}) | set(first_model or {})
            if (model or {}).get(k) != (first_model or {}).get(k)
        )
        raise CheckpointError(
            f"{path}: its model config differs from {first_path}'s (model.{', model.'.join(keys)}); "
            f"only checkpoints of one architecture can be averaged"
        )
    if state["tokenizer"] != first["tokenizer"]:
        raise CheckpointError(
            f"{path}: its tokenizer differs from {first_path}'s; only checkpoints of models "
            f"that share a tokenizer can be averaged"
        )
    weights, first_weights = state["model"], first["model"]
    for name in sorted(set(weights) | set(first_weights)):
        if name not in weights or name not in first_weights:
            raise CheckpointError(
                f"{path}: the weight {name} is in only one of it and {first_path}"
            )
        if tuple(weights[name].shape) != tuple(first_weights[name].shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(weights[name].shape)} but "
                f"{tuple(first_weights[name].shape)} in {first_path}"
            )


def average_command(request: AverageRequest) -> list[Path]:
    """`nmt average`: the given checkpoints (or a run's last N) averaged into ``output``,
    written atomically; returns the checkpoints averaged."""
    checkpoints, run_dir, last = request.checkpoints, request.run, request.last
    if run_dir is not None or last is not None:
        if checkpoints:
            raise ConfigError(
                "give checkpoint files, or --run RUN with --last N (a run's newest N), not both"
            )
        if run_dir is None or last is None:
            given, needed = ("--run", "--last N") if last is None else ("--last", "--run RUN")
            raise ConfigError(
                f"{given} needs {needed}: --run RUN --last N averages a run's newest N"
            )
        paths = last_checkpoints(run_dir, last)
    else:
        missing = [str(p) for p in checkpoints if not Path(p).exists()]
        if missing:
            raise CheckpointError(
                f"{missing[0]}: no such checkpoint file or run directory; check the paths "
                f"given to nmt average"
            )
        paths = [checkpoint.resolve(Path(p), "nmt average") for p in checkpoints]
    if len(paths) < 2:
        raise ConfigError("averaging needs at least two checkpoints")
    check_output(request.output, "--output", {"checkpoint": paths})
    state = average_states(paths)
    checkpoint.save(request.output, state)
    return paths
