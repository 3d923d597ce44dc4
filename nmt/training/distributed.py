"""The torchrun process group: this process's place in it, joining and leaving, and the few
collectives training needs.

Under ``torchrun`` every process finds WORLD_SIZE, RANK and LOCAL_RANK in its environment;
``init_distributed`` joins the process group (NCCL on CUDA, gloo on CPU) and picks the GPU of
the local rank. Without them training is a single process and no process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from nmt.errors import ConfigError
from nmt.runtime import choose_device

# How long a rank waits in a collective. The ranks > 0 wait in one while rank 0 trains the
# tokenizer and tokenises the corpus, which takes far longer than torch's default 10 minutes
# on a large corpus (NCCL would abort the job).
PROCESS_GROUP_TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # this process created the process group and destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ConfigError(f"environment: {name}={value!r} is not an integer") from None


def init_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group if there is one; returns (place, device)."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    device = choose_device(device_name, local_rank if world_size > 1 else 0)
    if world_size == 1:
        return Distributed(), device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = not torch_dist.is_initialized()
    if owns:
        if not torch_dist.is_available():
            raise ConfigError("torchrun: this build of torch has no torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT
        )
    return Distributed(rank, local_rank, world_size, owns), device


def shutdown_distributed(place: Distributed, wait_for_all: bool = False) -> None:
    """Leave the process group. After a normal end every rank first waits for the others:
    a rank that tears down its connections while rank 0 still writes the last checkpoint can
    abort the job (gloo's threads are destroyed while still joinable)."""
    if place.owns_group and torch_dist.is_initialized():
        if wait_for_all:
            torch_dist.barrier()
        torch_dist.destroy_process_group()


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all ranks; every rank gets the same result."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(
        tensor, torch_dist.ReduceOp.MAX if op == "max" else torch_dist.ReduceOp.SUM
    )
    return tensor.tolist()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable object, on every rank."""
    holder = [obj]
    torch_dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(obj: Any, place: Distributed) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank."""
    if not place.enabled:
        return [obj]
    out: list[Any] = [None] * place.world_size
    torch_dist.all_gather_object(out, obj)
    return out
