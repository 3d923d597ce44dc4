"""nmt.fast.recurrence: the whole-sequence recurrence (float32, through the compiled step
kernels) against a float64 loop written from the GRU and LSTM equations, sentence by sentence
over its real tokens only, and against torch's packed nn.GRU/nn.LSTM in float64: outputs,
final states and every gradient, with padding present."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.fast import compiled
from nmt.fast.recurrence import run_rnn, runs_here

pytestmark = pytest.mark.skipif(
    compiled.library() is None, reason=f"no compiled kernels: {compiled.status()}"
)

INPUT, HIDDEN = 5, 7
LENGTHS = [6, 3, 1, 5, 6]  # padding present, a one-token sentence, unsorted
# nearly equal lengths, as bucketed batches have: the steps that every sentence (and, in a
# bidirectional layer, both directions) still takes run without the mask, the others with it
EVEN_LENGTHS = [6, 6, 5, 6]
CASES = list(itertools.product(["gru", "lstm"], [False, True], [1, 2], ["ragged", "even"]))
IDS = [f"{cell}-{'bi' if bi else 'uni'}-L{layers}-{kind}" for cell, bi, layers, kind in CASES]


def _rnn(cell: str, bidirectional: bool, layers: int, dtype=torch.float64) -> nn.RNNBase:
    cls = nn.GRU if cell == "gru" else nn.LSTM
    rnn = cls(INPUT, HIDDEN, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    with torch.no_grad():  # clearly non-zero biases and weights
        for param in rnn.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return rnn.to(dtype)


def _inputs(directions: int, layers: int, lstm: bool, dtype=torch.float64, lengths=LENGTHS):
    batch, steps = len(lengths), max(lengths)
    x = torch.randn(batch, steps, INPUT, dtype=dtype)
    lengths = torch.tensor(lengths)
    x = x * (torch.arange(steps)[None, :, None] < lengths[:, None, None])  # zero padding
    h0 = torch.randn(layers * directions, batch, HIDDEN, dtype=dtype)
    c0 = torch.randn(layers * directions, batch, HIDDEN, dtype=dtype) if lstm else None
    return x, lengths, h0, c0


def _cell(rnn: nn.RNNBase, suffix: str, x, h, c):
    """One step of torch's GRU/LSTM equations, written out; x (I,), h/c (H,)."""
    w_ih, w_hh = getattr(rnn, f"weight_ih_{suffix}"), getattr(rnn, f"weight_hh_{suffix}")
    b_ih, b_hh = getattr(rnn, f"bias_ih_{suffix}"), getattr(rnn, f"bias_hh_{suffix}")
    gi, gh = w_ih @ x + b_ih, w_hh @ h + b_hh
    if isinstance(rnn, nn.GRU):
        r = torch.sigmoid(gi[:HIDDEN] + gh[:HIDDEN])
        z = torch.sigmoid(gi[HIDDEN : 2 * HIDDEN] + gh[HIDDEN : 2 * HIDDEN])
        n = torch.tanh(gi[2 * HIDDEN :] + r * gh[2 * HIDDEN :])
        return (1 - z) * n + z * h, None
    i, f, g, o = (gi + gh).split(HIDDEN)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def reference(rnn: nn.RNNBase, x, lengths, h0, c0):
    """Sentence by sentence, layer by layer, each direction over the real tokens only ->
    outputs (B, T, D*H) zero past each length, final h (and c) (L*D, B, H)."""
    directions = 2 if rnn.bidirectional else 1
    outputs, finals_h, finals_c = [], [], []
    for b, length in enumerate(lengths.tolist()):
        layer_in = [x[b, t] for t in range(length)]
        hs, cs = [], []
        for layer in range(rnn.num_layers):
            per_direction = []
            for d in range(directions):
                row = layer * directions + d
                h, c = h0[row, b], (c0[row, b] if c0 is not None else None)
                order = range(length) if d == 0 else reversed(range(length))
                out = [None] * length
                for t in order:
                    h, c = _cell(rnn, f"l{layer}" + ("_reverse" if d else ""), layer_in[t], h, c)
                    out[t] = h
                per_direction.append(out)
                hs.append(h)
                cs.append(c)
            layer_in = [torch.cat([p[t] for p in per_direction]) for t in range(length)]
        padded = torch.zeros(x.size(1), directions * HIDDEN, dtype=x.dtype)
        padded[:length] = torch.stack(layer_in)
        outputs.append(padded)
        finals_h.append(torch.stack(hs))
        finals_c.append(torch.stack(cs) if c0 is not None else None)
    hidden = torch.stack(finals_h, dim=1)
    cell = torch.stack(finals_c, dim=1) if c0 is not None else None
    return torch.stack(outputs), hidden, cell


def _state(h0, c0):
    return (h0, c0) if c0 is not None else h0


def _split(final):
    return final if isinstance(final, tuple) else (final, None)


def _grads(rnn, x, h0, c0, outputs, hidden, cell, weights):
    """Gradients of a random projection of every output, w.r.t. inputs, state and weights."""
    loss = (outputs * weights[0]).sum() + (hidden * weights[1]).sum()
    if cell is not None:
        loss = loss + (cell * weights[2]).sum()
    wrt = [x, h0] + ([c0] if c0 is not None else []) + list(rnn.parameters())
    return torch.autograd.grad(loss, wrt)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


