"""The elementwise work of one RNN time step, both directions at once, as torch ops: what
nmt.fast.recurrence runs where the compiled kernels (nmt.fast.compiled) cannot.

Each function writes into the loop's buffers with few, fused ops: on the small per-step tensors
each op costs about as much as its arithmetic. torch.compile fuses each into one loop, but its
per-call overhead costs more than that saves (docs/benchmarks.md), so they run eagerly.
Equations and gate order: nmt.fast.recurrence.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _tanh(x: Tensor, out: Tensor) -> Tensor:
    """tanh(x) into out (x itself allowed) as 2 sigmoid(2x) - 1, since torch's CPU float32
    tanh is several times slower than its sigmoid. It differs from tanh by a few units of the
    dtype's rounding step at 0.5."""
    return torch.sigmoid_(torch.mul(x, 2, out=out)).mul_(2).sub_(1)


def gru_gates(pre: Tensor, out: Tensor) -> Tensor:
    """pre = (W_hr h + W_ir x + b_r, W_hz h + W_iz x + b_z, W_hn h + b_hn) (D, B, 3H) in the
    matmul dtype -> r, z and W_hn h + b_hn in out (D, B, 3H, float32)."""
    hidden = pre.size(-1) // 3
    torch.sigmoid_(out.copy_(pre)[..., : 2 * hidden])
    return out


def gru_forward_step(
    gates: Tensor, n_in: Tensor, h: Tensor, keep: Tensor | None, n_out: Tensor, h_out: Tensor
) -> None:
    """gates = r, z, W_hn h + b_hn (D, B, 3H), n_in = W_in x + b_in (D, B, H) -> n and h'
    into their (D, B, H) buffers."""
    hidden = h.size(-1)
    gate_z = gates[..., hidden : 2 * hidden]
    n = torch.addcmul(n_in, gates[..., :hidden], gates[..., 2 * hidden :], out=n_out)
    _tanh(n, n)
    if keep is None:  # (1 - z) n + z h
        torch.lerp(n, h, gate_z, out=h_out)
    else:  # lerp is exact for weights 0 and 1: a finished sentence keeps its state
        torch.lerp(h, torch.lerp(n, h, gate_z), keep, out=h_out)


def gru_backward_step(
    dh: Tensor,
    grad_out: Tensor,
    keep: Tensor | None,
    dropped: Tensor | None,
    act: Tensor,
    n: Tensor,
    h_prev: Tensor,
    ones: Tensor,
    scratch: Tensor,
    grads_out: Tensor,
    grad_n_in_out: Tensor,
) -> Tensor:
    """dh: gradient of h' from the next step (updated in place) -> the gates' gradients into
    grads_out (D, B, 3H: r, z, W_hn h + b_hn) and grad_n_in_out (n's pre-activation); returns
    the part of dh_prev that does not go through W_h."""
    hidden = h_prev.size(-1)
    dh += grad_out
    dh_step = dh if keep is None else dh * keep
    gates = act[..., : 2 * hidden]
    gate_r, gate_z, h_n = act[..., :hidden], act[..., hidden : 2 * hidden], act[..., 2 * hidden :]
    dn = torch.addcmul(dh_step, dh_step, gate_z, value=-1)  # dh (1 - z)
    dn *= torch.addcmul(ones, n, n, value=-1)  # at n's pre-activation: (1 - n^2)
    torch.mul(dn, h_n, out=scratch[..., :hidden])  # dr = dn h_n
    torch.sub(h_prev, n, out=scratch[..., hidden:]).mul_(dh_step)  # dz = dh (h - n)
    slopes = torch.addcmul(gates, gates, gates, value=-1)  # s'(r), s'(z)
    torch.mul(scratch, slopes, out=grads_out[..., : 2 * hidden])
    torch.mul(dn, gate_r, out=grads_out[..., 2 * hidden :])
    grad_n_in_out.copy_(dn)
    carry = dh_step * gate_z
    if dropped is not None:
        carry.addcmul_(dh, dropped)  # a finished sentence passes dh through
    return carry


def lstm_forward_step(
    pre: Tensor,
    c: Tensor,
    h: Tensor,
    keep: Tensor | None,
    act_out: Tensor,
    tanh_c_out: Tensor,
    c_out: Tensor,
    h_out: Tensor,
) -> None:
    """pre = W_i x + b_i + W_h h + b_h (D, B, 4H) in the matmul dtype -> i, f, g, o into
    act_out, tanh(c'), c' and h' into their (D, B, H) buffers."""
    hidden = h.size(-1)
    act = act_out.copy_(pre)
    act[..., 2 * hidden : 3 * hidden].mul_(2)
    torch.sigmoid_(act)  # i, f, o, and g as sigmoid(2x)
    gate_g = act[..., 2 * hidden : 3 * hidden].mul_(2).sub_(1)  # tanh x = 2 sigmoid(2x) - 1
    c_new = c_out if keep is None else torch.empty_like(c)
    torch.mul(act[..., hidden : 2 * hidden], c, out=c_new).addcmul_(act[..., :hidden], gate_g)
    tanh_c = _tanh(c_new, tanh_c_out)
    if keep is None:
        torch.mul(act[..., 3 * hidden :], tanh_c, out=h_out)
    else:  # lerp is exact for weights 0 and 1
        torch.lerp(c, c_new, keep, out=c_out)
        torch.lerp(h, act[..., 3 * hidden :] * tanh_c, keep, out=h_out)


def lstm_backward_step(
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
