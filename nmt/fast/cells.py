"""One time step of an ``nn.GRU`` / ``nn.LSTM`` written from matmuls and elementwise ops: the
step a CUDA graph can capture (``nmt.fast.graphs``).

A step-by-step decoder calls its RNN once per target position. Through the module, CUDA runs
each call as a cuDNN RNN, which a captured graph cannot be relied on to hold and which costs
several launches for one step. Here each layer is two matmuls and its gates, with the module's
own parameters (same names, same checkpoints), so the step is the module's to float
tolerance (tests/fast/test_cells.py checks it in float64):

    GRU:  r = sigma(W_ir x + b_ir + W_hr h + b_hr)      z = sigma(W_iz x + b_iz + W_hz h + b_hz)
          n = tanh(W_in x + b_in + r * (W_hn h + b_hn))  h' = (1 - z) * n + z * h
    LSTM: i, f, g, o = sigma, sigma, tanh, sigma of (W_i. x + b_i. + W_h. h + b_h.)
          c' = f * c + i * g                             h' = o * tanh(c')

Between stacked layers the module's dropout applies in training. Under autocast the matmuls
run in the autocast dtype and the gates and states in the parameters' dtype, as in the CPU
training path (``nmt.fast.recurrence``).

Search steps through here too (``input_gate_table``): a decoder's first layer reads the embedding
of the previous piece y, alone or beside a context or the fed-back state, so the embedding's
part of its input gates is one of V vectors,

    T_y = W_i[:, :E] E_y + b_i        (T: (V, G*H), made once from the weights)

and a step looks T_y up, then multiplies only the rest of its input (nothing for Luong
without input feeding). It halves the matmuls of a 256-unit GRU step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.fast import compiled, sinks
from nmt.runtime import compute_dtype

RNNState = Tensor | tuple[Tensor, Tensor]


def rnn_step(
    rnn: nn.RNNBase,
    inputs: Tensor | None,
    state: RNNState,
    first_gates: Tensor | None = None,
    native: bool = False,
    hidden_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
    input_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
) -> tuple[Tensor, RNNState]:
    """One step of a unidirectional batch-first ``nn.GRU``/``nn.LSTM``: inputs (B, 1, I),
    state (L, B, H) (a tuple (h, c) for an LSTM) -> output (B, 1, H), the next state, as the
    module's call on one position returns them. With ``first_gates`` (B, G*H), the first
    layer's input gates of its first I - I' inputs with their bias (``input_gate_table``, or
    ``TeacherSteps``), inputs are the last I' (B, 1, I') alone, or None where I' = 0. With
    ``native`` (a pass without gradients), each layer's gates go through one compiled kernel
    (``compiled.rnn_cell``) where it can take them, not about ten torch ops. ``hidden_products``:
    each layer's h -> h W_hh^T + b_hh where the caller has it prepared
    (``fast.packed.StepProducts``, ``TeacherSteps``), else multiplied here;
    ``input_products``: each layer's x -> x W_ih^T (+ b_ih past the first layer; the first
    layer's columns after the looked-up ones, without a bias, where ``first_gates`` is given)
    likewise. On a GPU each layer's gates are torch's fused cell (``cell_gates``)."""
    if rnn.bidirectional or getattr(rnn, "proj_size", False):
        raise ValueError("rnn_step: a unidirectional RNN without projections")
    hidden, cell = state if isinstance(state, tuple) else (state, None)
    weights: torch.dtype = cast(Tensor, rnn.weight_hh_l0).dtype
    device = hidden.device.type
    # a search step on a CPU runs this once per target position for a few hundred
    # microseconds of arithmetic: each op and lookup here costs a measurable share, so autocast is turned off only where it is on, and a layer's
    # weights are read only where it multiplies by them
    autocast = torch.is_autocast_enabled(device)
    compute = torch.get_autocast_dtype(device) if autocast else weights
    x = inputs.squeeze(1) if inputs is not None else None
    hiddens, cells = [], []
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        for layer in range(rnn.num_layers):
            # one layer's state as a view: its gradient then flows back without the zeros
            # and copy a selected row's backward makes
            h = (hidden.squeeze(0) if rnn.num_layers == 1 else hidden[layer]).to(weights)
            if layer == 0 and first_gates is not None:
                gates_x = first_gates
                if x is not None and input_products is not None:
                    gates_x = torch.add(gates_x, input_products[0](x))
                elif x is not None:  # the inputs after the looked-up ones
                    w_ih = cast(Tensor, rnn.weight_ih_l0)
                    rest = w_ih[:, w_ih.size(1) - x.size(-1) :]
                    gates_x = gates_x + _product(x, rest, None, compute, weights)
            elif input_products is not None:
                assert x is not None
                gates_x = input_products[layer](x)
            else:
                assert x is not None
                w_ih, b_ih = (
                    getattr(rnn, f"weight_ih_l{layer}"),
                    getattr(rnn, f"bias_ih_l{layer}", None),
                )
                gates_x = _product(x, w_ih, b_ih, compute, weights)  # (B, G*H)
            if hidden_products is not None:
                gates_h = hidden_products[layer](h)
            else:
                w_hh, b_hh = (
                    getattr(rnn, f"weight_hh_l{layer}"),
                    getattr(rnn, f"bias_hh_l{layer}", None),
                )
                gates_h = _product(h, w_hh, b_hh, compute, weights)
            c = cell[layer].to(weights) if cell is not None else None
            done = compiled.rnn_cell(gates_x, gates_h, h, c) if native else None
            h, c = done if done is not None else cell_gates(gates_x, gates_h, h, c)
            if c is not None:
                cells.append(c)
            hiddens.append(h)
            x = h
            if layer < rnn.num_layers - 1 and rnn.training and rnn.dropout > 0:
                x = F.dropout(x, rnn.dropout, True)
    next_state: RNNState = _stacked(hiddens) if c is None else (_stacked(hiddens), _stacked(cells))
    return hiddens[-1].unsqueeze(1), next_state


def _stacked(layers: list[Tensor]) -> Tensor:
    """Each layer's (B, H) -> (L, B, H): one layer's as a view, without a copy."""
    return layers[0].unsqueeze(0) if len(layers) == 1 else torch.stack(layers)


def _product(
    x: Tensor, weight: Tensor, bias: Tensor | None, compute: torch.dtype, out: torch.dtype
) -> Tensor:
    """x W^T + b, the product in ``compute``, the sum in ``out``."""
    if bias is not None and compute == out == x.dtype == weight.dtype == bias.dtype:
        return torch.addmm(bias, x, weight.t())  # the bias in the matmul's own pass
    product = x.to(compute) @ weight.to(compute).t()
    product = product.to(out)
    return product + bias if bias is not None else product


def cell_gates(
    gates_x: Tensor, gates_h: Tensor, h: Tensor, c: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """One layer's gates (B, G*H), the input's and the hidden state's with their biases,
    -> h' (and c' for an LSTM): on a GPU as torch's fused cell, the kernel ``nn.GRUCell`` and
    ``nn.LSTMCell`` take there (one kernel forward and one backward instead of about ten
    element-wise ops each way, which a step-by-step decoder runs at every target position),
    else as ``gru_gates``/``lstm_gates``. The fused cell's equations are the same
    (tests/fast/test_cells.py checks its call against them)."""
    if fused_cells(h, gates_x, gates_h, c):
        if c is None:
            return FUSED_GRU(gates_x, gates_h, h)[0], None
        h, c, _ = FUSED_LSTM(gates_x, gates_h, c)
        return h, c
    if c is not None:
        return lstm_gates(gates_x + gates_h, c)
    return gru_gates(gates_x, gates_h, h), None


FUSED_GRU = torch.ops.aten._thnn_fused_gru_cell  # (B, 3H) x2, h -> h', its workspace
FUSED_LSTM = torch.ops.aten._thnn_fused_lstm_cell  # (B, 4H) x2, c -> h', c', its workspace


def fused_cells(h: Tensor, *others: Tensor | None) -> bool:
    """Whether torch's fused cell takes these tensors: on a GPU, all of one dtype (it has
    no CPU kernel)."""
    return h.is_cuda and all(t is None or t.dtype == h.dtype for t in others)


def gru_gates(gates_x: Tensor, gates_h: Tensor, h: Tensor) -> Tensor:
    """The GRU cell's Python reference (the module docstring's equations): the input's and
    the hidden state's gates (B, 3H), h (B, H) -> h'."""
    x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
    h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return n + z * (h - n)  # (1 - z) n + z h


def lstm_gates(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """The LSTM cell's Python reference: the summed gates (B, 4H), c (B, H) -> h', c'."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


