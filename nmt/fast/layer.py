"""What the GRU and LSTM layers of nmt.fast.recurrence share: the buffers' layout, the input
projection, the loops through time over a ``StepKernel``, and the gradients that come from the
gate gradients of every step.

A layer runs all its directions at once. Its buffers are laid out (D, T, B, F) in loop order:
step t of direction d is [d, t] (the backward direction's loop runs backwards in time), so both
directions of a step are one (D, B, F) view and all steps of a direction one matrix. The loops
own the matmuls; a ``StepKernel`` does each step's elementwise work through nmt's compiled
kernel (nmt.fast.compiled: the cell's one C definition, which search's steps run too). Steps
that every sentence takes in every direction (most, in length-bucketed batches) skip the
masking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from nmt.fast.compiled import rnn_kernels


@dataclass(frozen=True)
class Loop:
    """What every layer of an RNN loops with."""

    keep: Tensor | None  # (D, T, B, 1) float: 1 where the loop's step is a real token; None: all
    compute: torch.dtype  # the matmuls' dtype
    # the first layer's input gates (D, T, B, G*H) in loop order, W_i x + the joined bias
    # (``input_bias``), looked up by search (``recurrence.gate_table``); the layer then reads
    # no inputs, writes over these, and runs without gradient
    gates: Tensor | None = None


@dataclass
class Record:
    """What a layer's forward pass keeps for its backward pass, in loop order; each cell kind
    adds its own tensors."""

    x: Tensor  # (D, T, B, I): the inputs as the matmuls take them
    keep: Tensor | None  # (D, T, B, 1) float: 1 where the step is a real token; None: all are
    h0: Tensor  # (D, B, H)
    w_i: Tensor  # (D, G*H, I) in the matmul dtype
    w_h: Tensor  # (D, G*H, H) in the matmul dtype
    prev: Tensor  # (D, T, B, H): h before each step, as the matmul took it
    states: Tensor  # (D, T, B, H): h after each step

    def tensors(self) -> list[Tensor | None]:
        """The fields in order, for ``ctx.save_for_backward`` (``type(record)(*saved)``)."""
        return [getattr(self, field.name) for field in fields(self)]

    def h_before(self, t: int) -> Tensor:
        """h before step t (D, B, H)."""
        return self.h0 if t == 0 else self.states[:, t - 1]


@dataclass
class Grads:
    """A layer's backward-pass buffers, in loop order."""

    outputs: Tensor  # (D, T, B, H): dL/d outputs, zero past each end
    gates: Tensor  # (D, T, B, G*H) in the matmul dtype: at the gates' pre-activations
    dh: Tensor  # (D, B, H): dL/dh' at the last step (the loop carries it back)
    dc: Tensor | None  # (D, B, H): the LSTM's dL/dc' at the last step
    n_in: Tensor | None  # (D, T, B, H) in the matmul dtype: the GRU's, at W_in x + b_in


class StepKernel(ABC):
    """One cell kind's elementwise work at one time step, all directions at once, over one
    layer's record (and, for the backward pass, its grads), through the compiled kernels.
    ``run_forward`` and ``run_backward`` call it between the matmuls."""

    def __init__(self, record: Record, grads: Grads | None):
        self.record, self._grads = record, grads
        kernels = rnn_kernels(record.prev.dtype, record.h0)
        assert kernels is not None, "the recurrence runs where its kernels do (runs_here)"
        self.kernels = kernels

    @property
    def grads(self) -> Grads:
        assert self._grads is not None, "a forward pass's kernel has no gradients"
        return self._grads

    def compiled_backward(
        self, name: str, t: int, keep: Tensor | None, recurrent: Tensor, *tensors: Tensor
    ) -> None:
        """kernels.c's backward step ``name``: first what every cell's takes (grads.dh, the part
        of dL/dh' that does not pass through W_h, which it updates in place; recurrent, the
        part that does; dL/dh' from the outputs; keep), then the cell's own tensors."""
        grads = self.grads
        self.kernels.run(name, grads.dh, recurrent, grads.outputs[:, t], keep, *tensors)

    @abstractmethod
    def pre(self, t: int) -> Tensor:
        """Where step t's matmul writes the gates' pre-activations (D, B, G*H), matmul dtype."""

    @abstractmethod
    def forward(self, t: int, keep: Tensor | None, prev_out: Tensor | None) -> None:
        """Step t's gate pre-activations -> the states after step t, into the record; h' in
        the matmul dtype also into prev_out (D, B, H) where given, for the next matmul. keep:
        (D, B, 1), or None when every sentence takes the step."""

    @abstractmethod
    def backward(self, t: int, keep: Tensor | None, recurrent: Tensor) -> None:
        """recurrent (D, B, H) in the matmul dtype: the part of dL/dh' that passes through W_h
        (W_h^T times step t + 1's gate gradients; zeros at the last step) -> step t's gate
        gradients into the grads."""

    @abstractmethod
    def initial_grads(self, recurrent: Tensor) -> tuple[Tensor, Tensor | None]:
        """recurrent: W_h^T times step 0's gate gradients -> dL/dh_0 and (LSTM) dL/dc_0."""


