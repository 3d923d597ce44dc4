"""Decoding: greedy and batched beam search over token ids, and the ``Translator`` that turns
a checkpoint and lines of text into hypotheses."""
