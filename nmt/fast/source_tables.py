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
checks it in float64).

Where ``native`` and torch's CPU library carries MKL (``compiled.blas_sgemm``), each direction
runs its whole loop over time in one compiled call (``compiled.rnn_direction``): each step
reads its gates from the table at the positions it steps, multiplies by W_h transposed
through MKL's sgemm as torch.addmm would (the same bits), and writes its states straight into
the layer's outputs in time order. Elsewhere each step multiplies by W_h transposed here
(``_product``) and takes the gates through one compiled kernel (``compiled.cell_steps``, where
``native``; else torch ops).
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
    ``hidden``, each layer's recurrent product per direction (h -> W_h h + b_h); ``native``:
    whether the gates go through the compiled kernels (``FastPaths.native_kernels``)."""

    gates: Tensor
    inputs: list[list[Product]]  # (L - 1) x D
    hidden: list[list[Product]]  # L x D
    lstm: bool
    native: bool = True

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
        found = self._in_one_call(src, lengths) if self.native else None
        outputs, hidden, cell = found if found is not None else self._stepped(src, lengths)
        if unsorted:
            restore = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
            outputs = outputs.index_select(0, restore)
            hidden = hidden.index_select(1, restore)
            cell = cell.index_select(1, restore) if cell is not None else None
        return outputs, ((hidden, cell) if cell is not None else hidden)

    def _in_one_call(
        self, src: Tensor, lengths: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """``run`` over sorted rows, each direction's loop over time in one compiled call
        (``compiled.rnn_direction``: the gates read from the table, or a later layer's input
        products, at each step's positions; the states written at theirs), or None where
        that cannot run (no MKL sgemm, or not float32)."""
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
                if not compiled.rnn_direction(direction, lengths, half, h, c):
                    return None
                finals.append(h)
                if c is not None:
                    cells_out.append(c)
        return outputs, torch.stack(finals), torch.stack(cells_out) if self.lstm else None

    def _stepped(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``run`` over sorted rows, step by step: each step's recurrent product here, its
        gates through ``compiled.cell_steps`` (native) or torch ops."""
        steps = src.size(1)
        positions = torch.arange(steps)
        real = positions[None, :] < lengths[:, None]  # (B, S)
        back = (lengths[:, None] - 1 - positions[None, :]).clamp(min=0)  # (B, S) backward read
        counts = real.sum(0).tolist()  # rows stepped at each step (a prefix: longest first)
        ids = [src.t()]  # (S, B) each direction's in its loop order
        if self.gates.size(0) == 2:
            ids.append(src.gather(1, back).t())
        gates = [
            t.index_select(0, i.reshape(-1)).view(*i.shape, -1)
            for t, i in zip(self.gates, ids, strict=True)
        ]
        finals: list[Tensor] = []
        cells_out: list[Tensor] = []
        outputs = torch.empty(0)
        for layer, products in enumerate(self.hidden):
            if layer > 0:
                gates = _loop_order(
                    [p(outputs) for p in self.inputs[layer - 1]], back
                )  # each (S, B, G*H)
            states = [self._direction(g, p, counts) for g, p in zip(gates, products, strict=True)]
            outputs = _time_order([h for h, _ in states], back, real)  # (B, S, D*H)
            for h, c in states:  # each sentence's state after its last step
                finals.append(_at_last(h, lengths))
                if c is not None:
                    cells_out.append(_at_last(c, lengths))
        return outputs, torch.stack(finals), torch.stack(cells_out) if self.lstm else None

    def _direction(
        self, gates: Tensor, product: Product, counts: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """One direction through time: gates (S, B, G*H) in loop order -> the states after
        each step (S, B, H), zero where a sentence has no step (and the LSTM's cells)."""
        steps, batch, width = gates.shape
        hidden_size = width // (4 if self.lstm else 3)
        h_all = gates.new_zeros(steps, batch, hidden_size)
        c_all = torch.zeros_like(h_all) if self.lstm else None
        kernels = compiled.cell_steps(gates, h_all, c_all) if self.native else None
        h = gates.new_zeros(batch, hidden_size)
        c = torch.zeros_like(h) if self.lstm else None
        for t, rows in enumerate(counts):
            if rows == 0:  # no sentence is this long (nor longer: longest first)
                break
            h = h[:rows]
            if kernels is not None:
                kernels.step(t, rows, product(h))
                h = h_all[t, :rows]
                continue
            c = c[:rows] if c is not None else None
            h_next, c_next = h_all[t, :rows], c_all[t, :rows] if c_all is not None else None
            _cell(gates[t, :rows], product(h), h, c, h_next, c_next)
            h, c = h_next, c_next
        return h_all, c_all


def _cell(
    gates_x: Tensor,
    gates_h: Tensor,
    h: Tensor,
    c: Tensor | None,
    h_out: Tensor,
    c_out: Tensor | None,
) -> None:
    """One step's gates into h_out (and c_out) as torch ops (where no compiled kernel runs)."""
    if c is None:
        h_out.copy_(cells.gru_gates(gates_x, gates_h, h))
        return
    assert c_out is not None
    h_new, c_new = cells.lstm_gates(gates_x + gates_h, c)
    h_out.copy_(h_new)
    c_out.copy_(c_new)


def _at_last(states: Tensor, lengths: Tensor) -> Tensor:
    """(S, B, H) states after each step, lengths (B,) -> (B, H) each row's after its last."""
    last = (lengths - 1)[None, :, None].expand(1, *states.shape[1:])  # (1, B, H)
    return states.gather(0, last)[0]


def _loop_order(gates: list[Tensor], back: Tensor) -> list[Tensor]:
    """Each direction's (B, S, F) in time order -> (S, B, F) in its loop order (the backward
    direction from each sentence's last token, ``back`` (B, S))."""
    forward = gates[0].transpose(0, 1).contiguous()
    if len(gates) == 1:
        return [forward]
    index = back[..., None].expand(*back.shape, gates[1].size(-1))
    return [forward, gates[1].gather(1, index).transpose(0, 1).contiguous()]


def _time_order(states: list[Tensor], back: Tensor, real: Tensor) -> Tensor:
    """Each direction's states (S, B, H) in loop order -> the layer's outputs (B, S, D*H) in
    time order, zero past each end (the forward direction's already are)."""
    parts = [states[0].transpose(0, 1)]
    if len(states) == 2:
        backward = states[1].transpose(0, 1)  # (B, S, H), step t at position len - 1 - t
        index = back[..., None].expand(*back.shape, backward.size(-1))
        parts.append(backward.gather(1, index) * real[..., None])
    return torch.cat(parts, dim=-1)


def _product(weight: Tensor, bias: Tensor | None) -> Product:
    """x -> x W^T + b by W transposed and contiguous: the matmul library's own kernels, which
    ran the encoder's steps faster than oneDNN's prepared layout at every batch size measured
    (docs/benchmarks.md). The decoder's steps keep the prepared layout for the bits it gives
    each row whatever rows are with it (``fast.packed``); the encoder runs once per batch,
    before any row is dropped."""
    return Product(weight, prepared=False, bias=bias)


def source_tables(embed: nn.Embedding, rnn: nn.RNNBase, native: bool = True) -> SourceTables | None:
    """The tables of an encoder's embedding and RNN on a CPU, without gradient (a
    Translator's search makes them in float32; the tests' references in float64); ``native``:
    ``SourceTables.native``. None where the RNN is not a batch-first GRU/LSTM without
    projections on a CPU in the embedding's dtype, or a table would hold more than
    ``cells.TABLE_LIMIT`` values (``cells.input_gate_table`` makes each direction's).
    Whoever holds them makes them again when the weights change (a Translator's models are
    fixed)."""
    weight: Tensor = embed.weight
    if (
        weight.device.type != "cpu"
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
    return SourceTables(gates, inputs, hidden, isinstance(rnn, nn.LSTM), native)
