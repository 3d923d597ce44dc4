"""The recurrence of an ``nn.GRU`` / ``nn.LSTM`` over a whole sequence as one autograd
function: nmt's CPU fast path for the encoder and the decoders that run over all steps.

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
gates, states and their gradients in the parameters' dtype.

Equations (torch's conventions, gates in this order):

    GRU:   r = s(W_ir x + b_ir + W_hr h + b_hr)      z = s(W_iz x + b_iz + W_hz h + b_hz)
           n = tanh(W_in x + b_in + r * (W_hn h + b_hn))      h' = (1 - z) * n + z * h
    LSTM:  i, f, g, o = s, s, tanh, s (W_i* x + b_i* + W_h* h + b_h*)
           c' = f * c + i * g                                  h' = o * tanh(c')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from nmt.dropout import dropout
from nmt.runtime import compute_dtype

RNNState = Tensor | tuple[Tensor, Tensor]


def _loop_order(x: Tensor) -> Tensor:
    """(B, T, D, F) -> (D, T, B, F): each direction's steps in the order it takes them."""
    x = x.permute(2, 1, 0, 3)  # (D, T, B, F)
    return torch.stack([x[0], x[1].flip(0)]) if x.size(0) == 2 else x


def _time_order(x: Tensor) -> Tensor:
    """(D, T, B, F) in loop order -> (B, T, D*F) in time order."""
    parts = [x[0], x[1].flip(0)] if x.size(0) == 2 else [x[0]]
    return torch.cat(parts, dim=-1).transpose(0, 1).contiguous()