@dataclass
class TeacherSteps:
    """A teacher-forced unroll's products for ``rnn_step`` (``FastPaths.teacher_steps``):
    ``gates``, each position's first-layer input gates of its embedding with their bias
    (B, G*H), from one product over the whole target; ``inputs``, each layer's product by
    W_ih (the first layer's columns after the embedding's, without a bias; the others' with
    b_ih); ``hidden``, each layer's h W_hh^T + b_hh. The products are ``WeightSink``s:
    each weight is cast to the compute dtype once per batch, and its gradient (with its
    bias's) is one product over every step, not one small product, cast and sum per step."""

    gates: Sequence[Tensor]
    inputs: Sequence[Callable[[Tensor], Tensor]]
    hidden: Sequence[Callable[[Tensor], Tensor]]


def teacher_steps(rnn: nn.RNNBase, embedded: Tensor) -> TeacherSteps:
    """The ``TeacherSteps`` of a decoder's RNN whose first layer reads each position's
    embedding (B, T, E) first in its input (then a context or the fed-back state)."""
    w_ih = cast(Tensor, rnn.weight_ih_l0)
    weights, compute = w_ih.dtype, compute_dtype(embedded.device, w_ih.dtype)
    width = embedded.size(-1)
    rows = embedded.reshape(-1, width)  # (B*T, E)
    with torch.autocast(embedded.device.type, enabled=False):
        gates = _product(rows, w_ih[:, :width], getattr(rnn, "bias_ih_l0", None), compute, weights)
    positions = gates.view(*embedded.shape[:2], -1).unbind(1)  # T x (B, G*H)
    inputs: list[Callable[[Tensor], Tensor]] = [sinks.WeightSink(w_ih[:, width:]).linear]
    hidden: list[Callable[[Tensor], Tensor]] = []
    for layer in range(rnn.num_layers):
        if layer > 0:
            inputs.append(_layer_sink(rnn, "ih", layer))
        hidden.append(_layer_sink(rnn, "hh", layer))
    return TeacherSteps(positions, inputs, hidden)


