"""The graph-ready decoder step (nmt.fast.cells, FastPaths.graphs) against the module's own
call, in float64 with random inputs: one step of a GRU and an LSTM, one and two layers, and
their gradients; then every step-by-step decoder's training loss and gradients through the
cells, on a batch padded to its static shape (nmt.data.batching), against the plain path on
the unpadded batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from nmt.config import from_dict
from nmt.data.batching import batch_shape, make_batch
from nmt.fast import FastPaths, cells, sinks
from nmt.fast.cells import input_gate_table, rnn_step
from nmt.model import build_model
from nmt.model.decoder import Prepared
from nmt.model.seq2seq import Guide


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("layers", [1, 2])
def test_a_cell_step_is_the_modules_step(kind: type[nn.RNNBase], layers: int) -> None:
    torch.manual_seed(layers)
    rnn = kind(5, 7, num_layers=layers, batch_first=True).double()
    with torch.no_grad():
        for param in rnn.parameters():
            param.add_(0.5 * torch.randn_like(param))
    x = torch.randn(3, 1, 5, dtype=torch.float64, requires_grad=True)
    h = torch.randn(layers, 3, 7, dtype=torch.float64, requires_grad=True)
    state = (h, torch.randn_like(h).requires_grad_()) if kind is nn.LSTM else h
    want_out, want_state = rnn(x, state)
    got_out, got_state = rnn_step(rnn, x, state)
    wants = [want_out, *(want_state if isinstance(want_state, tuple) else (want_state,))]
    gots = [got_out, *(got_state if isinstance(got_state, tuple) else (got_state,))]
    for want, got in zip(wants, gots, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x, *(state if isinstance(state, tuple) else (state,)), *rnn.parameters()]
    probes = [torch.randn_like(w) for w in wants]
    want_grads = torch.autograd.grad(wants, inputs, probes)
    got_grads = torch.autograd.grad(gots, inputs, probes)
    for want, got in zip(want_grads, got_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _fused_gru(gates_x, gates_h, h):
    """torch's fused GRU cell (aten::_thnn_fused_gru_cell, CUDA only), written from its
    kernel's equations: the input's gates first, the hidden state's second, r multiplying
    the hidden state's n part alone."""
    x_r, x_z, x_n = gates_x.chunk(3, dim=-1)
    h_r, h_z, h_n = gates_h.chunk(3, dim=-1)
    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return n + z * (h - n), None