def _reorder(parts: list[Tensor], masks: list[Tensor] | None, targets: list[Tensor]) -> None:
    """Direction d's (T, B, F) part -> targets[d], reversed in time for the backward direction
    (loop order <-> time order), times masks[d] (T, B, 1) where given: one pass per part (two
    for the reversal)."""
    for d, (part, target) in enumerate(zip(parts, targets, strict=True)):
        part = part.flip(0) if d == 1 else part
        if masks is None:
            target.copy_(part)
        else:
            torch.mul(part, masks[d], out=target)


def loop_inputs(inputs: Tensor, directions: int, compute: torch.dtype) -> Tensor:
    """inputs (B, T, I) -> (D, T, B, I) in loop order, in the matmul dtype."""
    batch, steps, features = inputs.shape
    x = inputs.new_empty(directions, steps, batch, features, dtype=compute)
    _reorder([inputs.transpose(0, 1)] * directions, None, list(x))
    return x


def input_bias(b_ih: Tensor, b_hh: Tensor, gru: bool) -> Tensor:
    """The bias a layer adds to W_i x (D, G*H): b_i and the parts of b_h summed with it, all
    of an LSTM's and a GRU's r and z (b_hn stays inside r * (W_hn h + b_hn))."""
    if not gru:
        return b_ih + b_hh
    bias = b_ih.clone()
    hidden = b_hh.size(-1) // 3
    bias[:, : 2 * hidden] += b_hh[:, : 2 * hidden]
    return bias


def inputs_and_gates(
    loop: Loop, inputs: Tensor | None, w_i: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor]:
    """A layer's inputs (B, T, I) in loop order (D, T, B, I), in the matmul dtype, and their
    input gates W_i x + bias (D, T, B, G*H); where the loop gives the gates (search), those
    and an empty x."""
    if loop.gates is not None:
        directions, steps, batch, _ = loop.gates.shape
        return loop.gates.new_empty(directions, steps, batch, 0), loop.gates
    assert inputs is not None
    x = loop_inputs(inputs, w_i.size(0), loop.compute)
    return x, input_gates(x, w_i, bias)


def input_gates(x: Tensor, w_i: Tensor, bias: Tensor) -> Tensor:
    """W_i x + b for every step at once: x (D, T, B, I), w_i (D, G*H, I), bias (D, G*H) ->
    (D, T, B, G*H), in the matmul dtype."""
    directions, steps, batch, _ = x.shape
    return torch.baddbmm(
        bias.to(x.dtype).unsqueeze(1),
        x.view(directions, steps * batch, -1),
        w_i.transpose(1, 2),
    ).view(directions, steps, batch, -1)


