"""An LSTM layer over a whole sequence as one autograd function (nmt.fast.recurrence), and its
step kernels: the compiled one and the torch ops.

Torch's equations and gate order (s the logistic sigmoid):

    i, f, g, o = s, s, tanh, s (W_i* x + b_i* + W_h* h + b_h*)
    c' = f * c + i * g                                  h' = o * tanh(c')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmt.fast.compiled import StepKernels, rnn_kernels
from nmt.fast.layer import (
    Grads,
    Record,
    StepKernel,
    gradients,
    input_gates,
    keep_for_backward,
    last_grad,
    loop_inputs,
    run_backward,
    run_forward,
    start_grads,
    state_buffers,
    tanh,
    time_order,
    torch_dh,
)


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
    """One LSTM layer, all directions: inputs (B, T, I), keep (D, T, B, 1) float (1 where the
    loop's step is a real token) or None, h0 and c0 (D, B, H), weights stacked over directions
    -> outputs (B, T, D*H), h_n, c_n (D, B, H). native: whether the compiled step kernels run."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        native: bool,
        compute: torch.dtype,
        inputs: Tensor,
        keep: Tensor | None,
        h0: Tensor,
        c0: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor,
        b_hh: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        directions, gate_size, hidden = w_hh.shape
        x = loop_inputs(inputs, directions, compute)  # (D, T, B, I)
        w_i, w_h = w_ih.to(compute), w_hh.to(compute)  # (D, 4H, I), (D, 4H, H)
        gates_in = input_gates(x, w_i, b_ih + b_hh)  # (D, T, B, 4H)
        _, steps, batch, _ = x.shape
        record = LSTMRecord(
            x,
            keep,
            h0,
            w_i,
            w_h,
            *state_buffers(h0, steps, compute),
            c0=c0,
            gates=h0.new_empty(directions, steps, batch, gate_size),
            tanh_c=h0.new_empty(directions, steps, batch, hidden),
            cells=h0.new_empty(directions, steps, batch, hidden),
        )
        run_forward(_kernel(native, compute, record, None), gates_in, record)
        keep_for_backward(ctx, record, native, compute, inputs, w_hh)
        h_n, c_n = record.states[:, -1].clone(), record.cells[:, -1].clone()
        return time_order(record.states, keep), h_n, c_n

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_outputs: Tensor, grad_h: Tensor | None, grad_c: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        record = LSTMRecord(*ctx.saved_tensors)
        grads = start_grads(grad_outputs, grad_h, record, ctx.compute)
        grads.dc = last_grad(grad_c, record.c0)
        kernel = _kernel(ctx.native, ctx.compute, record, grads)
        dh0, dc0 = run_backward(kernel, grads, record)

        def input_grads(x: Tensor, grad_rec: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            """W_i x and W_h h enter the gates alike."""
            grad_w_ih = torch.bmm(grad_rec.transpose(1, 2), x)
            return torch.bmm(grad_rec, record.w_i), grad_w_ih, grad_rec.sum(1)

        grad_x, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh = gradients(
            ctx, record, grads.gates, input_grads
        )
        return None, None, grad_x, None, dh0, dc0, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh


def _kernel(
    native: bool, compute: torch.dtype, record: LSTMRecord, grads: Grads | None
) -> StepKernel:
    """The compiled steps where native and they can run, else the torch-op steps."""
    kernels = rnn_kernels(compute, record.h0) if native else None
    if kernels is None:
        return TorchLSTM(record, grads)
    return CompiledLSTM(kernels, record, grads)


class _LSTMSteps(StepKernel):
    """The LSTM's buffers, for one pass (grads None in the forward pass)."""

    def __init__(self, record: LSTMRecord, grads: Grads | None):
        self.record, self._grads = record, grads
        directions, batch, hidden = record.h0.shape
        # the step's matmul output, W_i x + b_i + W_h h + b_h (D, B, 4H) in the matmul dtype
        self._pre = record.prev.new_empty(directions, batch, 4 * hidden)

    @property
    def grads(self) -> Grads:
        assert self._grads is not None, "a forward pass's kernel has no gradients"
        return self._grads

    @property
    def dc(self) -> Tensor:
        assert self.grads.dc is not None
        return self.grads.dc

    def pre(self, t: int) -> Tensor:
        return self._pre


class CompiledLSTM(_LSTMSteps):
    """The LSTM's steps as kernels.c's nmt_lstm_forward and nmt_lstm_backward."""

    def __init__(self, kernels: StepKernels, record: LSTMRecord, grads: Grads | None):
        super().__init__(record, grads)
        self.kernels = kernels

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
        # grads.dh: the part of dL/dh' that does not pass through W_h, updated in place
        record, grads = self.record, self.grads
        self.kernels.run(
            "lstm_backward",
            grads.dh,
            recurrent,
            grads.outputs[:, t],
            keep,
            self.dc,
            record.gates[:, t],
            record.tanh_c[:, t],
            record.c_before(t),
            grads.gates[:, t],
        )

    def initial_grads(self, recurrent: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.grads.dh.add_(recurrent), self.dc


class TorchLSTM(_LSTMSteps):
    """The LSTM's steps as torch ops, few and fused as the GRU's (nmt.fast.gru.TorchGRU)."""

    def __init__(self, record: LSTMRecord, grads: Grads | None):
        super().__init__(record, grads)
        directions, batch, hidden = record.h0.shape
        self.scratch = record.h0.new_empty(directions, batch, 4 * hidden)
        self.ones = torch.ones((), dtype=record.h0.dtype)
        self.dropped = None if grads is None or record.keep is None else 1 - record.keep
        self.carry: Tensor | None = None  # the part of dL/dh that does not pass through W_h

    def forward(self, t: int, keep: Tensor | None, prev_out: Tensor | None) -> None:
        c, h, h_out = self.record.c_before(t), self.record.h_before(t), self.record.states[:, t]
        c_out, hidden = self.record.cells[:, t], h.size(-1)
        act = self.record.gates[:, t].copy_(self._pre)
        act[..., 2 * hidden : 3 * hidden].mul_(2)
        torch.sigmoid_(act)  # i, f, o, and g as sigmoid(2x)
        gate_g = act[..., 2 * hidden : 3 * hidden].mul_(2).sub_(1)  # tanh x = 2 sigmoid(2x) - 1
        c_new = c_out if keep is None else torch.empty_like(c)
        torch.mul(act[..., hidden : 2 * hidden], c, out=c_new).addcmul_(act[..., :hidden], gate_g)
        tanh_c = tanh(c_new, self.record.tanh_c[:, t])
        if keep is None:
            torch.mul(act[..., 3 * hidden :], tanh_c, out=h_out)
        else:  # lerp is exact for weights 0 and 1: a finished sentence keeps its state
            torch.lerp(c, c_new, keep, out=c_out)
            torch.lerp(h, act[..., 3 * hidden :] * tanh_c, keep, out=h_out)
        if prev_out is not None:
            prev_out.copy_(h_out)

    def backward(self, t: int, keep: Tensor | None, recurrent: Tensor) -> None:
        dh = torch_dh(t, self.grads, self.carry, recurrent) + self.grads.outputs[:, t]
        act, tanh_c, c_prev = (
            self.record.gates[:, t],
            self.record.tanh_c[:, t],
            self.record.c_before(t),
        )
        hidden, dc, scratch = c_prev.size(-1), self.dc, self.scratch
        dh_step = dh if keep is None else dh * keep
        dc_step = dc if keep is None else dc * keep
        gate_i, gate_f = act[..., :hidden], act[..., hidden : 2 * hidden]
        gate_g, gate_o = act[..., 2 * hidden : 3 * hidden], act[..., 3 * hidden :]
        dc_new = torch.addcmul(self.ones, tanh_c, tanh_c, value=-1).mul_(gate_o)
        dc_new = torch.addcmul(dc_step, dh_step, dc_new)  # + dh o (1 - tanh(c)^2)
        slopes = torch.addcmul(act, act, act, value=-1)  # s'(x) = s (1 - s)
        torch.addcmul(self.ones, gate_g, gate_g, value=-1, out=slopes[..., 2 * hidden : 3 * hidden])
        torch.mul(dc_new, gate_g, out=scratch[..., :hidden])
        torch.mul(dc_new, c_prev, out=scratch[..., hidden : 2 * hidden])
        torch.mul(dc_new, gate_i, out=scratch[..., 2 * hidden : 3 * hidden])
        torch.mul(dh_step, tanh_c, out=scratch[..., 3 * hidden :])
        torch.mul(scratch, slopes, out=self.grads.gates[:, t])
        self.grads.dc = dc_new * gate_f  # dL/dc before the step
        self.carry = None
        if keep is not None:  # a finished sentence passes dh and dc through
            assert self.dropped is not None
            self.grads.dc.addcmul_(dc, self.dropped[:, t])
            self.carry = dh * self.dropped[:, t]

    def initial_grads(self, recurrent: Tensor) -> tuple[Tensor, Tensor | None]:
        return torch_dh(-1, self.grads, self.carry, recurrent), self.dc