class _Layer(torch.autograd.Function):
    """One layer, all directions: inputs (B, T, I), keep (D, T, B, 1) float (1 where the
    loop's step is a real token) or None, h0/c0 (D, B, H), weights stacked over directions
    -> outputs (B, T, D*H), h_n (D, B, H), c_n (D, B, H) or None.

    Buffers are laid out (D, T, B, F) in loop order: step t of direction d is [d, t], so
    both directions of a step are one (D, B, F) view and all steps of a direction one matrix.
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
        x = _loop_order(inputs.to(compute).unsqueeze(2).expand(-1, -1, directions, -1))
        x = x.contiguous()  # (D, T, B, I)
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
        b_hn = b_hh[:, None, 2 * hidden :]  # (D, 1, H)
        w_h_t = w_h.transpose(1, 2)  # (D, H, G*H)

        # h before each step (h_0 .. h_{T-1}) as the matmuls take it, kept for W_hh's gradient;
        # in the states' dtype the two are one buffer, offset by a step
        if compute == h0.dtype:
            history = h0.new_empty(directions, steps + 1, batch, hidden)
            history[:, 0] = h0
            states, prev = history[:, 1:], history[:, :-1]  # h after each step, h before
        else:
            states = h0.new_empty(directions, steps, batch, hidden)
            prev = h0.new_empty(directions, steps, batch, hidden, dtype=compute)
        acts = h0.new_empty(directions, steps, batch, gate_size if lstm else 2 * hidden)
        extra = h0.new_empty(1 if lstm else 2, directions, steps, batch, hidden)
        cells = h0.new_empty(directions, steps, batch, hidden) if lstm else None
        h, c = h0, c0
        forward_step = _STEPS[lstm][0]
        for t in range(steps):
            if prev.dtype != h.dtype:
                prev[:, t].copy_(h)
            recurrent = torch.bmm(prev[:, t], w_h_t)  # (D, B, G*H)
            keep_t = keep[:, t] if keep is not None else None
            if lstm:
                assert c is not None and cells is not None
                forward_step(
                    gates_in[:, t],
                    recurrent,
                    c,
                    h,
                    keep_t,
                    acts[:, t],
                    extra[0, :, t],
                    cells[:, t],
                    states[:, t],
                )
                c = cells[:, t]
            else:
                forward_step(
                    gates_in[:, t],
                    recurrent,
                    b_hn,
                    h,
                    keep_t,
                    acts[:, t],
                    extra[0, :, t],
                    extra[1, :, t],
                    states[:, t],
                )
            h = states[:, t]
        outputs = states if keep is None else states * keep
        ctx.lstm, ctx.compute = lstm, compute
        ctx.input_dtype, ctx.weight_dtype = inputs.dtype, w_hh.dtype
        ctx.save_for_backward(x, keep, h0, c0, w_i, w_h, states, prev, acts, extra, cells)
        return _time_order(outputs), h.clone(), (c.clone() if lstm else None)  # type: ignore[union-attr]

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_outputs: Tensor, grad_h: Tensor | None, grad_c: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x, keep, h0, c0, w_i, w_h, states, prev, acts, extra, cells = ctx.saved_tensors
        lstm, compute = ctx.lstm, ctx.compute
        directions, steps, batch, hidden = states.shape
        gate_size = w_h.size(1)
        grad_out = _loop_order(grad_outputs.view(batch, steps, directions, hidden))
        grad_out = grad_out.to(states.dtype)  # (D, T, B, H)
        if keep is not None:
            grad_out = grad_out * keep  # (D, T, B, H)
        # gradients at the gates' pre-activations, of W_h h + b_h and (GRU: n only) W_i x + b_i
        grad_rec = torch.empty(directions, steps, batch, gate_size, dtype=compute)
        grad_n_in = None if lstm else torch.empty(directions, steps, batch, hidden, dtype=compute)
        dh = grad_h.to(states.dtype) if grad_h is not None else torch.zeros_like(h0)
        dropped = 1 - keep if keep is not None else None
        ones = torch.ones((), dtype=states.dtype)
        scratch = states.new_empty(directions, batch, 2 * hidden)
        scratch4 = states.new_empty(directions, batch, 4 * hidden) if lstm else None
        dc = None
        if lstm:
            dc = grad_c.to(states.dtype) if grad_c is not None else torch.zeros_like(h0)
        backward_step = _STEPS[lstm][1]
        for t in reversed(range(steps)):
            keep_t = keep[:, t] if keep is not None else None
            dropped_t = dropped[:, t] if dropped is not None else None
            if lstm:
                c_prev = cells[:, t - 1] if t > 0 else c0
                carry, dc = backward_step(
                    dh,
                    dc,
                    grad_out[:, t],
                    keep_t,
                    dropped_t,
                    acts[:, t],
                    extra[0, :, t],
                    c_prev,
                    ones,
                    scratch4,
                    grad_rec[:, t],
                )
            else:
                h_prev = states[:, t - 1] if t > 0 else h0
                carry = backward_step(
                    dh,
                    grad_out[:, t],
                    keep_t,
                    dropped_t,
                    acts[:, t],
                    extra[0, :, t],
                    extra[1, :, t],
                    h_prev,
                    ones,
                    scratch,
                    grad_rec[:, t],
                    grad_n_in[:, t],  # type: ignore[index]
                )
            dh = torch.bmm(grad_rec[:, t], w_h).to(states.dtype)  # (D, B, H)
            if carry is not None:
                dh += carry
        return (
            None,
            None,
            *_input_and_weight_grads(ctx, x, w_i, prev, grad_rec, grad_n_in, dh, dc),
        )


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
    if grad_n_in is None:  # LSTM: W_i x and W_h h enter the gates alike
        grad_in = grad_rec
    else:  # GRU: only the n gate differs (r scales W_hn h + b_hn, not W_in x + b_in)
        grad_in = torch.cat([grad_rec[..., : 2 * hidden], grad_n_in], dim=-1)
    grad_in = grad_in.view(directions, rows, gate_size)
    grad_rec = grad_rec.view(directions, rows, gate_size)
    grad_w_hh = torch.bmm(grad_rec.transpose(1, 2), prev.view(directions, rows, hidden))
    grad_w_ih = torch.bmm(grad_in.transpose(1, 2), x.view(directions, rows, -1))
    grad_x = torch.bmm(grad_in, w_i).to(ctx.input_dtype)  # (D, T*B, I)
    grad_x = grad_x.view(directions, steps, batch, -1)
    grad_x = grad_x[0] + grad_x[1].flip(0) if directions == 2 else grad_x[0]  # (T, B, I)
    weights = ctx.weight_dtype
    return (
        grad_x.transpose(0, 1),
        None,
        dh0,
        dc0,
        grad_w_ih.to(weights),
        grad_w_hh.to(weights),
        grad_in.sum(1).to(weights),  # accumulated in float32 by torch's reduction
        grad_rec.sum(1).to(weights),
    )


# ----------------------------------------------------------------------------- one step
# The elementwise work of one time step, both directions at once, written into the loop's
# buffers (few, fused ops: on the small per-step tensors each op costs about as much as its
# arithmetic). torch.compile fuses each into one loop, 5-20x faster alone, but its per-call
# overhead made training 6% slower (docs/benchmarks.md), so they run eagerly.


def _gru_forward_step(
    gate_in: Tensor,
    recurrent: Tensor,
    b_hn: Tensor,
    h: Tensor,
    keep: Tensor | None,
    act_out: Tensor,
    n_out: Tensor,
    h_n_out: Tensor,
    h_out: Tensor,
) -> None:
    """gate_in = W_i x + b_i (+ b_hr, b_hz), recurrent = W_h h: (D, B, 3H) -> r and z into
    act_out (D, B, 2H), n, W_hn h + b_hn, and h' into their (D, B, H) buffers."""
    hidden = h.size(-1)
    act = torch.sigmoid(gate_in[..., : 2 * hidden] + recurrent[..., : 2 * hidden], out=act_out)
    h_n = torch.add(recurrent[..., 2 * hidden :], b_hn, out=h_n_out)
    n = torch.tanh(torch.addcmul(gate_in[..., 2 * hidden :], act[..., :hidden], h_n), out=n_out)
    if keep is None:  # (1 - z) n + z h
        torch.addcmul(n, act[..., hidden:], h - n, out=h_out)
    else:  # lerp is exact for weights 0 and 1: a finished sentence keeps its state
        torch.lerp(h, torch.addcmul(n, act[..., hidden:], h - n), keep, out=h_out)


