"""How few rows a batch may keep while search drops its ended sentences (``search.kept_rows``).

Dropping the rows of ended sentences changes which rows a step multiplies, and a matmul
library may take other kernels, with another round-off, for a few rows than for many: MKL
did under 4 rows on a 2-core AMD EPYC and under 16 on a Xeon. A sentence's outcome would then
depend on when its neighbours ended. So a batch keeps at least ``MIN_ROWS`` rows (ended
sentences fill them) unless the step at hand is known to give every row the same bits
whatever rows are with it.

``probed_floor`` finds that out on the machine, for the thread count that will step: it
steps a synthetic batch of ``PROBE_ROWS`` sentences once over a shortlist's columns (search's
default; the whole vocabulary multiplies through the same products), then its last rows
alone (``Ensemble.select``, as search drops rows), each count from 1 to MIN_ROWS - 1 and a
few larger ones (``LARGE_COUNTS``), and compares the log-probabilities, attention and next
hidden states bit for bit. The floor is one more than the largest count under MIN_ROWS that
differed (1 when none did); MIN_ROWS where a larger count differed too. A Translator's float32
CPU search multiplies every weight of the demo's step from oneDNN's prepared layouts
(``fast.packed``): on the EPYC only a single row differed there (its product is the plain
matrix-vector one), and the floor is 2; with W_hh and W_c from MKL it was 4.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nmt.vocab import PAD_ID

if TYPE_CHECKING:
    from nmt.decoding.ensemble import Ensemble, EnsembleState

MIN_ROWS = 16  # the floor where a step's rows are not known to be independent of the count
PROBE_ROWS = 72  # the synthetic batch's sentences: past the 64 rows oneDNN's layouts are for
LARGE_COUNTS = (16, 32, 64, 65)  # counts at or over MIN_ROWS the probe checks too
PROBE_LENGTH = 10  # its longest source
FIRST_ID = 4  # ids under it are the special pieces


@torch.no_grad()
def probed_floor(ensemble: Ensemble) -> int:
    """The fewest rows a batch of ``ensemble``'s may keep, on this machine with torch's
    current thread count (see the module docstring); MIN_ROWS off a CPU (a GPU's search
    keeps its rows: ``decoding.device_loop``)."""
    model = ensemble.models[0]
    if model.generator.weight.device.type != "cpu":
        return MIN_ROWS
    generator = torch.Generator().manual_seed(0)
    src_vocab = min(m.encoder.embed.weight.size(0) for m in ensemble.models)
    trg_vocab = model.trg_vocab_size
    lengths = torch.randint(3, PROBE_LENGTH + 1, (PROBE_ROWS,), generator=generator)
    lengths[0] = PROBE_LENGTH
    words = (min(FIRST_ID, src_vocab - 1), src_vocab)  # not the specials, where there are others
    src = torch.randint(*words, (PROBE_ROWS, PROBE_LENGTH), generator=generator)
    src = src.masked_fill(torch.arange(PROBE_LENGTH)[None, :] >= lengths[:, None], PAD_ID)
    columns = torch.arange(1, trg_vocab, 2)  # a shortlist's columns: every other piece
    allowed = torch.ones(PROBE_ROWS, columns.numel(), dtype=torch.bool)
    shortlist = ensemble.restricted(columns, allowed)
    prev = torch.randint(0, columns.numel(), (PROBE_ROWS,), generator=generator)
    state = shortlist.encode(src, lengths)
    whole = _step(shortlist, prev, state)
    floor = 1
    for count in (*range(1, MIN_ROWS), *LARGE_COUNTS):
        index = torch.arange(PROBE_ROWS - count, PROBE_ROWS)
        part = _step(shortlist, prev[index], shortlist.select(state, index))
        if any(not torch.equal(a[index], b) for a, b in zip(whole, part, strict=True)):
            floor = count + 1 if count < MIN_ROWS else MIN_ROWS
    return floor


def _step(stepper: Ensemble, prev: Tensor, state: EnsembleState) -> list[Tensor]:
    """One step's log-probabilities, attention and each member's next hidden state, rows
    first."""
    log_probs, alphas, following = stepper.step(prev, state)
    hidden = [member.hidden.transpose(0, 1) for member in following.states]  # (B, L, H)
    return [log_probs, alphas, *hidden]
