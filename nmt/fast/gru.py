"""A GRU layer over a whole sequence as one autograd function (nmt.fast.recurrence), and its
steps through the compiled kernels.

Torch's equations and gate order (s the logistic sigmoid):

    r = s(W_ir x + b_ir + W_hr h + b_hr)      z = s(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))      h' = (1 - z) * n + z * h

The step's matmul forms a = (W_hr h + W_ir x + b_r, W_hz h + W_iz x + b_z, W_hn h + b_hn); the
input part of n, n_in = W_in x + b_in, is kept apart in float32, since r scales W_hn h + b_hn
but not W_in x + b_in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from nmt.fast import layer
from nmt.fast.layer import Record, StepKernel


@dataclass
class GRURecord(Record):
    """The GRU's part of the record (nmt.fast.layer)."""

    pre: Tensor  # (T, D, B, 3H), the step's matmul output a (see above) in the matmul dtype:
    # laid out so that the matmul writes it in place; the backward pass takes r and z from it
    # again, which costs less than storing them in float32
    n: Tensor  # (D, T, B, H)
    n_in: Tensor | None  # (D, T, B, H) W_in x + b_in, for the forward steps (not kept)


class GRULayer(torch.autograd.Function):
    """One GRU layer, all directions: inputs (B, T, I), h0 (D, B, H), weights (w_ih, w_hh, b_ih,
    b_hh) stacked over directions -> outputs (B, T, D*H), h_n (D, B, H)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, loop: layer.Loop, inputs: Tensor | None, h0: Tensor, *weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        w_ih, w_hh, b_ih, b_hh = weights
        keep, compute = loop.keep, loop.compute
        directions, _, hidden = w_hh.shape
        w_i, w_h = w_ih.to(compute), w_hh.to(compute)  # (D, 3H, I), (D, 3H, H)
        bias = layer.input_bias(b_ih, b_hh, gru=True)  # (D, 3H)
        x, gates_in = layer.inputs_and_gates(loop, inputs, w_i, bias)  # (D, T, B, I / 3H)
        n_in = gates_in[..., 2 * hidden :].to(h0.dtype, copy=True)  # (D, T, B, H)
        gates_in[..., 2 * hidden :] = b_hh[:, None, None, 2 * hidden :]  # joins W_hn h
        _, steps, batch, _ = x.shape
        record = GRURecord(
            x,
            keep,
            h0,
            w_i,
            w_h,
            *layer.state_buffers(h0, steps, compute),
            pre=gates_in.new_empty(steps, directions, batch, 3 * hidden),
            n=h0.new_empty(directions, steps, batch, hidden),
            n_in=n_in,
        )
        layer.run_forward(GRUSteps(record, None), gates_in, record)
        layer.keep_for_backward(ctx, replace(record, n_in=None), loop, inputs, w_hh)
        return layer.time_order(record.states, keep), record.states[:, -1].clone()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_outputs: Tensor, grad_h: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        record = GRURecord(*ctx.saved_tensors)
        grads = layer.start_grads(grad_outputs, grad_h, record, ctx.compute)
        grads.n_in = grad_n_in = torch.empty_like(record.n, dtype=ctx.compute)
        dh0, _ = layer.run_backward(GRUSteps(record, grads), grads, record)
        input_grads = functools.partial(_input_grads, record.w_i, grad_n_in)
        grad_x, *grad_weights = layer.gradients(ctx, record, grads.gates, input_grads)
        return None, grad_x, dh0, *grad_weights


def _input_grads(
    w_i: Tensor, grad_n_in: Tensor, x: Tensor, grad_rec: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """x (D, T*B, I), the gate gradients (D, T*B, 3H) and n_in's (D, T, B, H) -> the gradients
    at x, W_i and b_i. Only the n gate differs from the LSTM's: r scales W_hn h + b_hn, not
    W_in x + b_in. r's and z's part is read in place, by one direction's matmul at a time
    (the strided batched matmul, and joining the parts, cost more); addmm,
    not addmm_, so that the benchmark's FLOP counter sees the product."""
    directions, rows, features = x.shape
    hidden = grad_n_in.size(-1)
    grad_n_in = grad_n_in.view(directions, rows, hidden)
    grad_rz = grad_rec[..., : 2 * hidden]
    grad_w_ih = x.new_empty(directions, 3 * hidden, features)
    grad_x = x.new_empty(directions, rows, features)
    for d in range(directions):
        torch.mm(grad_rz[d].t(), x[d], out=grad_w_ih[d, : 2 * hidden])
        torch.mm(grad_n_in[d].t(), x[d], out=grad_w_ih[d, 2 * hidden :])
        part = torch.mm(grad_rz[d], w_i[d, : 2 * hidden])
        torch.addmm(part, grad_n_in[d], w_i[d, 2 * hidden :], out=grad_x[d])
    grad_b_ih = torch.cat([grad_rz.sum(1), grad_n_in.sum(1)], dim=-1)
    return grad_x, grad_w_ih, grad_b_ih


class GRUSteps(StepKernel):
    """The GRU's steps as kernels.c's nmt_gru_forward and nmt_gru_backward, for one pass
    (grads None in the forward pass)."""

    record: GRURecord

    def pre(self, t: int) -> Tensor:
        return self.record.pre[t]

    def forward(self, t: int, keep: Tensor | None, prev_out: Tensor | None) -> None:
        record = self.record
        assert record.n_in is not None, "the backward pass's record has no n_in"
        h, n, h_out = record.h_before(t), record.n[:, t], record.states[:, t]
        n_in = record.n_in[:, t]
        self.kernels.run("gru_forward", record.pre[t], n_in, h, keep, n, h_out, prev_out)

    def backward(self, t: int, keep: Tensor | None, recurrent: Tensor) -> None:
        record, grads = self.record, self.grads
        assert grads.n_in is not None
        n, h_prev, grad_gates = record.n[:, t], record.h_before(t), grads.gates[:, t]
        cell = record.pre[t], n, h_prev, grad_gates, grads.n_in[:, t]
        self.compiled_backward("gru_backward", t, keep, recurrent, *cell)

    def initial_grads(self, recurrent: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.grads.dh.add_(recurrent), None
