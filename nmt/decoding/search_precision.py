"""The precision a CPU search runs in under ``auto``: the faster of fp32 and bf16 in the
model's own search, measured; never inferred from one matmul.

Training's probe (``nmt.fast.precision``) times the model's largest matmuls at a batch's
rows, and that is what a training step spends its time in. A search step is not: its
matmuls have a batch's sentences x beams rows, and in fp32 it runs nmt's compiled kernels
over products made once per model (``StepTables``), which a search under bf16 autocast
goes without, casting at every step instead. Where native bf16 matmuls are much faster a
whole search can still be several times slower in bf16, so ``auto`` asks the search:

- fp32 where the CPU has no native bf16, or where the matmul screen finds its bf16
  emulated (``ONEDNN_MAX_CPU_ISA`` capping oneDNN below it): nothing to measure;
- else one batch of the model's decoding batch size and beam, of random source pieces,
  searched for ``SEARCH_STEPS`` steps in each precision (a warm-up, then the median of
  ``PROBE_REPEATS``, interleaved, cut short where bf16 takes ``CLEARLY_SLOWER`` times fp32's
  time); bf16 only where it is ``SPEEDUP_NEEDED`` times as fast.
  The verdict is cached like training's, by the CPU, torch, threads and oneDNN cap, and by
  the model's shapes, the search's shape and the nmt version that searched.

An explicit ``--precision`` is kept (bf16 where it is slow warns, as in training); a GPU's
``auto`` is its native bf16, else fp16 (``nmt.fast.precision``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from nmt import __version__
from nmt.config import Config, DecodingConfig
from nmt.fast import compiled
from nmt.fast.precision import (
    SPEEDUP_NEEDED,
    Precision,
    Probe,
    cached,
    choose_precision,
    emulated_bf16,
    time_both,
)
from nmt.vocab import EOS_ID

SEARCH_STEPS = 8  # output positions the probe searches (EOS included)
SOURCE_LENGTH = 24  # source pieces of each probed sentence
PROBE_REPEATS = 3
CLEARLY_SLOWER = 2.0  # a bf16 search this many times fp32's time ends the probe at once


class Searcher(Protocol):
    """What the probe searches with: a Translator in one precision."""

    def decode_ids(self, src_ids: Sequence[list[int]], decoding: DecodingConfig) -> Any: ...


def search_precision(
    asked: str,
    device: torch.device,
    make: Callable[[str], Searcher],
    config: Config,
    models: Sequence[torch.nn.Module],
    src_vocab_size: int,
) -> Precision:
    """The precision a command's search of ``models`` (of ``config``) runs in on ``device``
    under ``--precision asked``: a CPU's auto by timing the search
    (``choose_search_precision``), else as ``nmt.fast.precision`` chooses for a search
    step's rows (a batch's sentences x beams)."""
    if asked == "auto" and device.type == "cpu":
        return choose_search_precision(make, config, len(models), src_vocab_size)
    rows = config.decoding.batch_size * config.decoding.beam_size
    return choose_precision(asked, device, models[0], rows, source="--precision")


def choose_search_precision(
    make: Callable[[str], Searcher], config: Config, members: int, src_vocab_size: int
) -> Precision:
    """``auto`` for a CPU search of ``members`` models of ``config`` (see the module
    docstring); ``make(name)`` gives the searcher in precision ``name``."""
    if emulated_bf16():
        return Precision("fp32", "auto: this CPU has no native bf16 matmuls")
    decoding = config.decoding
    facts = {
        "nmt": __version__,
        "model": config.model.model_dump(mode="json"),
        "vocabulary": src_vocab_size,
        "members": members,
        "search": [decoding.batch_size, decoding.beam_size, decoding.shortlist],
        "kernels": compiled.enabled_by_default(),
    }
    probe, was_cached = cached("search", facts, lambda: time_search(make, decoding, src_vocab_size))
    shape = f"{decoding.batch_size} sentences x beam {decoding.beam_size}"
    measured = (
        f"this model's search ran at {probe.speedup:.2f}x fp32's speed in bf16 "
        f"({'cached ' if was_cached else ''}probe of {shape})"
    )
    if probe.speedup >= SPEEDUP_NEEDED:
        return Precision("bf16", f"auto: {measured}", probe)
    return Precision("fp32", f"auto: {measured}", probe)


def time_search(make: Callable[[str], Searcher], decoding: DecodingConfig, vocab: int) -> Probe:
    """Seconds of one batch's first SEARCH_STEPS steps in fp32 and in bf16 (medians)."""
    generator = torch.Generator().manual_seed(0)
    shape = (decoding.batch_size, SOURCE_LENGTH)
    src = torch.randint(EOS_ID + 1, max(vocab, EOS_ID + 2), shape, generator=generator)
    sentences = src.tolist()
    # every output SEARCH_STEPS long at most: ceil(ratio * SOURCE_LENGTH) is 1
    probed = decoding.model_copy(
        update={
            "max_len_ratio": 1 / (2 * SOURCE_LENGTH),
            "max_len_offset": SEARCH_STEPS - 1,
            "workers": 1,
        }
    )
    fp32, bf16 = make("fp32"), make("bf16")
    seconds = time_both(
        lambda: fp32.decode_ids(sentences, probed),
        lambda: bf16.decode_ids(sentences, probed),  # the warm-up also makes the tables
        PROBE_REPEATS,
        give_up=CLEARLY_SLOWER,
    )
    probe_shape = [[decoding.batch_size * decoding.beam_size, SOURCE_LENGTH, SEARCH_STEPS]]
    return Probe(*seconds, probe_shape, False)
