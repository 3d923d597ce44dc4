"""python -m nmt (and torchrun -m nmt train ...)."""

from nmt.cli import main

main()
