"""nmt: attention-based RNN encoder-decoder machine translation."""

__version__ = "0.1.0"
