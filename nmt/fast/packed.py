"""Search's output layer on a CPU: W_o multiplied from a layout prepared once.

A search step multiplies tens to a few hundred rows of features by the output layer's W_o
(V x O): a product whose weight is thousands of rows long and whose rows are few. The matmul
library then spends much of each call rearranging W_o into the panels its kernel reads, step
after step, for a weight that does not change. oneDNN can do that rearrangement once
(``torch.ops.mkldnn._reorder_linear_weight``, what torch's own CPU inference compiler uses for
a frozen linear layer) and multiply from it (``_linear_pointwise``).

Measured on a 2-core AMD EPYC with AVX2 (docs/benchmarks.md), in-process at batch 64, by the
medians of alternated runs: greedy and beam 5 ran 1.08x and 1.13x faster over the demo
model's shortlist, 1.29x and 1.09x over the whole vocabulary. One row at a time (greedy at
batch 1) the prepared layout was slower than torch's matrix-vector product, so a single row
keeps the plain product. The round-off differs from the plain product's (a few 1e-6 in the
log-probabilities), as any other kernel's would; on that EPYC each row's result had the same
bits whatever the number of rows (1 to 63 checked).

``OutputProduct`` is what a Translator's ``StepTables.output`` holds; a shortlist takes its
rows (``columns``). Where oneDNN is missing, or for ``FastPaths.plain()``, it multiplies by
W_o transposed and contiguous, which the CPU's matmul library multiplies faster than W_o.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROWS_HINT = 64  # the rows oneDNN prepares the layout for; any count multiplies from it
MIN_ROWS = 2  # fewer rows take the plain product (a matrix-vector product)


def available() -> bool:
    """Whether this torch has oneDNN's prepared linear layers (CPU builds have)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class OutputProduct:
    """features (N, O) -> features W^T (N, V) for a fixed float32 CPU weight W (V, O).

    ``prepared``: multiply N >= MIN_ROWS rows from oneDNN's layout (made on first use),
    else by W^T made contiguous (on first use); only a float32 CPU weight is prepared (a
    float64 model, as the tests' references, multiplies plainly). Both are made at most once
    per object; two threads that make one at the same time each make a valid copy, and one
    is kept."""

    def __init__(self, weight: Tensor, prepared: bool):
        self.weight = weight.detach().contiguous()  # (V, O)
        self.prepared = prepared and self.weight.dtype == torch.float32 and not weight.is_cuda
        self._layout: Tensor | None = None  # oneDNN's
        self._transposed: Tensor | None = None  # (O, V)

    def __call__(self, features: Tensor) -> Tensor:
        if self.prepared and features.dim() == 2 and features.size(0) >= MIN_ROWS:
            layout = self._layout
            if layout is None:
                layout = torch.ops.mkldnn._reorder_linear_weight(self.weight, ROWS_HINT)
                self._layout = layout
            return torch.ops.mkldnn._linear_pointwise(
                features.contiguous(), layout, None, "none", [], ""
            )
        transposed = self._transposed
        if transposed is None:
            transposed = self._transposed = self.weight.t().contiguous()
        return features @ transposed

    def columns(self, index: Tensor) -> OutputProduct:
        """The product over the outputs ``index`` (V',) alone: a shortlist's."""
        return OutputProduct(self.weight.index_select(0, index), self.prepared)
