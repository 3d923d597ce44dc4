"""What beam search keeps on the device instead of reading it at each step: each sentence's
best finished hypotheses (``Finished``), and whether every sentence is done (``DoneFlag``).

A search that reads a step's results on the host waits, on a GPU, until the device has run
every kernel queued so far: the host queues the next step only once this one has run, and
the chip idles between a step's small kernels. With the finished hypotheses in device
tensors, the length penalty and the stopping rule computed there, and the flag below, a
search on a GPU reads nothing until its end (``decoding.device_loop``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class Finished:
    """Each sentence's best ``slots`` finished hypotheses, best first: scores s(Y, x) in
    float64 (the arithmetic of Python floats, so that the order is the same as a list's),
    log-probabilities, lengths (EOS included), tokens before the EOS (B, F, T) and, when
    kept, attention (B, F, T, S); and how many have finished in all (``count``), which the
    stopping rule compares with K.

    A new hypothesis enters by a stable sort behind the kept ones, so that among equal
    scores the earlier keeps its place, as in a stable sort of a list in order of finishing.
    Sentences dropped from the batch (``select``) leave their rows in an archive, in the
    batch's first order, from which ``rows`` reads."""

    def __init__(
        self,
        batch: int,
        slots: int,
        width: int,
        attention: bool,
        device: Any,
        longest: int,
    ):
        """``width``: the source positions S; ``longest``: the output length T. Every tensor
        is made at its full size at once and written in place (what a CUDA graph replays)."""
        self.scores = torch.full((batch, slots), -math.inf, dtype=torch.float64, device=device)
        self.log_probs = torch.zeros((batch, slots), dtype=torch.float64, device=device)
        self.lengths = torch.zeros((batch, slots), dtype=torch.long, device=device)
        self.tokens = torch.zeros((batch, slots, longest), dtype=torch.long, device=device)
        self.alphas = (
            torch.zeros((batch, slots, longest, width), device=device) if attention else None
        )
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.sentences = list(range(batch))  # the batch index of each row
        self.archive: dict[int, tuple[Tensor | None, ...]] = {}  # sentence -> its dropped row

    def best(self) -> Tensor:
        """(B,) each sentence's best finished score (-inf: none yet)."""
        return self.scores[:, 0]

    def add(
        self,
        scores: Tensor,
        log_probs: Tensor,
        length: int | Tensor,
        tokens: Tensor,
        alphas: Tensor | None,
    ) -> None:
        """Candidates (B, K): ``scores`` s(Y, x) (-inf: not finished), ``log_probs``, their
        length (EOS included; a 0-d tensor in fixed shapes), tokens before EOS (B, K, T,
        zeros after) and attention (B, K, T, S)."""
        slots = self.scores.size(1)
        # finished: scores are sums of log-probabilities (at most 0), or -inf; one comparison
        # where isfinite takes four kernels
        self.count += (scores > -math.inf).sum(dim=1)
        merged = torch.cat([self.scores, scores], dim=1)  # (B, F+K)
        order = merged.sort(dim=1, descending=True, stable=True).indices[:, :slots]  # (B, F)
        if isinstance(length, Tensor):  # (), on the device
            lengths = length.expand(scores.shape)
        else:
            lengths = torch.zeros_like(order[:, :1]).add_(length).expand(-1, scores.size(1))
        sources = {  # each field's kept rows followed by the candidates', and its gather index
            "scores": (merged, order),
            "log_probs": (torch.cat([self.log_probs, log_probs], dim=1), order),
            "lengths": (torch.cat([self.lengths, lengths], dim=1), order),
            "tokens": _both(self.tokens, tokens, order),
        }
        if self.alphas is not None and alphas is not None:
            sources["alphas"] = _both(self.alphas, alphas, order)
        for name, (both, index) in sources.items():  # written in place, into the field
            torch.gather(both, 1, index, out=getattr(self, name))

    def select(self, keep: list[int]) -> None:
        """Keep the rows ``keep``; the others (done sentences) go to the archive."""
        kept = set(keep)
        for row, sentence in enumerate(self.sentences):
            if row not in kept:
                self.archive[sentence] = self._row(row)
        index = torch.tensor(keep, device=self.scores.device)
        self.scores, self.log_probs = self.scores[index], self.log_probs[index]
        self.lengths, self.tokens, self.count = (
            self.lengths[index],
            self.tokens[index],
            self.count[index],
        )
        self.alphas = self.alphas[index] if self.alphas is not None else None
        self.sentences = [self.sentences[i] for i in keep]

    def _fields(self) -> tuple[Tensor | None, ...]:
        return self.scores, self.log_probs, self.lengths, self.tokens, self.alphas

    def tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor the store holds, the count included (what a CUDA graph writes)."""
        return (*self._fields(), self.count)

    def _row(self, row: int) -> tuple[Tensor | None, ...]:
        return tuple(field[row] if field is not None else None for field in self._fields())

    def hypotheses(
        self, n_best: int
    ) -> list[tuple[list[float], list[float], list[list[int]], list[Tensor] | None]]:
        """Per sentence of the batch, in its first order: the ``n_best`` best scores,
        log-probabilities, token lists and attention ((length, S) each, or None), fewer
        where fewer finished; the rows still held are copied to the host once."""
        held = [_to_host(field) for field in self._fields()]
        for row, sentence in enumerate(self.sentences):
            self.archive[sentence] = tuple(f[row] if f is not None else None for f in held)
        out = []
        for sentence in range(len(self.archive)):
            scores, log_probs, lengths, tokens, alphas = self.archive[sentence]
            assert scores is not None and log_probs is not None
            assert lengths is not None and tokens is not None
            found = int(torch.isfinite(scores[:n_best]).sum())
            kept = lengths[:found].tolist()
            token_rows = tokens[:found].tolist()
            out.append(
                (
                    scores[:found].tolist(),
                    log_probs[:found].tolist(),
                    [row[: n - 1] for row, n in zip(token_rows, kept, strict=True)],
                    [alphas[f, :n] for f, n in enumerate(kept)] if alphas is not None else None,
                )
            )
        return out


def _to_host(field: Tensor | None) -> Tensor | None:
    """A field in host memory, always a copy, since a CUDA graph kept for later batches
    writes its tensors again (``nmt.decoding.captured``)."""
    return field.to("cpu", copy=True) if field is not None else None


def _both(kept: Tensor, new: Tensor, order: Tensor) -> tuple[Tensor, Tensor]:
    """kept (B, F, W, ...) followed by new (B, K, W, ...), and the index (B, F, W, ...)
    that gathers the rows ``order`` (B, F) of it."""
    both = torch.cat([kept, new], dim=1)  # (B, F+K, W, ...)
    index = order.view(*order.shape, *([1] * (both.dim() - 2))).expand(-1, -1, *both.shape[2:])
    return both, index


class DoneFlag:
    """Whether every sentence is done, read without waiting for the device: on a GPU each
    step's flag is copied into pinned host memory behind an event, and the newest copy whose
    event has completed is read, so the loop may run a step or two past the end; on a CPU,
    where nothing runs ahead, the flag is read at once."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Tensor]] = []  # (event, host copy), oldest first

    def all_done(self, done: Tensor) -> bool:
        """Queue this step's flag (done: (B,) bool); -> whether a flag read says all are."""
        if not self.cuda:
            return bool(done.all())
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(done.all(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((event, flag))
        while self.pending and self.pending[0][0].query():
            _, oldest = self.pending.pop(0)
            if bool(oldest):
                return True
        return False
