"""Search's products by fixed weights on a CPU: each weight multiplied from a layout prepared
once.

A search step multiplies tens to a few hundred rows by weights that do not change: the output
layer's W_o (V x O), thousands of rows long, and the decoder's W_hh and Luong's W_c. The
matmul library then spends much of each call rearranging the weight into the panels its
kernel reads, step after step. oneDNN can do that rearrangement once
(``torch.ops.mkldnn._reorder_linear_weight``, what torch's own CPU inference compiler uses for
a frozen linear layer) and multiply from it (``_linear_pointwise``).

One row at a time (greedy at batch 1) the prepared layout is slower than torch's
matrix-vector product, so a single row keeps the plain product. The round-off differs from
the plain product's (a few 1e-6 in the log-probabilities), as any other kernel's would.

``Product`` is what a Translator's ``StepTables`` hold: ``output`` (a shortlist takes its rows,
``columns``) and ``StepProducts`` for the decoder's step. Where oneDNN is missing, or for
``FastPaths.plain()``, a product multiplies by the weight transposed and contiguous, which the
CPU's matmul library multiplies faster than the weight itself.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class Product:
    """x (..., I) -> x W^T + b (..., O) for a fixed float32 CPU weight W (O, I) and bias b
    (O,) or None.

    ``prepared``: multiply N >= MIN_ROWS rows from oneDNN's layout (made on first use),
    else by W^T made contiguous (on first use); only a float32 CPU weight is prepared (a
    float64 model, as the tests' references, multiplies plainly). Both are made at most once
    per object; two threads that make one at the same time each make a valid copy, and one
    is kept."""

    def __init__(self, weight: Tensor, prepared: bool, bias: Tensor | None = None):
        self.weight = weight.detach().contiguous()  # (O, I)
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.prepared = prepared and self.weight.dtype == torch.float32 and not weight.is_cuda
        self._layout: Tensor | None = None  # oneDNN's
        self._transposed: Tensor | None = None  # (I, O)

    def __call__(self, x: Tensor) -> Tensor:
        # oneDNN's product and the plain one without a bias take x (..., I) as it is: a
        # search step's (N, 1, I) costs no reshape and view around them
        rows = x.numel() // x.size(-1)
        if self.prepared and rows >= MIN_ROWS and x.dtype == torch.float32:
            layout = self._layout
            if layout is None:
                layout = torch.ops.mkldnn._reorder_linear_weight(self.weight, ROWS_HINT)
                self._layout = layout
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), layout, self.bias, "none", [], ""
            )
        if self.bias is None:
            return x @ self.transposed()
        if x.dim() == 2:
            return torch.addmm(self.bias, x, self.transposed())
        out = torch.addmm(self.bias, x.reshape(rows, x.size(-1)), self.transposed())
        return out.view(*x.shape[:-1], -1)

    def transposed(self) -> Tensor:
        """W^T (I, O), contiguous, what the plain product multiplies by: made on first use."""
        transposed = self._transposed
        if transposed is None:
            transposed = self._transposed = self.weight.t().contiguous()
        return transposed

    def columns(self, index: Tensor) -> Product:
        """The product over the outputs ``index`` (O',) alone: a shortlist's."""
        bias = self.bias.index_select(0, index) if self.bias is not None else None
        return Product(self.weight.index_select(0, index), self.prepared, bias)


@dataclass
class StepProducts:
    """A decoder's products by its fixed weights at a search step: ``hidden``, each RNN
    layer's h W_hh^T + b_hh; ``combine``, Luong's W_c [c_t; h_t], and ``combine_hidden``, its
    W_ch h_t alone (over a folded memory, ``LuongDecoder.for_search``); None where the decoder
    has no such product."""

    hidden: list[Product]
    combine: Product | None = None
    combine_hidden: Product | None = None

    def all(self) -> list[Product]:
        """Every product held, ``hidden`` first."""
        extra = [p for p in (self.combine, self.combine_hidden) if p is not None]
        return [*self.hidden, *extra]
