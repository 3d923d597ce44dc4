"""An LSTM layer over a whole sequence as one autograd function (nmt.fast.recurrence), and its
steps through the compiled kernels.

Torch's equations and gate order (s the logistic sigmoid):

    i, f, g, o = s, s, tanh, s (W_i* x + b_i* + W_h* h + b_h*)
    c' = f * c + i * g                                  h' = o * tanh(c')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmt.fast import layer
from nmt.fast.layer import Grads, Record, StepKernel


@dataclass
class LSTMRecord(Record):
    """The LSTM's part of the record (nmt.fast.layer)."""

    c0: Tensor  # (D, B, H)
    gates: Tensor  # (D, T, B, 4H): i, f, g, o
    tanh_c: Tensor  # (D, T, B, H): tanh(c')
    cells: Tensor  # (D, T, B, H): c after each step

    def c_before(self, t: int) -> Tensor:
        """c before step t (D, B, H)."""
        return self.c0 if t == 0 else self.cells[:, t - 1]


class LSTMLayer(torch.autograd.Function):
    """One LSTM layer, all directions: inputs (B, T, I), h0 and c0 (D, B, H), weights (w_ih,
    w_hh, b_ih, b_hh) stacked over directions -> outputs (B, T, D*H), h_n, c_n (D, B, H)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        loop: layer.Loop,
        inputs: Tensor | None,
        h0: Tensor,
        c0: Tensor,
        *weights: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        w_ih, w_hh, b_ih, b_hh = weights
        keep, compute = loop.keep, loop.compute
        directions, gate_size, hidden = w_hh.shape
        w_i, w_h = w_ih.to(compute), w_hh.to(compute)  # (D, 4H, I), (D, 4H, H)
        bias = layer.input_bias(b_ih, b_hh, gru=False)
        x, gates_in = layer.inputs_and_gates(loop, inputs, w_i, bias)  # (D, T, B, I / 4H)
        _, steps, batch, _ = x.shape
        record = LSTMRecord(
            x,
            keep,
            h0,
            w_i,
            w_h,
            *layer.state_buffers(h0, steps, compute),
            c0=c0,
            gates=h0.new_empty(directions, steps, batch, gate_size),
            tanh_c=h0.new_empty(directions, steps, batch, hidden),
            cells=h0.new_empty(directions, steps, batch, hidden),
        )
        layer.run_forward(LSTMSteps(record, None), gates_in, record)
        layer.keep_for_backward(ctx, record, loop, inputs, w_hh)
        h_n, c_n = record.states[:, -1].clone(), record.cells[:, -1].clone()
        return layer.time_order(record.states, keep), h_n, c_n

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_outputs: Tensor, grad_h: Tensor | None, grad_c: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        record = LSTMRecord(*ctx.saved_tensors)
        grads = layer.start_grads(grad_outputs, grad_h, record, ctx.compute)
        grads.dc = layer.last_grad(grad_c, record.c0)
        dh0, dc0 = layer.run_backward(LSTMSteps(record, grads), grads, record)
        input_grads = functools.partial(_input_grads, record.w_i)
        grad_x, *grad_weights = layer.gradients(ctx, record, grads.gates, input_grads)
        return None, grad_x, dh0, dc0, *grad_weights


def _input_grads(w_i: Tensor, x: Tensor, grad_rec: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (D, T*B, I) and the gate gradients (D, T*B, 4H) -> the gradients at x, W_i and b_i:
    W_i x + b_i and W_h h + b_h enter the gates alike."""
    grad_w_ih = torch.bmm(grad_rec.transpose(1, 2), x)
    grad_x = torch.bmm(grad_rec, w_i)  # (D, T*B, I)
    return grad_x, grad_w_ih, grad_rec.sum(1)


class LSTMSteps(StepKernel):
    """The LSTM's steps as kernels.c's nmt_lstm_forward and nmt_lstm_backward, for one pass
    (grads None in the forward pass)."""

    record: LSTMRecord

    def __init__(self, record: LSTMRecord, grads: Grads | None):
        super().__init__(record, grads)
        directions, batch, hidden = record.h0.shape
        # the step's matmul output, W_i x + b_i + W_h h + b_h (D, B, 4H) in the matmul dtype
        self._pre = record.prev.new_empty(directions, batch, 4 * hidden)

    @property
    def dc(self) -> Tensor:
        assert self.grads.dc is not None
        return self.grads.dc

    def pre(self, t: int) -> Tensor:
        return self._pre

    def forward(self, t: int, keep: Tensor | None, prev_out: Tensor | None) -> None:
        record = self.record
        self.kernels.run(
            "lstm_forward",
            self._pre,
            record.c_before(t),
            record.h_before(t),
            keep,
            record.gates[:, t],
            record.tanh_c[:, t],
            record.cells[:, t],
            record.states[:, t],
            prev_out,
        )

    def backward(self, t: int, keep: Tensor | None, recurrent: Tensor) -> None:
        record = self.record
        gates, tanh_c, c_prev = record.gates[:, t], record.tanh_c[:, t], record.c_before(t)
        cell = self.dc, gates, tanh_c, c_prev, self.grads.gates[:, t]
        self.compiled_backward("lstm_backward", t, keep, recurrent, *cell)

    def initial_grads(self, recurrent: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.grads.dh.add_(recurrent), self.dc