@pytest.mark.parametrize(("cell", "bidirectional", "layers", "kind"), CASES, ids=IDS)
def test_matches_equations_and_packed_torch(cell, bidirectional, layers, kind) -> None:
    torch.manual_seed(0)
    wide = _rnn(cell, bidirectional, layers)  # float64: the equations' and torch's
    rnn = _rnn(cell, bidirectional, layers, torch.float32)
    rnn.load_state_dict(wide.state_dict())
    directions = 2 if bidirectional else 1
    lengths = LENGTHS if kind == "ragged" else EVEN_LENGTHS
    x64, lengths, h064, c064 = _inputs(directions, layers, cell == "lstm", lengths=lengths)
    x64, h064, c064 = _leaves(x64, h064, c064)
    x, h0, c0 = _leaves(*(t.float() if t is not None else None for t in (x64, h064, c064)))
    mask = torch.arange(x.size(1))[None] < lengths[:, None]
    assert runs_here(rnn, x)

    outputs, final = run_rnn(rnn, x, mask, _state(h0, c0))
    hidden, cell_state = _split(final)
    ref_out, ref_h, ref_c = reference(wide, x64, lengths, h064, c064)
    packed = pack_padded_sequence(x64, lengths, batch_first=True, enforce_sorted=False)
    torch_packed, torch_final = wide(packed, _state(h064, c064))
    torch_out, _ = pad_packed_sequence(torch_packed, batch_first=True, total_length=x.size(1))
    torch_h, torch_c = _split(torch_final)

    assert outputs.shape == (len(lengths), int(lengths.max()), directions * HIDDEN)
    assert outputs.dtype == torch.float32
    assert (outputs[~mask] == 0).all()  # nothing past a sentence's end
    theirs = [(outputs, ref_out, torch_out), (hidden, ref_h, torch_h)]
    if cell == "lstm":
        theirs.append((cell_state, ref_c, torch_c))
    for ours, ref, packed_torch in theirs:
        torch.testing.assert_close(ref, packed_torch, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-6)

    weights = [torch.randn_like(t, dtype=torch.float64) for t in (outputs, hidden, hidden)]
    ours = _grads(rnn, x, h0, c0, outputs, hidden, cell_state, [w.float() for w in weights])
    refs = _grads(wide, x64, h064, c064, ref_out, ref_h, ref_c, weights)
    for g_ours, g_ref in zip(ours, refs, strict=True):
        assert g_ours.dtype == torch.float32
        torch.testing.assert_close(g_ours.double(), g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_without_mask_and_state_equals_unpacked_torch(cell) -> None:
    torch.manual_seed(1)
    wide = _rnn(cell, False, 2)
    rnn = _rnn(cell, False, 2, torch.float32)
    rnn.load_state_dict(wide.state_dict())
    x64 = torch.randn(3, 4, INPUT, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float().requires_grad_()
    outputs, final = run_rnn(rnn, x, None, None)
    torch_out, torch_final = wide(x64)
    torch.testing.assert_close(outputs.double(), torch_out, rtol=0, atol=2e-6)
    for ours, theirs in zip(_split(final), _split(torch_final), strict=True):
        if theirs is not None:
            torch.testing.assert_close(ours.double(), theirs, rtol=0, atol=2e-6)
    grad = torch.randn_like(torch_out)
    (ours,) = torch.autograd.grad(outputs, x, grad.float())
    (theirs,) = torch.autograd.grad(torch_out, x64, grad)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_bf16_autocast_stays_close_to_float32(cell) -> None:
    """Under autocast the matmuls run in bf16, the gates and states in float32."""
    torch.manual_seed(3)
    rnn = _rnn(cell, True, 2, torch.float32)
    x, lengths, h0, c0 = _inputs(2, 2, cell == "lstm", torch.float32)
    x.requires_grad_(True)
    mask = torch.arange(x.size(1))[None] < lengths[:, None]
    ref_out, ref_final = run_rnn(rnn, x, mask, _state(h0, c0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, final = run_rnn(rnn, x, mask, _state(h0, c0))
    assert out.dtype == torch.float32  # states are kept in the weights' dtype
    torch.testing.assert_close(out, ref_out, rtol=0, atol=3e-2)
    torch.testing.assert_close(_split(final)[0], _split(ref_final)[0], rtol=0, atol=3e-2)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, [x, *rnn.parameters()], grad)
    refs = torch.autograd.grad(ref_out, [x, *rnn.parameters()], grad)
    for g_ours, g_ref in zip(ours, refs, strict=True):
        assert g_ours.dtype == g_ref.dtype
        error = (g_ours - g_ref).norm() / g_ref.norm()
        assert error < 3e-2, error


def test_dropout_between_layers_only_in_training() -> None:
    torch.manual_seed(4)
    rnn = _rnn("gru", True, 2, torch.float32)
    rnn.dropout = 0.5
    x, lengths, _, _ = _inputs(2, 2, False, torch.float32)
    mask = torch.arange(x.size(1))[None] < lengths[:, None]
    rnn.eval()
    evaluated, _ = run_rnn(rnn, x, mask, None)
    rnn.dropout = 0.0
    undropped, _ = run_rnn(rnn, x, mask, None)
    torch.testing.assert_close(evaluated, undropped, rtol=0, atol=0)
    rnn.dropout = 0.5
    rnn.train()
    dropped, _ = run_rnn(rnn, x, mask, None)
    assert (dropped - undropped).abs().max() > 1e-3
    assert (dropped[~mask] == 0).all()  # padding stays zero
