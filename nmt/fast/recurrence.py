"""The recurrence of an ``nn.GRU`` / ``nn.LSTM`` over a whole sequence as one autograd
function: nmt's CPU training path for the encoder and the decoders that run over all steps.
``plain_rnn`` beside it is the module's own call (packed when lengths are given), the
reference.

On the CPU, torch runs an RNN as one small matmul and a few elementwise ops per time step, and
autograd records every step, so the backward pass also computes the recurrent weight gradient
step by step: a (3H x B)(B x H) matmul and an accumulation into the gradient per step and
direction. Here the backward pass runs through time for the state gradients only, keeps the
gate gradients of every step, and computes each weight gradient with one large matmul at the
end. Both directions of a bidirectional layer advance together, one batched matmul per step.

Lengths are honoured as packed sequences honour them: a sentence's state stops changing after
its last token (so the backward direction starts from its last token), outputs past it are
zero, and the final state is the state at the last token. The module's own parameters are used
(same names, same checkpoints). Under autocast the matmuls run in the autocast dtype and the
gates, states and their gradients in the parameters' dtype. Each step's elementwise work runs
as one compiled kernel (kernels.c, through nmt.fast.compiled) where a C compiler is
available, else as the torch ops of nmt.fast.steps.

Equations (torch's conventions, gates in this order):

    GRU:   r = s(W_ir x + b_ir + W_hr h + b_hr)      z = s(W_iz x + b_iz + W_hz h + b_hz)
           n = tanh(W_in x + b_in + r * (W_hn h + b_hn))      h' = (1 - z) * n + z * h
    LSTM:  i, f, g, o = s, s, tanh, s (W_i* x + b_i* + W_h* h + b_h*)
           c' = f * c + i * g                                  h' = o * tanh(c')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.fast.compiled import StepKernels, rnn_kernels
from nmt.fast.dropout import dropout
from nmt.fast.steps import (
    gru_backward_step,
    gru_forward_step,
    gru_gates,
    lstm_backward_step,
    lstm_forward_step,
)
from nmt.runtime import compute_dtype

RNNState = Tensor | tuple[Tensor, Tensor]


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


def _time_order(states: Tensor, keep: Tensor | None) -> Tensor:
    """(D, T, B, F) in loop order -> (B, T, D*F) in time order, times keep (D, T, B, 1, loop
    order) where given: zero past each sentence's end."""
    directions, steps, batch, features = states.shape
    out = states.new_empty(batch, steps, directions, features)
    targets = [out[:, :, d].transpose(0, 1) for d in range(directions)]  # (T, B, F) views
    masks = None if keep is None else [keep[0]] * directions  # the forward one is in time order
    _reorder(list(states), masks, targets)
    return out.view(batch, steps, directions * features)


