"""The recurrence of an ``nn.GRU`` / ``nn.LSTM`` over a whole sequence, a layer at a time as
one autograd function: nmt's CPU training path for the encoder and the decoders that run over
all steps. ``plain_rnn`` beside it is the module's own call (packed when lengths are given),
the reference.

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

The modules: nmt.fast.gru and nmt.fast.lstm, a layer of each cell kind with its equations and
its steps; nmt.fast.layer, what they share (the loops through time). Each step's elementwise
work runs as one compiled kernel (kernels.c, through nmt.fast.compiled), so the recurrence runs
where those run (``runs_here``: the model's ``FastPaths.native_kernels``, a C compiler, float32
states); elsewhere the module's own call (``plain_rnn``) does.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from nmt.fast import compiled
from nmt.fast.cells import TABLE_LIMIT
from nmt.fast.dropout import dropout
from nmt.fast.gru import GRULayer
from nmt.fast.layer import Loop, input_bias, input_gates
from nmt.fast.lstm import LSTMLayer
from nmt.runtime import compute_dtype

RNNState = Tensor | tuple[Tensor, Tensor]


def runs_here(rnn: nn.RNNBase, inputs: Tensor) -> bool:
    """Whether ``run_rnn`` can run ``rnn`` over ``inputs``: its compiled step kernels take the
    weights' dtype as the states' and the matmuls' dtype here (``compiled.rnn_steps_run``)."""
    weights = next(rnn.parameters()).dtype
    return compiled.rnn_steps_run(inputs.device, weights, compute_dtype(inputs.device, weights))


def run_rnn(
    rnn: nn.RNNBase,
    inputs: Tensor | None,
    mask: Tensor | None,
    state: RNNState | None,
    gates: Tensor | None = None,
) -> tuple[Tensor, RNNState]:
    """A batch-first ``nn.GRU``/``nn.LSTM`` over ``inputs`` as the packed module would run it,
    where ``runs_here``.

    inputs: (B, T, I); mask: (B, T), True at each sentence's tokens (a prefix of its row), or
    None when every position is real; state: (L*D, B, H), a tuple (h, c) for an LSTM, or None
    for zeros -> outputs (B, T, D*H), zero past each sentence's end, and the final state in
    the module's layout (the state at each sentence's last token). ``gates``: instead of
    inputs, the first layer's input gates (D, T, B, G*H) in loop order (``looked_up``: search,
    without gradient).
    """
    directions = 2 if rnn.bidirectional else 1
    weights = next(rnn.parameters()).dtype
    given = inputs if inputs is not None else gates
    assert given is not None and (gates is None or not torch.is_grad_enabled())
    compute = compute_dtype(given.device, weights)
    batch = given.size(0) if inputs is not None else given.size(2)
    h0, c0 = _initial_state(rnn, given, batch, state, weights)
    keep = None
    if mask is not None:
        step_keep = mask.t().to(weights)  # (T, B)
        keep = torch.stack([step_keep, step_keep.flip(0)][:directions])[..., None]  # (D, T, B, 1)
    loop = Loop(keep, compute, gates)
    x = inputs
    hiddens, cells = [], []
    with torch.autocast(given.device.type, enabled=False):
        for layer in range(rnn.num_layers):
            rows = slice(layer * directions, (layer + 1) * directions)
            h0_layer = h0[rows].to(weights).contiguous()
            params = _layer_parameters(rnn, layer)
            if not isinstance(rnn, nn.LSTM):
                x, h_n = GRULayer.apply(loop, x, h0_layer, *params)
            else:
                assert c0 is not None
                c0_layer = c0[rows].to(weights).contiguous()
                x, h_n, c_n = LSTMLayer.apply(loop, x, h0_layer, c0_layer, *params)
                cells.append(c_n)
            hiddens.append(h_n)
            loop = replace(loop, gates=None)  # a later layer multiplies its inputs
            if layer < rnn.num_layers - 1:
                x = dropout(x, rnn.dropout, rnn.training)
    hidden = torch.cat(hiddens)
    assert x is not None
    return x, ((hidden, torch.cat(cells)) if c0 is not None else hidden)


