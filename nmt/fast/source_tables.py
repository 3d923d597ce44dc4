"""The encoder's RNN in search on a CPU: the first layer's input gates looked up, the
recurrence run through compiled kernels.

The encoder reads each source piece x_j through its first RNN layer's input gates
W_i E_x + b_i, one product per position and direction. With the weights fixed (a Translator's
models) that is one of V vectors per direction,

    T^d_x = W^d_i E_x + b^d_i        (T^d: (V, G*H), made once from the weights)

so search looks the gates up and multiplies only the recurrence, W^d_h h + b^d_h, at each step:
half the matmuls of a one-layer encoder (``fast.cells`` does the same for the decoder's first
layer). A later layer's inputs are the layer below's outputs, multiplied as before, all steps
at once.

The recurrence runs as the packed module runs it: the sentences sorted longest first, step t
of a direction steps only the sentences that have a t-th token (a prefix of the rows), and the
backward direction reads each sentence from its own last token. So padding never enters it,
outputs past each sentence's end are zero and the final state is the state at its last token,
as ``nn.GRU``/``nn.LSTM`` over a packed sequence give them (``tests/fast/test_source_tables.py``
checks it against float64).

Each direction runs its whole loop over time in one compiled call (``compiled.rnn_direction``):
each step reads its gates from the table at the positions it steps, multiplies by W_h
transposed through MKL's sgemm as torch.addmm would (the same bits), and writes its states
straight into the layer's outputs in time order. So the tables are made only where that call
runs: ``native``, torch's CPU library carrying MKL (``compiled.blas_sgemm``: the x86 builds),
float32; elsewhere search reads the source through the packed module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from nmt.fast import cells, compiled
from nmt.fast.packed import Product


@dataclass
class SourceTables:
    """What search reads a source with, made once for fixed weights (``source_tables``):
    ``gates`` (D, V, G*H), the first layer's input gates of every source piece per
    direction; ``inputs``, each later layer's input product per direction (x -> W_i x + b_i);
    ``hidden``, each layer's recurrent product per direction (h -> W_h h + b_h)."""

    gates: Tensor
    inputs: list[list[Product]]  # (L - 1) x D
    hidden: list[list[Product]]  # L x D
    lstm: bool

    def weights(self) -> list[Tensor]:
        """Every tensor the tables hold."""
        products = [p for layer in (*self.inputs, *self.hidden) for p in layer]
        return [self.gates, *(p.weight for p in products)]

    def run(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        """src (B, S) ids, lengths (B,) -> outputs (B, S, D*H), zero past each end, and the
        final state (L*D, B, H) (a tuple (h, c) for an LSTM) at each sentence's last token,
        as the packed module returns them."""
        order = torch.argsort(lengths, descending=True, stable=True)  # (B,) longest first
        unsorted = not bool(torch.equal(order, torch.arange(order.numel())))
        if unsorted:
            src, lengths = src.index_select(0, order), lengths.index_select(0, order)
        outputs, hidden, cell = self._in_one_call(src, lengths)
        if unsorted:
            restore = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
            outputs = outputs.index_select(0, restore)
            hidden = hidden.index_select(1, restore)
            cell = cell.index_select(1, restore) if cell is not None else None
        return outputs, ((hidden, cell) if cell is not None else hidden)

    def _in_one_call(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``run`` over sorted rows, each direction's loop over time in one compiled call
        (``compiled.rnn_direction``: the gates read from the table, or a later layer's input
        products, at each step's positions; the states written at theirs)."""
        batch, steps = src.shape
        size = self.hidden[0][0].weight.size(1)  # H
        ids, lengths = src.contiguous(), lengths.to(torch.int64).contiguous()
        finals: list[Tensor] = []
        cells_out: list[Tensor] = []
        outputs = torch.empty(0)
        for layer, products in enumerate(self.hidden):
            inputs, outputs = outputs, torch.empty(batch, steps, len(products) * size)
            for d, product in enumerate(products):
                h, c = torch.empty(batch, size), torch.empty(batch, size) if self.lstm else None
                table = self.gates[d] if layer == 0 else None
                gates_x = None  # a later layer's input gates (B, S, G*H)
                if layer > 0:
                    gates_x = self.inputs[layer - 1][d](inputs).contiguous()
                direction = compiled.Direction(
                    table, ids, gates_x, product.transposed(), product.bias, backward=d == 1
                )
                half = outputs[..., d * size : (d + 1) * size]
                ran = compiled.rnn_direction(direction, lengths, half, h, c)
                assert ran, "source_tables makes the tables only where the call runs"
                finals.append(h)
                if c is not None:
                    cells_out.append(c)
        return outputs, torch.stack(finals), torch.stack(cells_out) if self.lstm else None


def _product(weight: Tensor, bias: Tensor | None) -> Product:
    """x -> x W^T + b by W transposed and contiguous: the matmul library's own kernels, which
    ran the encoder's steps faster than oneDNN's prepared layout at every batch size measured.
    The decoder's steps keep the prepared layout for the bits it gives
    each row whatever rows are with it (``fast.packed``); the encoder runs once per batch,
    before any row is dropped."""
    return Product(weight, prepared=False, bias=bias)


def source_tables(embed: nn.Embedding, rnn: nn.RNNBase, native: bool = True) -> SourceTables | None:
    """The tables of an encoder's embedding and RNN on a CPU, without gradient (a
    Translator's search makes them). None where ``SourceTables.run``'s compiled call cannot
    run them (not ``native``: ``FastPaths.native_kernels``; no compiled library or MKL sgemm;
    not float32), where the RNN is not a batch-first GRU/LSTM without projections on a CPU in
    the embedding's dtype, or where a table would hold more than ``cells.TABLE_LIMIT`` values
    (``cells.input_gate_table`` makes each direction's).
    Whoever holds them makes them again when the weights change (a Translator's models are
    fixed)."""
    weight: Tensor = embed.weight
    if not native or compiled.library() is None or compiled.blas_sgemm() is None:
        return None
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not isinstance(rnn, (nn.GRU, nn.LSTM))
        or not rnn.batch_first
        or rnn.proj_size > 0
        or next(rnn.parameters()).dtype != weight.dtype
    ):
        return None
    names = ["", "_reverse"][: 2 if rnn.bidirectional else 1]
    tables = [cells.input_gate_table(embed, rnn, name) for name in names]  # each (V, G*H)
    if any(table is None for table in tables):  # over cells.TABLE_LIMIT
        return None

    def params(layer: int, kind: str) -> list[tuple[Tensor, Tensor | None]]:
        return [
            (
                getattr(rnn, f"weight_{kind}_l{layer}{name}"),
                getattr(rnn, f"bias_{kind}_l{layer}{name}", None),
            )
            for name in names
        ]

    layers = range(rnn.num_layers)
    inputs = [[_product(w, b) for w, b in params(layer, "ih")] for layer in layers[1:]]
    hidden = [[_product(w, b) for w, b in params(layer, "hh")] for layer in layers]
    gates = torch.stack(cast(list[Tensor], tables))  # (D, V, G*H)
    return SourceTables(gates, inputs, hidden, isinstance(rnn, nn.LSTM))
