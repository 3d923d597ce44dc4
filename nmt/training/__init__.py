"""Training: the explicit loop and one update, schedules, checkpoints and resume, validation,
logs, the run directory and the torchrun process group."""

from nmt.training.loop import train

__all__ = ["train"]