def _layer_sink(rnn: nn.RNNBase, kind: str, layer: int) -> Callable[[Tensor], Tensor]:
    """x -> x W^T + b through a sink, for a layer's W_ih or W_hh (``kind``) and its bias."""
    weight = cast(Tensor, getattr(rnn, f"weight_{kind}_l{layer}"))
    return sinks.WeightSink(weight, getattr(rnn, f"bias_{kind}_l{layer}", None)).linear


TABLE_LIMIT = 1 << 26  # the largest table of input gates, in values (256 MB in float32)


def input_gate_table(embed: nn.Embedding, rnn: nn.RNNBase) -> Tensor | None:
    """The table T (V, G*H) of a decoder's first RNN layer's input gates of the embedding
    (see the module docstring), without gradient, in the weights' dtype; None where it would
    hold more than TABLE_LIMIT values (the encoder's: ``recurrence.gate_table``). Whoever
    holds it must make it again when the weights change (a Translator's models are fixed)."""
    weight: Tensor = embed.weight
    w_ih = cast(Tensor, rnn.weight_ih_l0)
    bias: Tensor | None = getattr(rnn, "bias_ih_l0", None)
    if weight.size(0) * w_ih.size(0) > TABLE_LIMIT:
        return None
    with torch.no_grad():
        table = weight @ w_ih[:, : weight.size(1)].t()  # (V, G*H)
        return table + bias if bias is not None else table