def gate_table(embed: nn.Embedding, rnn: nn.RNNBase) -> Tensor | None:
    """The first layer's input gates of every piece of ``embed`` per direction, as ``run_rnn``
    forms them (W_i E_x + ``layer.input_bias``): (D, V, G*H), without gradient, for search to
    look up (``looked_up``) instead of multiplying, valid until the weights change. None
    where ``run_rnn`` cannot run ``rnn`` over the embedding (``runs_here``; a batch-first
    GRU/LSTM without projections in the embedding's dtype) or a direction's table would hold
    more than ``cells.TABLE_LIMIT`` values."""
    weight: Tensor = embed.weight
    if (
        not isinstance(rnn, (nn.GRU, nn.LSTM))
        or not rnn.batch_first
        or rnn.proj_size > 0
        or next(rnn.parameters()).dtype != weight.dtype
        or not runs_here(rnn, weight)
    ):
        return None
    w_ih, _, b_ih, b_hh = _layer_parameters(rnn, 0)  # (D, G*H, E), ..., (D, G*H)
    if weight.size(0) * w_ih.size(1) > TABLE_LIMIT:
        return None
    with torch.no_grad():
        bias = input_bias(b_ih, b_hh, gru=not isinstance(rnn, nn.LSTM))
        return input_gates(weight.expand(w_ih.size(0), 1, -1, -1), w_ih, bias)[:, 0]


def real_positions(lengths: Tensor, steps: int, device: torch.device) -> Tensor:
    """(B, T) bool: True at each sentence's tokens, a prefix of its row of ``steps``."""
    positions = torch.arange(steps, device=device)  # (T,)
    return positions[None, :] < lengths.to(device)[:, None]


def looked_up(table: Tensor, src: Tensor) -> Tensor:
    """The input gates of source ids src (B, T) from ``gate_table``'s table (D, V, G*H), in
    ``run_rnn``'s loop order (D, T, B, G*H): the backward direction's steps reversed in
    time."""
    directions, _, width = table.shape
    ids = src.t()  # (T, B)
    gates = table.new_empty(directions, *ids.shape, width)
    for d in range(directions):
        order = ids if d == 0 else ids.flip(0)
        torch.index_select(table[d], 0, order.reshape(-1), out=gates[d].view(-1, width))
    return gates


def _initial_state(
    rnn: nn.RNNBase, like: Tensor, batch: int, state: RNNState | None, weights: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """h0 and (LSTM) c0 (L*D, B, H): the given state, or zeros."""
    if state is None:
        directions = 2 if rnn.bidirectional else 1
        shape = (rnn.num_layers * directions, batch, rnn.hidden_size)
        state = like.new_zeros(shape, dtype=weights)
        if isinstance(rnn, nn.LSTM):
            state = (state, torch.zeros_like(state))
    return state if isinstance(state, tuple) else (state, None)


def _layer_parameters(rnn: nn.RNNBase, layer: int) -> list[Tensor]:
    """A layer's weight_ih, weight_hh, bias_ih and bias_hh, stacked over its directions."""
    names = [f"l{layer}", f"l{layer}_reverse"][: 2 if rnn.bidirectional else 1]
    return [
        torch.stack([getattr(rnn, f"{kind}_{name}") for name in names])
        for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    ]


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


def unpacked_rnn(
    rnn: nn.RNNBase, inputs: Tensor, lengths: Tensor, state: Tensor | None, training: bool
) -> tuple[Tensor, Tensor]:
    """A batch-first ``nn.GRU`` over ``inputs`` (B, T, I) as the packed call runs it, with
    the lengths (B,), each at least 1, on the inputs' device and never read on the host, and
    no shape that depends on them: what a CUDA graph of a whole training step holds
    (``Seq2Seq.static_loss``) -> outputs (B, T, D*H), zero past each end, and the final
    state (L*D, B, H) at each sentence's last token.

    Each layer runs each direction as a call of its own over the padded rows: the forward
    one over the rows as they are (a position's output never depends on the padding after
    it), the backward one over each row reversed within its length (``reversal``), its
    outputs put back in order. A final state is an output: the forward direction's at the
    last token, the backward direction's at the first. An LSTM's final cell is no output, so
    this path is for GRUs. Dropout between layers as the module's (``rnn.dropout``). Under
    autocast on a GPU the RNN runs outside it in the weights' dtype, as ``plain_rnn``'s."""
    if not isinstance(rnn, nn.GRU):
        raise ValueError("unpacked_rnn runs a GRU: an LSTM's final cell is no output")
    directions = 2 if rnn.bidirectional else 1
    weights = next(rnn.parameters()).dtype
    steps = inputs.size(1)
    real = real_positions(lengths, steps, inputs.device)  # (B, T)
    order = reversal(lengths, steps)  # (B, T)
    last = (lengths - 1)[:, None, None]  # (B, 1, 1)
    h0 = _initial_state(rnn, inputs, inputs.size(0), state, weights)[0]
    outside = _outside_autocast(rnn, inputs.device.type)
    x = inputs.to(weights) if outside else inputs
    finals = []
    with (
        torch.autocast(inputs.device.type, enabled=False) if outside else contextlib.nullcontext(),
        warnings.catch_warnings(),
    ):
        # one direction's weights are a slice of the module's cuDNN buffer, which cuDNN may
        # copy into one of their own each call (a graph replays the copy): not a user's fault
        warnings.filterwarnings("ignore", message="RNN module weights are not part of single")
        for layer in range(rnn.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"l{layer}" + ("_reverse" if direction else "")
                params = [
                    getattr(rnn, f"{kind}_{suffix}")
                    for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")[
                        : 4 if rnn.bias else 2
                    ]
                ]
                row = layer * directions + direction
                seen = x if not direction else _in_order(x, order)
                out, _ = torch.gru(
                    seen,
                    h0[row : row + 1].to(weights),
                    params,
                    rnn.bias,
                    1,
                    0.0,
                    training,
                    False,
                    True,
                )  # (B, T, H)
                if direction:
                    out = _in_order(out, order)  # back in the sentence's order
                    finals.append(out[:, 0])  # the state after its first token
                else:
                    finals.append(out.gather(1, last.expand(-1, -1, out.size(-1))).squeeze(1))
                outputs.append(out)
            x = torch.cat(outputs, dim=-1) if directions > 1 else outputs[0]
            if layer < rnn.num_layers - 1:
                x = dropout(x, rnn.dropout, training)
    return x.masked_fill(~real[..., None], 0.0), torch.stack(finals)


def reversal(lengths: Tensor, steps: int) -> Tensor:
    """(B, T) positions: each row's first ``lengths[b]`` in reverse, the rest in place (its
    own inverse)."""
    positions = torch.arange(steps, device=lengths.device)
    flipped = lengths[:, None] - 1 - positions
    return torch.where(flipped >= 0, flipped, positions)


def _in_order(x: Tensor, order: Tensor) -> Tensor:
    """x (B, T, F) with row b's positions taken in ``order[b]`` (B, T)."""
    return x.gather(1, order[..., None].expand(-1, -1, x.size(-1)))


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
    packed_out, final = rnn(packed_sequence(inputs, lengths), state)
    if inputs.device.type == "cuda":
        return unwaited_unpack(packed_out, inputs.size(1)), final
    outputs, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=inputs.size(1))
    return outputs, final