class _Layer(torch.autograd.Function):
    """One layer, all directions: inputs (B, T, I), keep (D, T, B, 1) float (1 where the
    loop's step is a real token) or None, h0/c0 (D, B, H), weights stacked over directions
    -> outputs (B, T, D*H), h_n (D, B, H), c_n (D, B, H) or None.

    Buffers are laid out (D, T, B, F) in loop order: step t of direction d is [d, t], so
    both directions of a step are one (D, B, F) view and all steps of a direction one matrix.
    The GRU's gate inputs, which only the step reads, are laid out (T, D, B, 3H), so that the
    step's matmul writes them in place. Steps that every sentence takes in every direction
    (most, in length-bucketed batches) skip the masking.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        lstm: bool,
        compute: torch.dtype,
        inputs: Tensor,
        keep: Tensor | None,
        h0: Tensor,
        c0: Tensor | None,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor,
        b_hh: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        batch, steps, _ = inputs.shape
        directions, gate_size, hidden = w_hh.shape
        x = inputs.new_empty(directions, steps, batch, inputs.size(-1), dtype=compute)
        _reorder([inputs.transpose(0, 1)] * directions, None, list(x))  # (D, T, B, I)
        w_i, w_h = w_ih.to(compute), w_hh.to(compute)  # (D, G*H, I), (D, G*H, H)
        bias = b_ih.clone()  # (D, G*H)
        if lstm:
            bias += b_hh
        else:  # b_hn stays inside r * (W_hn h + b_hn)
            bias[:, : 2 * hidden] += b_hh[:, : 2 * hidden]
        gates_in = torch.baddbmm(
            bias.to(compute).unsqueeze(1),
            x.view(directions, steps * batch, -1),
            w_i.transpose(1, 2),
        ).view(directions, steps, batch, gate_size)  # W_i x + b for every step at once
        if not lstm:  # W_in x + b_in apart in float32; b_hn joins W_hn h in the step's matmul
            n_in = gates_in[..., 2 * hidden :].to(h0.dtype, copy=True)  # (D, T, B, H)
            gates_in[..., 2 * hidden :] = b_hh[:, None, None, 2 * hidden :]
        w_h_t = w_h.transpose(1, 2)  # (D, H, G*H)
        full = _full_steps(keep, steps)

        # h before each step (h_0 .. h_{T-1}) as the matmuls take it, kept for W_hh's gradient;
        # in the states' dtype the two are one buffer, offset by a step
        if compute == h0.dtype:
            history = h0.new_empty(directions, steps + 1, batch, hidden)
            history[:, 0] = h0
            states, prev = history[:, 1:], history[:, :-1]  # h after each step, h before
        else:
            states = h0.new_empty(directions, steps, batch, hidden)
            prev = h0.new_empty(directions, steps, batch, hidden, dtype=compute)
        if lstm:  # the gates i, f, g, o
            acts = h0.new_empty(directions, steps, batch, gate_size)
            recurrent = gates_in.new_empty(directions, batch, gate_size)
        else:  # the gates' inputs as the step's matmul left them, (T, D, B, 3H): backward
            # takes r and z from them again, which costs less than storing them in float32
            acts = gates_in.new_empty(steps, directions, batch, gate_size)
            gates = h0.new_empty(directions, batch, gate_size)
        extra = h0.new_empty(directions, steps, batch, hidden)  # LSTM: tanh(c'); GRU: n
        cells = h0.new_empty(directions, steps, batch, hidden) if lstm else None
        kernels = rnn_kernels(compute, h0)
        # the compiled step writes h' in the matmul dtype for the next step's matmul itself
        convert = prev.dtype != h0.dtype
        h, c = h0, c0
        for t in range(steps):
            if convert and (kernels is None or t == 0):
                prev[:, t].copy_(h)
            keep_t = None if full[t] else keep[:, t]  # type: ignore[index]
            prev_out = prev[:, t + 1] if convert and t + 1 < steps else None
            if lstm:
                assert c is not None and cells is not None
                torch.baddbmm(gates_in[:, t], prev[:, t], w_h_t, out=recurrent)  # (D, B, 4H)
                step_out = acts[:, t], extra[:, t], cells[:, t], states[:, t]
                if kernels is not None:
                    kernels.lstm_forward(recurrent, c, h, keep_t, *step_out, prev_out)
                else:
                    lstm_forward_step(recurrent, c, h, keep_t, *step_out)
                c = cells[:, t]
            else:
                # W_hr h + W_ir x + b_r, W_hz h + W_iz x + b_z, W_hn h + b_hn: (D, B, 3H)
                torch.baddbmm(gates_in[:, t], prev[:, t], w_h_t, out=acts[t])
                if kernels is not None:
                    kernels.gru_forward(
                        acts[t], n_in[:, t], h, keep_t, extra[:, t], states[:, t], prev_out
                    )
                else:
                    gru_gates(acts[t], gates)
                    gru_forward_step(gates, n_in[:, t], h, keep_t, extra[:, t], states[:, t])
            h = states[:, t]
        ctx.lstm, ctx.compute = lstm, compute
        ctx.input_dtype, ctx.weight_dtype = inputs.dtype, w_hh.dtype
        ctx.save_for_backward(x, keep, h0, c0, w_i, w_h, states, prev, acts, extra, cells)
        return _time_order(states, keep), h.clone(), (c.clone() if lstm else None)  # type: ignore[union-attr]

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_outputs: Tensor, grad_h: Tensor | None, grad_c: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x, keep, h0, c0, w_i, w_h, states, prev, acts, extra, cells = ctx.saved_tensors
        lstm, compute = ctx.lstm, ctx.compute
        directions, steps, batch, hidden = states.shape
        gate_size = w_h.size(1)
        grads = grad_outputs.view(batch, steps, directions, hidden).permute(2, 1, 0, 3)
        grad_out = torch.empty_like(states)  # (D, T, B, H) in loop order
        _reorder(list(grads), None if keep is None else list(keep), list(grad_out))
        # gradients at the gates' pre-activations, of W_h h + b_h and (GRU: n only) W_i x + b_i
        grad_rec = torch.empty(directions, steps, batch, gate_size, dtype=compute)
        grad_n_in = None if lstm else torch.empty(directions, steps, batch, hidden, dtype=compute)
        dh = torch.zeros(directions, batch, hidden, dtype=states.dtype)
        if grad_h is not None:
            dh.copy_(grad_h)
        dc = None
        if lstm:
            dc = torch.zeros_like(dh)
            if grad_c is not None:
                dc.copy_(grad_c)
        loop = _ThroughTime(
            keep,
            _full_steps(keep, steps),
            h0,
            c0,
            w_h,
            states,
            acts,
            extra,
            cells,
            grad_out,
            grad_rec,
            grad_n_in,
        )
        kernels = rnn_kernels(compute, states)
        dh, dc = loop.torch_ops(dh, dc) if kernels is None else loop.compiled(kernels, dh, dc)
        return (
            None,
            None,
            *_input_and_weight_grads(ctx, x, w_i, prev, grad_rec, grad_n_in, dh, dc),
        )


@dataclass
class _ThroughTime:
    """_Layer.backward's loop through time, from the last step to the first: the gate
    gradients into grad_rec (D, T, B, G*H) (and, GRU, grad_n_in (D, T, B, H)), from the
    forward pass's buffers and the output gradients grad_out (D, T, B, H), all in loop order
    -> dL/dh_0 (and dL/dc_0)."""

    keep: Tensor | None
    full: list[bool]
    h0: Tensor
    c0: Tensor | None
    w_h: Tensor
    states: Tensor
    acts: Tensor
    extra: Tensor
    cells: Tensor | None
    grad_out: Tensor
    grad_rec: Tensor
    grad_n_in: Tensor | None

    def _keep(self, t: int) -> Tensor | None:
        return None if self.full[t] else self.keep[:, t]  # type: ignore[index]

    def _before(self, t: int) -> tuple[Tensor, Tensor | None]:
        """h and c before step t."""
        if t == 0:
            return self.h0, self.c0
        return self.states[:, t - 1], (self.cells[:, t - 1] if self.cells is not None else None)

    def compiled(
        self, kernels: StepKernels, dh: Tensor, dc: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """With the compiled steps. dh (D, B, H), the part of dL/dh' that does not pass
        through W_h, and dc are updated in place; each step adds the part that does (W_h^T
        times the later step's gate gradients, zeros at the last step)."""
        recurrent = self.grad_rec.new_zeros(dh.shape)  # (D, B, H) in the matmul dtype
        for t in reversed(range(len(self.full))):
            h_prev, c_prev = self._before(t)
            if dc is not None:  # LSTM
                assert c_prev is not None
                kernels.lstm_backward(
                    dh,
                    recurrent,
                    self.grad_out[:, t],
                    self._keep(t),
                    dc,
                    self.acts[:, t],
                    self.extra[:, t],
                    c_prev,
                    self.grad_rec[:, t],
                )
            else:
                assert self.grad_n_in is not None
                kernels.gru_backward(
                    dh,
                    recurrent,
                    self.grad_out[:, t],
                    self._keep(t),
                    self.acts[t],
                    self.extra[:, t],
                    h_prev,
                    self.grad_rec[:, t],
                    self.grad_n_in[:, t],
                )
            torch.bmm(self.grad_rec[:, t], self.w_h, out=recurrent)  # (D, B, H)
        return dh.add_(recurrent), dc

    def torch_ops(self, dh: Tensor, dc: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """With torch ops (see the step functions below); dh, dc: dL/dh', dL/dc' at the end."""
        directions, batch, hidden = dh.shape
        gate_size = self.w_h.size(1)
        dropped = 1 - self.keep if self.keep is not None else None
        ones = torch.ones((), dtype=dh.dtype)
        scratch = dh.new_empty(directions, batch, 2 * hidden)
        # LSTM: the gate gradients before the slopes; GRU: r, z and W_hn h + b_hn again
        scratch_gates = dh.new_empty(directions, batch, gate_size)
        recurrent = self.grad_rec.new_empty(directions, batch, hidden)
        for t in reversed(range(len(self.full))):
            keep_t = self._keep(t)
            dropped_t = None if self.full[t] else dropped[:, t]  # type: ignore[index]
            h_prev, c_prev = self._before(t)
            if dc is not None:  # LSTM
                assert c_prev is not None
                carry, dc = lstm_backward_step(
                    dh,
                    dc,
                    self.grad_out[:, t],
                    keep_t,
                    dropped_t,
                    self.acts[:, t],
                    self.extra[:, t],
                    c_prev,
                    ones,
                    scratch_gates,
                    self.grad_rec[:, t],
                )
            else:
                carry = gru_backward_step(
                    dh,
                    self.grad_out[:, t],
                    keep_t,
                    dropped_t,
                    gru_gates(self.acts[t], scratch_gates),
                    self.extra[:, t],
                    h_prev,
                    ones,
                    scratch,
                    self.grad_rec[:, t],
                    self.grad_n_in[:, t],  # type: ignore[index]
                )
            torch.bmm(self.grad_rec[:, t], self.w_h, out=recurrent)  # (D, B, H)
            dh = recurrent.to(dh.dtype, copy=True) if carry is None else carry.add_(recurrent)
        return dh, dc


def _input_and_weight_grads(
    ctx: Any,
    x: Tensor,
    w_i: Tensor,
    prev: Tensor,
    grad_rec: Tensor,
    grad_n_in: Tensor | None,
    dh0: Tensor,
    dc0: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The gradients of (inputs, keep, h0, c0, w_ih, w_hh, b_ih, b_hh) from the gate
    gradients of every step (D, T, B, G*H) and the states before each step, prev (D, T, B, H),
    as the matmuls took them: each weight's in one matmul over all steps."""
    directions, steps, batch, hidden = prev.shape
    rows, gate_size = steps * batch, grad_rec.size(-1)
    x = x.view(directions, rows, -1)
    grad_rec = grad_rec.view(directions, rows, gate_size)
    grad_w_hh = torch.bmm(grad_rec.transpose(1, 2), prev.view(directions, rows, hidden))
    if grad_n_in is None:  # LSTM: W_i x and W_h h enter the gates alike
        grad_w_ih = torch.bmm(grad_rec.transpose(1, 2), x)
        grad_x = torch.bmm(grad_rec, w_i)  # (D, T*B, I)
        grad_b_ih = grad_rec.sum(1)
    else:  # GRU: only the n gate differs (r scales W_hn h + b_hn, not W_in x + b_in)
        # r's and z's part is read in place, by one direction's matmul at a time (the strided
        # batched matmul is twice as slow; joining the parts took longer than the matmuls); addmm,
        # not addmm_, so that the benchmark's FLOP counter sees the product
        grad_n_in = grad_n_in.view(directions, rows, hidden)
        grad_rz = grad_rec[..., : 2 * hidden]
        grad_w_ih = x.new_empty(directions, gate_size, x.size(-1))
        grad_x = x.new_empty(directions, rows, x.size(-1))
        for d in range(directions):
            torch.mm(grad_rz[d].t(), x[d], out=grad_w_ih[d, : 2 * hidden])
            torch.mm(grad_n_in[d].t(), x[d], out=grad_w_ih[d, 2 * hidden :])
            part = torch.mm(grad_rz[d], w_i[d, : 2 * hidden])
            torch.addmm(part, grad_n_in[d], w_i[d, 2 * hidden :], out=grad_x[d])
        grad_b_ih = torch.cat([grad_rz.sum(1), grad_n_in.sum(1)], dim=-1)
    grad_x = grad_x.to(ctx.input_dtype).view(directions, steps, batch, -1)
    grad_x = grad_x[0] + grad_x[1].flip(0) if directions == 2 else grad_x[0]  # (T, B, I)
    weights = ctx.weight_dtype
    return (
        grad_x.transpose(0, 1),
        None,
        dh0,
        dc0,
        grad_w_ih.to(weights),
        grad_w_hh.to(weights),
        grad_b_ih.to(weights),  # sums accumulated in float32 by torch's reduction
        grad_rec.sum(1).to(weights),
    )


def _full_steps(keep: Tensor | None, steps: int) -> list[bool]:
    """For each step of the loop, whether every sentence of every direction is still going."""
    if keep is None:
        return [True] * steps
    return (keep.amin(dim=(0, 2, 3)) == 1).tolist()  # type: ignore[no-any-return]


def run_rnn(
    rnn: nn.RNNBase, inputs: Tensor, mask: Tensor | None, state: RNNState | None
) -> tuple[Tensor, RNNState]:
    """A batch-first ``nn.GRU``/``nn.LSTM`` over ``inputs`` as the packed module would run it.

    inputs: (B, T, I); mask: (B, T), True at each sentence's tokens (a prefix of its row), or
    None when every position is real; state: (L*D, B, H), a tuple (h, c) for an LSTM, or None
    for zeros -> outputs (B, T, D*H), zero past each sentence's end, and the final state in
    the module's layout (the state at each sentence's last token).
    """
    lstm = isinstance(rnn, nn.LSTM)
    directions = 2 if rnn.bidirectional else 1
    weights = next(rnn.parameters()).dtype
    compute = compute_dtype(inputs.device, weights)
    batch = inputs.size(0)
    if state is None:
        state = inputs.new_zeros(rnn.num_layers * directions, batch, rnn.hidden_size, dtype=weights)
        if lstm:
            state = (state, torch.zeros_like(state))
    h0, c0 = state if isinstance(state, tuple) else (state, None)
    keep = None
    if mask is not None:
        step_keep = mask.t().to(weights)  # (T, B)
        keep = torch.stack([step_keep, step_keep.flip(0)][:directions])[..., None]  # (D, T, B, 1)
    x = inputs
    hiddens, cells = [], []
    with torch.autocast(inputs.device.type, enabled=False):
        for layer in range(rnn.num_layers):
            names = [f"l{layer}", f"l{layer}_reverse"][:directions]
            params = [
                torch.stack([getattr(rnn, f"{kind}_{name}") for name in names])
                for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            ]
            rows = slice(layer * directions, (layer + 1) * directions)
            x, h_n, c_n = _Layer.apply(
                lstm,
                compute,
                x,
                keep,
                h0[rows].to(weights).contiguous(),
                c0[rows].to(weights).contiguous() if c0 is not None else None,
                *params,
            )
            hiddens.append(h_n)
            cells.append(c_n)
            if layer < rnn.num_layers - 1:
                x = dropout(x, rnn.dropout, rnn.training)
    hidden = torch.cat(hiddens)
    return x, ((hidden, torch.cat(cells)) if lstm else hidden)


# Devices whose autocast runs RNNs in a dtype of its own: CUDA's runs cuDNN RNNs in fp16
# whatever the autocast dtype, and bf16 has no loss scaler to keep their small gradients in
# fp16's range. There the plain path runs them outside autocast, in the weights' dtype.
RNN_OUTSIDE_AUTOCAST = {"cuda"}


def plain_rnn(
    rnn: nn.RNNBase, inputs: Tensor, lengths: Tensor | None, state: RNNState | None
) -> tuple[Tensor, RNNState]:
    """The module's own call over ``inputs`` (B, T, I): packed by ``lengths`` (B,) where given
    (outputs zero past each end, the final state at each last token), else over every
    position -> outputs (B, T, D*H), the final state."""
    device = inputs.device.type
    if not _outside_autocast(rnn, device):
        return _module_call(rnn, inputs, lengths, state)
    dtype = next(rnn.parameters()).dtype
    if isinstance(state, tuple):
        state = (state[0].to(dtype), state[1].to(dtype))
    elif state is not None:
        state = state.to(dtype)
    with torch.autocast(device, enabled=False):
        return _module_call(rnn, inputs.to(dtype), lengths, state)


def _outside_autocast(rnn: nn.RNNBase, device: str) -> bool:
    """Whether the RNN must run outside autocast: CUDA's (above), and a CPU's bf16 autocast
    for an LSTM, which it runs through oneDNN in bf16, on CPUs without bf16 instructions a
    RuntimeError ("could not create a primitive descriptor")."""
    if not torch.is_autocast_enabled(device):
        return False
    if device in RNN_OUTSIDE_AUTOCAST:
        return True
    return (
        device == "cpu"
        and isinstance(rnn, nn.LSTM)
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and not _cpu_has_bf16()
    )


@functools.cache
def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # no such check in this torch: assume it has
        return True


def _module_call(
    rnn: nn.RNNBase, inputs: Tensor, lengths: Tensor | None, state: RNNState | None
) -> tuple[Tensor, RNNState]:
    if lengths is None:
        return rnn(inputs, state)  # type: ignore[no-any-return]
    packed = pack_padded_sequence(inputs, lengths.cpu(), batch_first=True, enforce_sorted=False)
    packed_out, final = rnn(packed, state)
    outputs, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=inputs.size(1))
    return outputs, final