def _fused_lstm(gates_x, gates_h, c):
    """aten::_thnn_fused_lstm_cell from its kernel's equations (gates i, f, g, o)."""
    i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c, None


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_fused_cells_are_called_with_the_input_gates_first(
    kind: type[nn.RNNBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each layer's gates go through torch's fused cell; here its equations stand
    in for its kernel, and a step through them is still the module's (float64): the
    arguments are in the kernel's order. Swapping the GRU's gates fails this."""
    calls = []

    def counted(function):
        def call(*args):
            calls.append(args)
            return function(*args)

        return call

    monkeypatch.setattr(cells, "fused_cells", lambda h, *others: True)
    monkeypatch.setattr(cells, "FUSED_GRU", counted(_fused_gru))
    monkeypatch.setattr(cells, "FUSED_LSTM", counted(_fused_lstm))
    test_a_cell_step_is_the_modules_step(kind, 2)
    assert len(calls) == 2  # one call a layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_fused_cells_kernels_are_their_equations(kind: type[nn.RNNBase]) -> None:
    """torch's fused cell kernels on CUDA against the equations above, float64, forward and
    backward."""
    generator = torch.Generator().manual_seed(5)
    gates = 3 if kind is nn.GRU else 4
    gates_x, gates_h = (
        torch.randn(6, gates * 7, dtype=torch.float64, generator=generator) for _ in "xh"
    )
    state = torch.randn(6, 7, dtype=torch.float64, generator=generator)
    inputs = [t.requires_grad_() for t in (gates_x, gates_h, state)]
    reference = _fused_gru if kind is nn.GRU else _fused_lstm
    want = [t for t in reference(*inputs) if t is not None]
    on_gpu = [t.detach().cuda().requires_grad_() for t in inputs]
    kernel = cells.FUSED_GRU if kind is nn.GRU else cells.FUSED_LSTM
    got = list(kernel(*on_gpu))[: len(want)]
    probes = [torch.randn_like(w) for w in want]
    want_grads = torch.autograd.grad(want, inputs, probes)
    got_grads = torch.autograd.grad(got, on_gpu, [p.cuda() for p in probes])
    for w, g in zip([*want, *want_grads], [*got, *got_grads], strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12)


def test_a_cell_step_refuses_a_bidirectional_rnn() -> None:
    rnn = nn.GRU(3, 4, bidirectional=True, batch_first=True)
    with pytest.raises(ValueError, match="unidirectional"):
        rnn_step(rnn, torch.zeros(2, 1, 3), torch.zeros(2, 2, 4))


SRC_VOCAB, TRG_VOCAB = 11, 13


def _models(style: str, feeding: bool, rnn: str, score: str, coverage: str):
    config = _config(style, feeding, rnn, score, coverage)
    torch.manual_seed(0)
    plain = build_model(config, SRC_VOCAB, TRG_VOCAB, FastPaths.plain()).double().train()
    with torch.no_grad():
        for param in plain.parameters():
            param.add_(0.3 * torch.randn_like(param))
    ready = build_model(config, SRC_VOCAB, TRG_VOCAB, FastPaths(graphs="loss")).double().train()
    ready.load_state_dict(plain.state_dict())
    return plain, ready


def _config(style: str, feeding: bool, rnn: str, score: str, coverage: str):
    raw = {
        "embedding_size": 6,
        "embedding_dropout": 0.0,
        "encoder": {"rnn": rnn, "hidden_size": 4, "layers": 2, "dropout": 0.0},
        "decoder": {
            "style": style,
            "rnn": rnn,
            "hidden_size": 8,
            "layers": 2,
            "dropout": 0.0,
            "input_feeding": feeding,
        },
        "attention": {"score": score, "hidden_size": 5, "coverage": coverage},
    }
    return from_dict({"model": raw}).model


@pytest.mark.parametrize(
    ("style", "feeding", "rnn", "score", "coverage"),
    [
        ("bahdanau", False, "gru", "additive", "none"),
        ("bahdanau", False, "lstm", "additive", "neural"),
        ("luong", True, "gru", "general", "none"),
        ("luong", True, "lstm", "dot", "none"),
        ("luong", True, "gru", "local-p", "none"),
    ],
)
def test_a_padded_batch_through_the_cells_gives_the_plain_loss_and_gradients(
    style: str, feeding: bool, rnn: str, score: str, coverage: str, monkeypatch
) -> None:
    """With the teacher-forced unroll's products behind weight sinks (the embedding's
    input gates in one product; W_ih's rest, W_hh with b_hh, the second layer's W_ih with
    b_ih, Bahdanau's W_q, Luong's W_c), each sink used and emptied."""
    plain, ready = _models(style, feeding, rnn, score, coverage)
    made: list[sinks.WeightSink] = []

    def recording(weight: torch.Tensor, bias: torch.Tensor | None = None) -> sinks.WeightSink:
        made.append(real_sink(weight, bias))
        return made[-1]

    real_sink = sinks.WeightSink
    monkeypatch.setattr(sinks, "WeightSink", recording)
    generator = torch.Generator().manual_seed(1)
    src_lengths, trg_lengths = [7, 3, 5, 1], [4, 6, 2, 5]
    src = [torch.randint(4, SRC_VOCAB, (n,), generator=generator).tolist() for n in src_lengths]
    trg = [torch.randint(4, TRG_VOCAB, (n,), generator=generator).tolist() for n in trg_lengths]
    batch = make_batch(src, trg, np.arange(4))
    rows, length = batch_shape(
        batch.src_lengths.numpy(), (batch.trg_out != 0).sum(1).numpy(), batch_tokens=40
    )
    assert (rows, length) == (5, 8)  # one empty row, two more positions: padding present
    padded = batch.padded(rows, length)
    want_loss, want_nll = plain.loss(*batch.tensors(), label_smoothing=0.1)
    got_loss, got_nll = ready.loss(*padded.tensors(), label_smoothing=0.1)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_nll, want_nll, rtol=1e-12, atol=1e-12)
    want_grads = torch.autograd.grad(want_loss, list(plain.parameters()), allow_unused=True)
    got_grads = torch.autograd.grad(got_loss, list(ready.parameters()), allow_unused=True)
    for (name, _), want, got in zip(plain.named_parameters(), want_grads, got_grads, strict=True):
        if want is None:
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
    # two layers: W_ih's rest, W_hh and W_ih, W_hh; then W_q (Bahdanau) or W_c (Luong)
    assert len(made) == 5
    assert all(not sink.records and not sink.bias_records and not sink.formed for sink in made)


def test_graphs_are_kept_for_the_whole_loss_of_a_gru_encoder_or_a_stepwise_unroll() -> None:
    """A GRU encoder: graphs of the whole loss, whatever the decoder. An LSTM encoder (whose
    final cells the unpacked path cannot give): graphs of a step-by-step decoder's unroll
    alone, and none for a decoder that runs over all steps at once."""
    for encoder, feeding, whole, kept in (
        ("gru", True, True, True),
        ("gru", False, True, True),
        ("lstm", True, False, True),
        ("lstm", False, False, False),
    ):
        raw = {
            "embedding_size": 4,
            "encoder": {"rnn": encoder, "hidden_size": 4},
            "decoder": {"style": "luong", "hidden_size": 4, "input_feeding": feeding},
        }
        config = from_dict({"model": raw}).model
        model = build_model(config, 7, 7, FastPaths(graphs="loss"))
        assert (model.graphs is not None) is kept
        assert model.whole_graphs is whole
        assert build_model(config, 7, 7, FastPaths()).graphs is None


STATIC_VARIANTS = [
    ("bahdanau", False, "additive", "none", "graph-ready"),
    ("bahdanau", False, "additive", "neural", "plain"),
    ("luong", True, "general", "none", "graph-ready"),
    ("luong", True, "local-p", "none", "plain"),
    ("luong", False, "general", "none", "graph-ready"),
    ("luong", False, "dot", "none", "plain"),
    ("luong", False, "general", "none", "cpu-kernels"),
]


@pytest.mark.parametrize(("style", "feeding", "score", "coverage", "paths"), STATIC_VARIANTS)
def test_the_static_loss_of_a_padded_batch_is_the_plain_loss_of_the_batch(
    style: str, feeding: bool, score: str, coverage: str, paths: str
) -> None:
    """``Seq2Seq.static_loss``, what a CUDA graph of the whole training loss holds (lengths
    counted on the device, the GRU encoder unpacked, every target position through the
    output layer with padding's rows counting nothing), on a batch padded to its static
    shape (an empty row, padding past every sentence), with guided alignment: the plain
    model's loss, NLL and gradients on the batch as it was, in float64. The model's paths:
    the graph-ready unroll, plain PyTorch (the unpacked cuDNN-style encoder on a CPU), or
    the CPU kernels (the encoder's masked recurrence)."""
    plain, ready = _models(style, feeding, "gru", score, coverage)
    if paths != "graph-ready":
        fast = FastPaths.plain() if paths == "plain" else FastPaths()
        ready = build_model(
            _config(style, feeding, "gru", score, coverage), SRC_VOCAB, TRG_VOCAB, fast
        )
        ready = ready.double().train()
        ready.load_state_dict(plain.state_dict())
    generator = torch.Generator().manual_seed(3)
    src_lengths, trg_lengths = [7, 3, 5, 1], [4, 6, 2, 5]
    src = [torch.randint(4, SRC_VOCAB, (n,), generator=generator).tolist() for n in src_lengths]
    trg = [torch.randint(4, TRG_VOCAB, (n,), generator=generator).tolist() for n in trg_lengths]
    batch = make_batch(src, trg, np.arange(4))
    guide = torch.rand(4, batch.trg_in.size(1), batch.src.size(1), generator=generator)
    guide = guide.double() * (batch.src != 0)[:, None, :] * (batch.trg_out != 0)[:, :, None]
    batch = dataclasses.replace(batch, guide=guide / guide.sum(-1, keepdim=True).clamp_min(1e-9))
    padded = batch.padded(5, 8)
    # in float64 to the last bits; with guided alignment, whose term is float32, to float32's
    for weight, (rtol, grad_rtol, atol) in (
        (0.0, (1e-12, 1e-10, 1e-12)),
        (0.3, (1e-6, 1e-5, 1e-7)),
    ):
        want_loss, want_nll = plain.loss(*batch.tensors(), 0.1, Guide(batch.guide, weight))
        got_loss, got_nll = ready.static_loss(
            padded.src, padded.trg_in, padded.trg_out, 0.1, Guide(padded.guide, weight)
        )
        torch.testing.assert_close(got_loss, want_loss, rtol=rtol, atol=atol)
        torch.testing.assert_close(got_nll, want_nll, rtol=1e-12, atol=1e-12)
        want_grads = torch.autograd.grad(want_loss, list(plain.parameters()), allow_unused=True)
        got_grads = torch.autograd.grad(got_loss, list(ready.parameters()), allow_unused=True)
        named = plain.named_parameters()
        for (name, _), want, got in zip(named, want_grads, got_grads, strict=True):
            if want is None:
                assert got is None or not got.any(), name
                continue
            torch.testing.assert_close(got, want, rtol=grad_rtol, atol=atol, msg=name)


def test_target_rows_found_on_the_host_give_the_same_loss_to_the_bit() -> None:
    _, ready = _models("bahdanau", False, "gru", "additive", "none")
    generator = torch.Generator().manual_seed(2)
    src = [torch.randint(4, SRC_VOCAB, (n,), generator=generator).tolist() for n in (5, 2, 7)]
    trg = [torch.randint(4, TRG_VOCAB, (n,), generator=generator).tolist() for n in (3, 6, 1)]
    batch = make_batch(src, trg, np.arange(3)).padded(4, 8).with_target_rows()
    assert batch.target_rows is not None
    assert batch.target_rows.tolist() == (batch.trg_out.view(-1) != 0).nonzero().view(-1).tolist()
    assert len(batch.target_rows) == batch.n_target_tokens == 3 + 6 + 1 + 3
    torch.manual_seed(0)
    want = ready.loss(*batch.tensors(), label_smoothing=0.1)
    torch.manual_seed(0)
    got = ready.loss(*batch.tensors(), label_smoothing=0.1, target_rows=batch.target_rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("style", "feeding", "rnn"),
    [
        ("bahdanau", False, "gru"),
        ("bahdanau", False, "lstm"),
        ("luong", True, "gru"),
        ("luong", True, "lstm"),
        ("luong", False, "gru"),
        ("luong", False, "lstm"),
    ],
)
def test_search_steps_with_looked_up_input_gates_are_the_modules_steps(
    style: str, feeding: bool, rnn: str
) -> None:
    """Three search steps of every step-by-step decoder (two layers, float64, padding in the
    source) with the embedding's gates looked up in its table against the module's call."""
    plain, ready = _models(style, feeding, rnn, "general", "none")
    plain.eval()
    ready.eval()
    assert plain.decoder.gate_table() is None  # FastPaths.plain() multiplies
    generator = torch.Generator().manual_seed(3)
    src = torch.randint(4, SRC_VOCAB, (4, 6), generator=generator)
    src[2, 3:] = 0
    lengths = torch.tensor([6, 5, 3, 6])
    pieces = [torch.full((4,), 2), *torch.randint(4, TRG_VOCAB, (2, 4), generator=generator)]
    with torch.no_grad():
        table = ready.decoder.gate_table()
        assert table is not None and table.shape == (
            TRG_VOCAB,
            ready.decoder.rnn.weight_ih_l0.size(0),
        )
        results = []
        for model, lookup in ((plain, None), (ready, table)):
            memory, state = model.encode(src, lengths)
            steps = []
            for prev in pieces:
                gates = lookup[prev] if lookup is not None else None
                features, alphas, state = model.decoder.step(prev, memory, state, Prepared(gates))
                steps.append((features, alphas))
            results.append(steps)
    for (want_f, want_a), (got_f, got_a) in zip(*results, strict=True):
        torch.testing.assert_close(got_f, want_f, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_a, want_a, rtol=1e-12, atol=1e-12)


def test_the_input_gate_table_is_the_first_layers_product_and_has_a_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    embed = nn.Embedding(9, 4).double()
    rnn = nn.LSTM(4, 3, num_layers=2, batch_first=True).double()
    table = input_gate_table(embed, rnn)
    assert table is not None and not table.requires_grad
    want = embed.weight @ rnn.weight_ih_l0.t() + rnn.bias_ih_l0  # (V, 4H)
    torch.testing.assert_close(table, want.detach(), rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(cells, "TABLE_LIMIT", 9 * 12 - 1)
    assert input_gate_table(embed, rnn) is None  # one value too many