def _gru_backward_step(
    dh: Tensor,
    grad_out: Tensor,
    keep: Tensor | None,
    dropped: Tensor | None,
    act: Tensor,
    n: Tensor,
    h_n: Tensor,
    h_prev: Tensor,
    ones: Tensor,
    scratch: Tensor,
    grads_out: Tensor,
    grad_n_in_out: Tensor,
) -> Tensor:
    """dh: gradient of h' from the next step -> the gates' gradients into grads_out (D, B, 3H:
    r, z, W_hn h + b_hn) and grad_n_in_out (n's pre-activation); returns the part of dh_prev
    that does not go through W_h."""
    hidden = h_prev.size(-1)
    dh = dh + grad_out
    dh_step = dh if keep is None else dh * keep
    gate_r, gate_z = act[..., :hidden], act[..., hidden:]
    dn = torch.addcmul(dh_step, dh_step, gate_z, value=-1)  # dh (1 - z)
    dn *= torch.addcmul(ones, n, n, value=-1)  # at n's pre-activation: (1 - n^2)
    torch.mul(dn, h_n, out=scratch[..., :hidden])  # dr = dn h_n
    torch.sub(h_prev, n, out=scratch[..., hidden:]).mul_(dh_step)  # dz = dh (h - n)
    slopes = torch.addcmul(act, act, act, value=-1)  # s'(r), s'(z)
    torch.mul(scratch, slopes, out=grads_out[..., : 2 * hidden])
    torch.mul(dn, gate_r, out=grads_out[..., 2 * hidden :])
    grad_n_in_out.copy_(dn)
    carry = dh_step * gate_z
    if dropped is not None:
        carry.addcmul_(dh, dropped)  # a finished sentence passes dh through
    return carry


