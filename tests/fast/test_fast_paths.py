"""Speed never costs correctness: the model's loss and every gradient are the same through
every seam of nmt.fast.FastPaths as through its plain path: nmt's CPU kernels (the recurrence,
dropout, the additive score's recomputed layer) against torch's own (run.fast_kernels: false),
the step-by-step decoders' attention memory and Luong's W_c through gradient sinks against
plain autograd, the fused output loss against F.cross_entropy, and all of them at once against
FastPaths.plain(); float64, padding present, every decoder and each score kind (the compiled
kernels, which run float32 alone, against the float64 model within float32's round-off)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_native import _count_kernel_calls

import nmt.fast.sinks
from nmt.config import from_dict
from nmt.data.batching import make_batch
from nmt.fast import FastPaths, compiled
from nmt.fast.additive import RecomputedEnergies
from nmt.fast.sinks import PLAIN_PRODUCTS, SinkProducts, WeightSink
from nmt.model import build_model

SRC_VOCAB, TRG_VOCAB = 11, 13
WITHOUT_CPU_KERNELS = FastPaths(cpu_kernels=False)
SRC_LENGTHS, TRG_LENGTHS = [7, 3, 5, 1], [4, 6, 2, 5]  # padding on both sides


def _model(style: str, feeding: bool, rnn: str, layers: int, score: str, seed: int = 0):
    """A float64 model in train mode with dropout 0 (deterministic), built with every speed
    path; ``_with`` rebuilds it with other paths and the same weights."""
    raw = {
        "embedding_size": 6,
        "embedding_dropout": 0.0,
        "encoder": {"rnn": rnn, "hidden_size": 4, "layers": layers, "dropout": 0.0},
        "decoder": {
            "style": style,
            "rnn": rnn,
            "hidden_size": 8,
            "layers": layers,
            "dropout": 0.0,
            "input_feeding": feeding,
        },
        "attention": {"score": score, "hidden_size": 5, "heads": 2, "window": 2},
    }
    torch.manual_seed(seed)
    config = from_dict({"model": raw}).model
    model = build_model(config, SRC_VOCAB, TRG_VOCAB, FastPaths()).double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    model.config = config  # type: ignore[assignment]
    return model.train()


def _with(model, fast: FastPaths):
    """The same model and weights, built with the speed paths ``fast``."""
    other = build_model(model.config, SRC_VOCAB, TRG_VOCAB, fast).double()
    other.load_state_dict(model.state_dict())
    return other.train()


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    src = [torch.randint(4, SRC_VOCAB, (n,), generator=generator).tolist() for n in SRC_LENGTHS]
    trg = [torch.randint(4, TRG_VOCAB, (n,), generator=generator).tolist() for n in TRG_LENGTHS]
    return make_batch(src, trg, np.arange(len(src)))


def _loss_and_grads(model, batch):
    loss, nll = model.loss(*batch.tensors(), label_smoothing=0.1)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return loss.detach(), nll, grads


def _plain_loss_and_grads(model, batch, fast: FastPaths = WITHOUT_CPU_KERNELS):
    """The same through other paths (default: run.fast_kernels: false)."""
    return _loss_and_grads(_with(model, fast), batch)


def _assert_same(first, second) -> None:
    (loss_a, nll_a, grads_a), (loss_b, nll_b, grads_b) = first, second
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=0)
    torch.testing.assert_close(nll_a, nll_b, rtol=1e-12, atol=0)
    for a, b in zip(grads_a, grads_b, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


DECODERS = [("bahdanau", True), ("luong", True), ("luong", False)]
KERNEL_CASES = [
    (style, feeding, rnn, layers)
    for (style, feeding), rnn, layers in itertools.product(DECODERS, ["gru", "lstm"], [1, 2])
]


@pytest.mark.skipif(compiled.library() is None, reason="no compiled kernels")
@pytest.mark.parametrize(("style", "feeding", "rnn", "layers"), KERNEL_CASES)
def test_fast_kernels_give_the_plain_loss_and_gradients(
    style, feeding, rnn, layers, monkeypatch
) -> None:
    """float32, where the compiled kernels run (the recurrence, the loss): within float32's
    round-off of the float64 model through torch's own paths."""
    model, batch = _model(style, feeding, rnn, layers, "general"), _batch()
    wide = _plain_loss_and_grads(model, batch)
    calls = _count_kernel_calls(monkeypatch)
    (loss, nll, grads) = _loss_and_grads(model.float(), batch)
    assert set(calls) == {f"{rnn}_forward", f"{rnn}_backward", "softmax_xent"}
    torch.testing.assert_close(loss.double(), wide[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(nll.double(), wide[1], rtol=1e-6, atol=0)
    for ours, expected in zip(grads, wide[2], strict=True):
        torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("style", "feeding"), DECODERS)
def test_recomputed_additive_layer_gives_the_plain_loss_and_gradients(
    style, feeding, monkeypatch
) -> None:
    """The additive score keeps q, k and v and recomputes tanh(q + k) in backward: one query
    step at a time (Bahdanau, Luong with input feeding) or all steps at once (without)."""
    model, batch = _model(style, feeding, "gru", 1, "additive"), _batch(2)
    calls = []
    original = RecomputedEnergies.apply

    def counting(*args):
        calls.append(args[0].size(1))  # T, the query steps of the call
        return original(*args)

    monkeypatch.setattr(RecomputedEnergies, "apply", counting)
    fused = _loss_and_grads(model, batch)
    steps = max(TRG_LENGTHS) + 1  # the decoder's input: BOS and the target
    assert calls == ([1] * steps if feeding else [steps])
    _assert_same(fused, _plain_loss_and_grads(model, batch))


SCORES = ["additive", "dot", "general", "scaled_dot", "cosine", "location", "multihead"]
SCORES += ["local-m", "local-p"]
SINK_CASES = list(itertools.product([("bahdanau", True), ("luong", True)], SCORES))


@pytest.mark.parametrize(("decoder", "score"), SINK_CASES)
def test_gradient_sinks_give_the_plain_gradients(decoder, score, monkeypatch) -> None:
    style, feeding = decoder
    model, batch = _model(style, feeding, "gru", 1, score), _batch(1)
    made = []
    original = SinkProducts._sink

    def recording(self, role, tensor):
        sink = original(self, role, tensor)
        made.append((role, sink))
        return sink

    monkeypatch.setattr(SinkProducts, "_sink", recording)
    through_sinks = _loss_and_grads(model, batch)
    used = {role for role, sink in made if sink is not None}
    expected = set() if score == "multihead" else {"values"}  # its context is not alphas V
    if score in ("dot", "general", "scaled_dot", "cosine", "local-m", "local-p"):
        expected.add("keys")  # energies are query @ keys^T
    assert used == expected
    monkeypatch.setattr(FastPaths, "step_products", lambda self, training: PLAIN_PRODUCTS)
    _assert_same(through_sinks, _loss_and_grads(model, batch))


@pytest.mark.parametrize(("rnn", "layers"), [("gru", 1), ("lstm", 2)])
def test_combine_weight_sink_gives_the_plain_gradients(rnn, layers, monkeypatch) -> None:
    """Luong with input feeding applies W_c at every step: its gradient formed once over all
    steps (nmt.fast.sinks.WeightSink) equals autograd's step-by-step sum, with padding present."""
    model, batch = _model("luong", True, rnn, layers, "general"), _batch(2)
    used = []

    def recording(weight):
        used.append(WeightSink(weight))
        return used[-1]

    monkeypatch.setattr(nmt.fast.sinks, "WeightSink", recording)
    through_sink = _loss_and_grads(model, batch)
    assert len(used) == 1 and used[0].records == []  # used, and emptied by the backward pass
    monkeypatch.setattr(FastPaths, "step_linear", lambda self, linear, training: linear)
    _assert_same(through_sink, _loss_and_grads(model, batch))


ALL_CASES = list(itertools.product(DECODERS, SCORES))


@pytest.mark.parametrize(("decoder", "score"), ALL_CASES)
def test_every_fast_path_at_once_gives_the_plain_pytorch_loss_and_gradients(decoder, score) -> None:
    """The model built with every speed path against FastPaths.plain(): nn.GRU packed,
    nn.Dropout, plain autograd through every step and F.cross_entropy on the full logits."""
    style, feeding = decoder
    model, batch = _model(style, feeding, "gru", 1, score, seed=4), _batch(3)
    _assert_same(
        _loss_and_grads(model, batch), _plain_loss_and_grads(model, batch, FastPaths.plain())
    )


def test_weight_sink_adds_to_the_weights_other_gradients() -> None:
    """A weight used through the sink at several steps and directly as well: both parts."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(5, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    xs = [torch.randn(3, 1, 4, dtype=torch.float64, generator=generator) for _ in range(4)]
    sink = WeightSink(weight)
    total = sum((sink.linear(x) ** 2).sum() for x in xs) + (xs[0] @ weight.t()).sum()
    (grad,) = torch.autograd.grad(total, weight)
    plain = sum(((x @ weight.t()) ** 2).sum() for x in xs) + (xs[0] @ weight.t()).sum()
    (expected,) = torch.autograd.grad(plain, weight)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_weight_sink_with_a_bias_gives_both_gradients() -> None:
    """A weight and its bias through the sink at several steps (one step's rows zero, as a
    padded row's gradient is), the bias used directly as well: both gradients, either order
    of the backward pass reaching them."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(5, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
    xs = [torch.randn(3, 1, 4, dtype=torch.float64, generator=generator) for _ in range(4)]
    xs[2][1] = 0.0
    sink = WeightSink(weight, bias)
    total = sum((sink.linear(x) ** 2).sum() for x in xs) + (3 * bias).sum()
    got = torch.autograd.grad(total, [weight, bias])
    plain = sum(((x @ weight.t() + bias) ** 2).sum() for x in xs) + (3 * bias).sum()
    want = torch.autograd.grad(plain, [weight, bias])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert not sink.records and not sink.bias_records and not sink.formed


def test_weight_sink_under_autocast_adds_its_bias_in_float32() -> None:
    """Under bf16 autocast the product runs in bf16 and the bias is added in float32, the
    dtype a step's gates are summed in: the same values as the cast product plus the bias."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 4, generator=generator, requires_grad=True)
    bias = torch.randn(6, generator=generator, requires_grad=True)
    x = torch.randn(3, 1, 4, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sink = WeightSink(weight, bias)
        got = sink.linear(x)
        without_bias = WeightSink(weight).linear(x)
    assert got.dtype == torch.float32 and without_bias.dtype == torch.bfloat16
    want = (x.bfloat16() @ weight.bfloat16().t()).float() + bias
    assert torch.equal(got, want)
    got.sum().backward()
    assert weight.grad is not None and bias.grad is not None
    assert bias.grad.dtype == torch.float32
    torch.testing.assert_close(bias.grad, torch.full((6,), 3.0))
    torch.testing.assert_close(weight.grad, x.sum((0, 1)).expand(6, 4), rtol=1e-2, atol=1e-2)


def test_evaluation_and_search_take_the_plain_paths(monkeypatch) -> None:
    """In eval mode (dev loss, search) no seam takes its fast path."""
    model, batch = _model("bahdanau", True, "gru", 1, "additive"), _batch()
    fast = model.fast
    assert fast.step_products(False) is PLAIN_PRODUCTS
    assert fast.step_linear(model.generator, False) is model.generator

    def refuse(*args):
        raise AssertionError("a fast path in eval mode")

    monkeypatch.setattr(RecomputedEnergies, "apply", refuse)
    monkeypatch.setattr(nmt.fast.recurrence, "run_rnn", refuse)
    model.eval()
    with torch.no_grad():
        model.loss(*batch.tensors())


@pytest.mark.parametrize(
    ("style", "feeding", "score"), [("luong", False, "general"), ("bahdanau", True, "additive")]
)
def test_bf16_fast_and_plain_losses_agree(style, feeding, score) -> None:
    """Under bf16 autocast the two paths round differently; the losses stay close."""
    model, batch = _model(style, feeding, "gru", 1, score), _batch()
    plain_model = _with(model, WITHOUT_CPU_KERNELS).float()
    model = model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, _ = model.loss(*batch.tensors(), 0.1)
        plain, _ = plain_model.loss(*batch.tensors(), 0.1)
    assert abs(fast.item() - plain.item()) / plain.item() < 2e-2


def test_recomputed_additive_layer_under_bf16_is_close_to_float64() -> None:
    """Under autocast a float32 query meets bf16 keys: the energies and each gradient (in its
    input's dtype) stay within bf16's precision of v^T tanh(q + k) in float64."""
    generator = torch.Generator().manual_seed(3)
    q, keys = (0.7 * torch.randn(shape, generator=generator) for shape in [(4, 1, 64), (4, 12, 64)])
    v = torch.randn(1, 64, generator=generator) / 8
    upstream = torch.randn(4, 1, 12, generator=generator)
    inputs = [q.requires_grad_(), keys.bfloat16().requires_grad_(), v.requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        energies = RecomputedEnergies.apply(*inputs)
    (energies.float() * upstream).sum().backward()
    wide = [x.detach().double().requires_grad_() for x in inputs]
    reference = torch.tanh(wide[0][:, :, None, :] + wide[1][:, None, :, :]) @ wide[2][0]
    (reference * upstream.double()).sum().backward()

    def error(x, ref):
        return ((x.double() - ref).norm() / ref.norm()).item()

    assert error(energies.detach(), reference.detach()) < 1e-2
    for x, ref in zip(inputs, wide, strict=True):
        assert x.grad is not None and x.grad.dtype == x.dtype
        assert error(x.grad, ref.grad) < 1e-2