def state_buffers(h0: Tensor, steps: int, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """h0 (D, B, H) -> prev (h before each step as the matmuls take it, kept for W_h's
    gradient) and states (h after each step), both (D, T, B, H). In the states' dtype the two
    are one buffer, offset by a step; else the step kernels write prev as they go."""
    directions, batch, hidden = h0.shape
    if compute == h0.dtype:
        history = h0.new_empty(directions, steps + 1, batch, hidden)
        history[:, 0] = h0
        return history[:, :-1], history[:, 1:]
    prev = h0.new_empty(directions, steps, batch, hidden, dtype=compute)
    prev[:, 0].copy_(h0)
    return prev, h0.new_empty(directions, steps, batch, hidden)


def full_steps(keep: Tensor | None, steps: int) -> list[bool]:
    """For each step of the loop, whether every sentence of every direction is still going."""
    if keep is None:
        return [True] * steps
    return (keep.amin(dim=(0, 2, 3)) == 1).tolist()  # type: ignore[no-any-return]


def run_forward(kernel: StepKernel, gates_in: Tensor, record: Record) -> None:
    """Through time from the first step: W_h h + (W_i x + b) (gates_in, (D, T, B, G*H)) into
    the kernel's pre-activations, then the step's elementwise work."""
    steps = gates_in.size(1)
    w_h_t = record.w_h.transpose(1, 2)  # (D, H, G*H)
    full = full_steps(record.keep, steps)
    separate = record.prev.dtype != record.states.dtype  # else h' is already prev[t + 1]
    for t in range(steps):
        torch.baddbmm(gates_in[:, t], record.prev[:, t], w_h_t, out=kernel.pre(t))
        keep = None if full[t] else record.keep[:, t]  # type: ignore[index]
        kernel.forward(t, keep, record.prev[:, t + 1] if separate and t + 1 < steps else None)


def run_backward(kernel: StepKernel, grads: Grads, record: Record) -> tuple[Tensor, Tensor | None]:
    """Through time from the last step, for the state gradients only: each step's gate
    gradients into grads.gates, and W_h^T times them on to the step before -> dL/dh_0 and
    (LSTM) dL/dc_0. The weights' gradients wait for ``gradients``."""
    steps = grads.gates.size(1)
    full = full_steps(record.keep, steps)
    recurrent = grads.gates.new_zeros(grads.dh.shape)  # (D, B, H) in the matmul dtype
    for t in reversed(range(steps)):
        kernel.backward(t, None if full[t] else record.keep[:, t], recurrent)  # type: ignore[index]
        torch.bmm(grads.gates[:, t], record.w_h, out=recurrent)  # (D, B, H)
    return kernel.initial_grads(recurrent)


def start_grads(
    grad_outputs: Tensor, grad_h: Tensor | None, record: Record, compute: torch.dtype
) -> Grads:
    """The backward pass's buffers from autograd's gradients grad_outputs (B, T, D*H) and
    grad_h (D, B, H) or None (zero); the cell kind adds its own (dc, n_in)."""
    directions, steps, batch, hidden = record.states.shape
    grads = grad_outputs.view(batch, steps, directions, hidden).permute(2, 1, 0, 3)
    outputs = torch.empty_like(record.states)  # (D, T, B, H) in loop order
    keep = record.keep
    _reorder(list(grads), None if keep is None else list(keep), list(outputs))
    gates = torch.empty(directions, steps, batch, record.w_h.size(1), dtype=compute)
    return Grads(outputs, gates, last_grad(grad_h, record.h0), dc=None, n_in=None)


def last_grad(grad: Tensor | None, like: Tensor) -> Tensor:
    """Autograd's gradient of a final state (D, B, H), or zeros for None, in a buffer of the
    states' dtype that the backward loop may update."""
    buffer = torch.zeros(like.shape, dtype=like.dtype)
    if grad is not None:
        buffer.copy_(grad)
    return buffer


def time_order(states: Tensor, keep: Tensor | None) -> Tensor:
    """(D, T, B, F) in loop order -> (B, T, D*F) in time order, times keep (D, T, B, 1, loop
    order) where given: zero past each sentence's end."""
    directions, steps, batch, features = states.shape
    out = states.new_empty(batch, steps, directions, features)
    targets = [out[:, :, d].transpose(0, 1) for d in range(directions)]  # (T, B, F) views
    masks = None if keep is None else [keep[0]] * directions  # the forward one is in time order
    _reorder(list(states), masks, targets)
    return out.view(batch, steps, directions * features)


def keep_for_backward(
    ctx: Any, record: Record, loop: Loop, inputs: Tensor | None, w_hh: Tensor
) -> None:
    """The record into ``ctx.save_for_backward``, and what else the backward pass needs."""
    ctx.compute = loop.compute
    ctx.input_dtype = inputs.dtype if inputs is not None else None
    ctx.weight_dtype = w_hh.dtype
    ctx.save_for_backward(*record.tensors())


InputGrads = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def gradients(
    ctx: Any, record: Record, grad_gates: Tensor, input_grads: InputGrads
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of (inputs, w_ih, w_hh, b_ih, b_hh) from the gate gradients of every step
    (D, T, B, G*H) and the states before each step as the matmuls took them: each weight's in
    one matmul over all steps. input_grads: x (D, T*B, I), the gate gradients (D, T*B, G*H) ->
    the gradients at x, W_i and b_i, as the cell kind forms them."""
    directions, steps, batch, hidden = record.prev.shape
    rows = steps * batch
    x = record.x.view(directions, rows, -1)
    grad_rec = grad_gates.view(directions, rows, -1)
    grad_w_hh = torch.bmm(grad_rec.transpose(1, 2), record.prev.view(directions, rows, hidden))
    grad_x, grad_w_ih, grad_b_ih = input_grads(x, grad_rec)
    grad_x = grad_x.to(ctx.input_dtype).view(directions, steps, batch, -1)
    grad_x = grad_x[0] + grad_x[1].flip(0) if directions == 2 else grad_x[0]  # (T, B, I)
    weights = ctx.weight_dtype
    return (
        grad_x.transpose(0, 1),
        grad_w_ih.to(weights),
        grad_w_hh.to(weights),
        grad_b_ih.to(weights),  # sums accumulated in float32 by torch's reduction
        grad_rec.sum(1).to(weights),
    )
