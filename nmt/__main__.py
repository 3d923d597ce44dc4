"""python -m nmt; also what torchrun starts on every rank (see nmt/training/loop.py), as in
``torchrun --nproc-per-node N -m nmt train CONFIG.yaml``."""

from nmt.cli import command

command()
