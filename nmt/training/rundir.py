"""The run directory: created or resumed, described (config.yaml, environment.json), locked
for the length of a run, and filled with the tokenizer and corpora in turn under torchrun.

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
from pathlib import Path
from typing import Any

import torch

from nmt import __version__
from nmt.config import Config, to_yaml
from nmt.data.prepare import Corpora, load_corpora
from nmt.data.store import TokenizedCorpus
from nmt.data.tokenizer import Tokenizer
from nmt.errors import CheckpointError, ConfigError
from nmt.fast import compiled
from nmt.fast.precision import Precision
from nmt.files import atomic_write_text, remove_stale_temporaries
from nmt.runtime import cpu_name
from nmt.training.distributed import Distributed, broadcast_object

log = logging.getLogger("nmt")


def check_run_dir(run_dir: Path, resume: bool = False) -> None:
    """Before anything is written: the run directory can be one, and one to resume is there
    (a run killed before its first checkpoint has its folder, and starts afresh)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir: {run_dir} exists and is a file; choose another --run-dir")
    if resume and not run_dir.exists():
        raise ConfigError(
            f"run.dir: {run_dir} does not exist, so there is no run to resume; check the "
            f"--run-dir (or run.dir), or drop --resume to start a new run"
        )


def prepare_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """Create the run dir; return the checkpoint to resume from (or None)."""
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


PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding nmt/training/


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=PROJECT_ROOT
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def project_commit(describe: bool = False) -> str | None:
    """The commit of the nmt checkout this code runs from (``git describe --always --dirty``
    with ``describe``), or None where nmt is not a checkout of its own: installed from a
    wheel, or a copy of the tree inside some other git repository (whose commit says nothing
    about this code)."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != PROJECT_ROOT:
        return None
    return _git("describe", "--always", "--dirty") if describe else _git("rev-parse", "HEAD")


def write_run_info(
    run_dir: Path, config: Config, device: torch.device, precision: Precision, world_size: int = 1
) -> None:
    """The resolved config (config.yaml) and what the run ran on (environment.json)."""
    atomic_write_text(run_dir / "config.yaml", to_yaml(config))
    info = {
        "nmt_version": __version__,
        "git_commit": project_commit(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        **precision.record(),
        "world_size": world_size,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # nmt.allocator.MALLOC_TUNABLES
        "native_kernels": compiled.status()
        if device.type == "cpu" and config.run.fast_kernels
        else None,
    }
    atomic_write_text(run_dir / "environment.json", json.dumps(info, indent=2) + "\n")


class RunLock:
    """An exclusive lock on a run directory for the length of a training run.

    A second ``nmt train`` pointed at a directory in use refuses instead of interleaving its
    checkpoints and logs. The lock is an ``flock`` on ``.lock``, so the operating system drops
    it when the process dies, however it dies. Taking it removes the temporary files that a
    killed writer left in the directory (no other writer can be at work there).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.handle: Any = None

    def __enter__(self) -> RunLock:
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = self.path.open("a+")
        except OSError as exc:
            raise CheckpointError(
                f"run.dir: cannot create {self.path.parent} ({exc.strerror}); choose another "
                f"--run-dir"
            ) from None
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "another process"
            self.handle.close()
            raise CheckpointError(
                f"{self.path.parent}: in use by {owner}; wait for it to finish or use another "
                f"--run-dir"
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()}\n")
        self.handle.flush()
        remove_stale_temporaries(self.path.parent)
        return self

    def __exit__(self, *exc: Any) -> None:
        import fcntl

        fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()


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


def epoch_corpus_in_turn(corpora: Corpora, epoch: int, place: Distributed) -> TokenizedCorpus:
    """``Corpora.for_epoch``: with subword sampling, rank 0 samples the epoch first and the
    other ranks then read its files (or sample the same ids themselves without a shared
    filesystem)."""
    if corpora.sampler is None or not place.enabled:
        return corpora.for_epoch(epoch)
    if place.is_main:
        corpus = corpora.for_epoch(epoch)
    broadcast_object(None)  # the others wait for rank 0's files
    if not place.is_main:
        corpus = corpora.for_epoch(epoch)
    return corpus