def _lstm_forward_step(
    gate_in: Tensor,
    recurrent: Tensor,
    c: Tensor,
    h: Tensor,
    keep: Tensor | None,
    act_out: Tensor,
    tanh_c_out: Tensor,
    c_out: Tensor,
    h_out: Tensor,
) -> None:
    """gate_in = W_i x + b_i + b_h, recurrent = W_h h: (D, B, 4H) -> i, f, g, o into act_out,
    tanh(c'), c' and h' into their (D, B, H) buffers."""
    hidden = h.size(-1)
    pre = gate_in + recurrent
    act = torch.sigmoid(pre, out=act_out)  # i, f, (g), o
    gate_g = torch.tanh(pre[..., 2 * hidden : 3 * hidden], out=act[..., 2 * hidden : 3 * hidden])
    c_new = torch.addcmul(act[..., hidden : 2 * hidden] * c, act[..., :hidden], gate_g)
    tanh_c = torch.tanh(c_new, out=tanh_c_out)
    if keep is None:
        c_out.copy_(c_new)
        torch.mul(act[..., 3 * hidden :], tanh_c, out=h_out)
    else:  # lerp is exact for weights 0 and 1
        torch.lerp(c, c_new, keep, out=c_out)
        torch.lerp(h, act[..., 3 * hidden :] * tanh_c, keep, out=h_out)


def _lstm_backward_step(
    dh: Tensor,
    dc: Tensor,
    grad_out: Tensor,
    keep: Tensor | None,
    dropped: Tensor | None,
    act: Tensor,
    tanh_c: Tensor,
    c_prev: Tensor,
    ones: Tensor,
    scratch: Tensor,
    grads_out: Tensor,
) -> tuple[Tensor | None, Tensor]:
    """dh, dc: gradients of h' and c' from the next step -> the gates' gradients into
    grads_out (D, B, 4H); returns the part of dh_prev that does not go through W_h (None
    when no sentence has finished) and dc_prev."""
    hidden = c_prev.size(-1)
    dh = dh + grad_out
    dh_step = dh if keep is None else dh * keep
    dc_step = dc if keep is None else dc * keep
    gate_i, gate_f = act[..., :hidden], act[..., hidden : 2 * hidden]
    gate_g, gate_o = act[..., 2 * hidden : 3 * hidden], act[..., 3 * hidden :]
    dc_new = torch.addcmul(ones, tanh_c, tanh_c, value=-1).mul_(gate_o)
    dc_new = torch.addcmul(dc_step, dh_step, dc_new)  # + dh o (1 - tanh(c)^2)
    slopes = torch.addcmul(act, act, act, value=-1)  # s'(x) = s (1 - s)
    torch.addcmul(ones, gate_g, gate_g, value=-1, out=slopes[..., 2 * hidden : 3 * hidden])
    torch.mul(dc_new, gate_g, out=scratch[..., :hidden])
    torch.mul(dc_new, c_prev, out=scratch[..., hidden : 2 * hidden])
    torch.mul(dc_new, gate_i, out=scratch[..., 2 * hidden : 3 * hidden])
    torch.mul(dh_step, tanh_c, out=scratch[..., 3 * hidden :])
    torch.mul(scratch, slopes, out=grads_out)
    dc_prev = dc_new * gate_f
    if dropped is None:
        return None, dc_prev
    dc_prev.addcmul_(dc, dropped)
    return dh * dropped, dc_prev


_STEPS: dict[bool, tuple[Callable[..., Any], Callable[..., Any]]] = {
    False: (_gru_forward_step, _gru_backward_step),
    True: (_lstm_forward_step, _lstm_backward_step),
}


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
                h0[rows].to(weights),
                c0[rows].to(weights) if c0 is not None else None,
                *params,
            )
            hiddens.append(h_n)
            cells.append(c_n)
            if layer < rnn.num_layers - 1:
                x = dropout(x, rnn.dropout, rnn.training)
    hidden = torch.cat(hiddens)
    return x, ((hidden, torch.cat(cells)) if lstm else hidden)