def packed_sequence(inputs: Tensor, lengths: Tensor) -> PackedSequence:
    """``pack_padded_sequence(inputs, lengths, batch_first=True, enforce_sorted=False)``; on
    a GPU the same sequence made without waiting for it (``unwaited_pack``)."""
    if inputs.device.type == "cuda":
        return unwaited_pack(inputs, lengths)
    return pack_padded_sequence(inputs, lengths.cpu(), batch_first=True, enforce_sorted=False)


def unwaited_pack(inputs: Tensor, lengths: Tensor) -> PackedSequence:
    """The packed sequence of ``pack_padded_sequence(..., enforce_sorted=False)``, the
    lengths sorted on the host (where training keeps them, ``nmt.training.batches.to_device``;
    a GPU's are copied back first) and the order sent to a GPU through page-locked memory,
    not by the blocking copy that waits for every kernel queued before it. (Elsewhere torch's
    own call packs: the ONNX export traces it.)"""
    host_lengths, order = torch.sort(lengths.cpu(), descending=True)
    if inputs.device.type == "cuda":
        order = order.pin_memory().to(inputs.device, non_blocking=True)
    packed = pack_padded_sequence(
        inputs.index_select(0, order), host_lengths, batch_first=True, enforce_sorted=True
    )
    positions = torch.arange(len(order), device=order.device)
    restore = torch.empty_like(order).scatter_(0, order, positions)
    return PackedSequence(packed.data, packed.batch_sizes, order, restore)


def unwaited_unpack(packed: PackedSequence, total_length: int) -> Tensor:
    """The outputs of ``pad_packed_sequence(packed, batch_first=True, total_length=...)``
    without its lengths, which torch restores to the batch's order by indexing with a host
    copy of ``unsorted_indices``: on a GPU a copy back that waits for every kernel queued
    before it. Here the rows are unpadded in sorted order (the batch sizes are on the host)
    and put back in the batch's order on the device."""
    in_order = PackedSequence(packed.data, packed.batch_sizes)
    outputs, _ = pad_packed_sequence(in_order, batch_first=True, total_length=total_length)
    if packed.unsorted_indices is None:
        return outputs
    return outputs.index_select(0, packed.unsorted_indices)
