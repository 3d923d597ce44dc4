"""Seq2Seq: teacher forcing equals step-by-step decoding, padding invariance, the loss against
torch's cross-entropy, the Bahdanau bridge against a hand-run backward RNN, tied weights."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nmt.fast.loss
from nmt.config import ModelConfig, from_dict
from nmt.data.batching import make_batch
from nmt.data.tokenizer import PAD_ID
from nmt.errors import ConfigError
from nmt.model import Seq2Seq, build_model, registry

SCORES = tuple(registry.SCORES)  # the shipped names, aliases included

SRC_VOCAB, TRG_VOCAB = 11, 13


ENC_HIDDEN, DEC_HIDDEN, EMBED = 4, 8, 6  # bidirectional keys: 8 = DEC_HIDDEN, so 'final' works


def _config(
    style: str = "bahdanau",
    rnn: str = "gru",
    init: str = "bridge",
    input_feeding: bool = True,
    layers: int = 1,
    score: str = "additive",
    bidirectional: bool = True,
    maxout: bool = False,
    **model: object,
) -> ModelConfig:
    raw = {
        "embedding_size": EMBED,
        "embedding_dropout": 0.3,  # eval mode must switch every dropout off
        "encoder": {
            "rnn": rnn,
            "hidden_size": ENC_HIDDEN,
            "layers": layers,
            "bidirectional": bidirectional,
            "dropout": 0.3,
        },
        "decoder": {
            "style": style,
            "rnn": rnn,
            "hidden_size": DEC_HIDDEN,
            "layers": layers,
            "dropout": 0.3,
            "input_feeding": input_feeding,
            "init": init,
            "maxout": maxout,
            "output_size": 7 if maxout else None,
        },
        "attention": {"score": score, "hidden_size": 5},
    }
    raw.update(model)
    return from_dict({"model": raw}).model


def _model(cfg: ModelConfig, seed: int = 0) -> Seq2Seq:
    torch.manual_seed(seed)
    model = build_model(cfg, SRC_VOCAB, TRG_VOCAB)
    with torch.no_grad():  # biases and every weight clearly non-zero
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def _ids(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


def _batch(src_lengths: list[int], trg_lengths: list[int], seed: int = 0):
    src_ids = _ids(src_lengths, SRC_VOCAB, seed)
    trg_ids = _ids(trg_lengths, TRG_VOCAB, seed + 1)
    return make_batch(src_ids, trg_ids, np.arange(len(src_ids)))


DECODERS = [("bahdanau", True), ("luong", True), ("luong", False)]
CASES = [
    (style, feeding, rnn, init, layers)
    for (style, feeding), rnn, init, layers in itertools.product(
        DECODERS, ["gru", "lstm"], ["bridge", "final", "zeros"], [1, 2]
    )
]
IDS = [f"{s}{'-feed' if f and s == 'luong' else ''}-{r}-{i}-L{n}" for s, f, r, i, n in CASES]


@pytest.mark.parametrize(("style", "feeding", "rnn", "init", "layers"), CASES, ids=IDS)
def test_teacher_forcing_equals_stepping(style, feeding, rnn, init, layers) -> None:
    model = _model(_config(style, rnn, init, feeding, layers))
    batch = _batch([6, 4, 2], [5, 2, 4])
    with torch.no_grad():
        features, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
        memory, state = model.encode(batch.src, batch.src_lengths)
        for t in range(batch.trg_in.size(1)):
            step_features, step_alphas, state = model.decoder.step(
                batch.trg_in[:, t], memory, state
            )
            torch.testing.assert_close(step_features, features[:, t], atol=1e-5, rtol=0)
            torch.testing.assert_close(step_alphas, alphas[:, t], atol=1e-5, rtol=0)
    assert features.shape == (3, 6, model.decoder.output_size)  # T = longest target + 1
    assert alphas.shape == (3, 6, 6)


@pytest.mark.parametrize(
    "cfg",
    [
        _config("bahdanau", "gru", "bridge", maxout=True),
        _config("luong", "lstm", "final", True, layers=2, score="general"),
        _config("luong", "gru", "zeros", False, score="dot"),
    ],
    ids=["bahdanau-maxout-gru", "luong-feed-lstm", "luong-gru-dot"],
)
def test_train_mode_teacher_forcing_equals_stepping_without_dropout(cfg: ModelConfig) -> None:
    """With every dropout at 0 the training-mode path must match search's step path too."""
    cfg = cfg.model_copy(
        update={
            "embedding_dropout": 0.0,
            "encoder": cfg.encoder.model_copy(update={"dropout": 0.0}),
            "decoder": cfg.decoder.model_copy(update={"dropout": 0.0}),
        }
    )
    model = _model(cfg).train()
    batch = _batch([5, 3], [4, 3])
    with torch.no_grad():
        features, _ = model(batch.src, batch.src_lengths, batch.trg_in)
        memory, state = model.encode(batch.src, batch.src_lengths)
        for t in range(batch.trg_in.size(1)):
            step, _, state = model.decoder.step(batch.trg_in[:, t], memory, state)
            torch.testing.assert_close(step, features[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("style", "feeding", "rnn", "init", "layers"), CASES, ids=IDS)
def test_padding_invariance(style, feeding, rnn, init, layers) -> None:
    model = _model(_config(style, rnn, init, feeding, layers), seed=1)
    src_lengths, trg_lengths = [7, 3, 5], [2, 6, 4]
    batch = _batch(src_lengths, trg_lengths, seed=3)
    with torch.no_grad():
        enc = model.encoder(batch.src, batch.src_lengths)
        features, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
        for b, (s_len, t_len) in enumerate(zip(src_lengths, trg_lengths, strict=True)):
            src = batch.src[b : b + 1, :s_len]
            trg_in = batch.trg_in[b : b + 1, :t_len]
            alone = model.encoder(src, batch.src_lengths[b : b + 1])
            torch.testing.assert_close(alone.outputs[0], enc.outputs[b, :s_len], atol=1e-5, rtol=0)
            torch.testing.assert_close(
                alone.hidden[:, :, 0], enc.hidden[:, :, b], atol=1e-5, rtol=0
            )
            f_alone, a_alone = model(src, batch.src_lengths[b : b + 1], trg_in)
            torch.testing.assert_close(f_alone[0], features[b, :t_len], atol=1e-5, rtol=0)
            torch.testing.assert_close(a_alone[0], alphas[b, :t_len, :s_len], atol=1e-5, rtol=0)
            assert torch.all(alphas[b, :, s_len:] == 0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize(("style", "feeding"), DECODERS, ids=["bahdanau", "luong-feed", "luong"])
def test_loss_equals_torch_cross_entropy(style, feeding, label_smoothing, monkeypatch) -> None:
    model = _model(_config(style, "gru", "bridge", feeding), seed=2)
    batch = _batch([6, 2, 4], [3, 5, 1], seed=5)
    with torch.no_grad():
        features, _ = model(batch.src, batch.src_lengths, batch.trg_in)
        logits = model.generator(features).double().reshape(-1, TRG_VOCAB)  # full logits
        gold = batch.trg_out.reshape(-1)
        ref_loss = F.cross_entropy(
            logits, gold, ignore_index=PAD_ID, label_smoothing=label_smoothing, reduction="sum"
        )
        ref_nll = F.cross_entropy(logits, gold, ignore_index=PAD_ID, reduction="sum")
        loss, nll = model.loss(*batch.tensors(), label_smoothing)
        # two logit rows per chunk: the chunked loop must add up to the same sums
        monkeypatch.setattr(nmt.fast.loss, "LOSS_CHUNK_ELEMENTS", 2 * TRG_VOCAB)
        chunked_loss, chunked_nll = model.loss(*batch.tensors(), label_smoothing)
    assert batch.n_target_tokens == 3 + 5 + 1 + 3  # each target plus its EOS
    for value, ref in [
        (loss, ref_loss),
        (nll, ref_nll),
        (chunked_loss, ref_loss),
        (chunked_nll, ref_nll),
    ]:
        torch.testing.assert_close(value.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk_rows", [None, 5], ids=["one-chunk", "5-row-chunks"])
def test_loss_gradients_equal_torch_cross_entropy(
    label_smoothing, tied, chunk_rows, monkeypatch
) -> None:
    """The fused output layer and loss give autograd's gradients through the plain logits and
    F.cross_entropy for every parameter, in float64, with padding present; 5-row chunks in
    10-row matmul blocks leave a partial block and chunk (12 target tokens)."""
    embedding = DEC_HIDDEN if tied else EMBED  # tying needs the output size
    model = _model(
        _config("luong", "gru", "bridge", False, tie_embeddings=tied, embedding_size=embedding),
        seed=6,
    ).double()
    batch = _batch([6, 2, 4], [3, 5, 1], seed=7)
    params = list(model.parameters())
    scale = 0.37  # the incoming gradient, as 1 / tokens would be
    features, _ = model(batch.src, batch.src_lengths, batch.trg_in)
    logits = model.generator(features).reshape(-1, TRG_VOCAB)
    gold = batch.trg_out.reshape(-1)
    ref = F.cross_entropy(
        logits, gold, ignore_index=PAD_ID, label_smoothing=label_smoothing, reduction="sum"
    )
    ref_grads = torch.autograd.grad(scale * ref, params)
    if chunk_rows is not None:
        monkeypatch.setattr(nmt.fast.loss, "LOSS_CHUNK_ELEMENTS", chunk_rows * TRG_VOCAB)
        monkeypatch.setattr(nmt.fast.loss, "LOSS_MATMUL_CHUNKS", 2)
    loss, _ = model.loss(*batch.tensors(), label_smoothing)
    grads = torch.autograd.grad(scale * loss, params)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for param, grad, ref_grad in zip(params, grads, ref_grads, strict=True):
        assert grad.dtype == param.dtype
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("fused", "compiled"),
    [(False, False), (True, False), (True, True)],
    ids=["plain", "fused", "compiled"],
)
@pytest.mark.parametrize("chunk_rows", [None, 4], ids=["one-chunk", "4-row-chunks"])
def test_a_loss_over_some_rows_counts_those_rows_alone(
    fused, compiled, chunk_rows, monkeypatch
) -> None:
    """``rows`` (a static batch's target positions that are not padding): the loss, the NLL
    and both gradients are F.cross_entropy's over those rows alone (float64; the compiled
    kernel's in float32, which it takes, against the float64 reference); the other rows'
    features get no gradient, whatever their targets."""
    if chunk_rows is not None:
        monkeypatch.setattr(nmt.fast.loss, "LOSS_CHUNK_ELEMENTS", chunk_rows * 30)
        monkeypatch.setattr(nmt.fast.loss, "LOSS_MATMUL_CHUNKS", 2)
    generator = torch.Generator().manual_seed(9)
    features = torch.randn(17, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    gold = torch.randint(0, 30, (17,), generator=generator)
    rows = torch.rand(17, generator=generator) < 0.6
    assert 0 < int(rows.sum()) < 17
    keep = rows.nonzero().squeeze(1)
    logits = features[keep] @ weight.t()
    ref = F.cross_entropy(logits, gold[keep], label_smoothing=0.1, reduction="sum")
    ref_nll = F.cross_entropy(logits, gold[keep], reduction="sum")
    ref_grads = torch.autograd.grad(0.37 * ref, [features, weight])
    dtype, rtol, atol = (torch.float32, 1e-5, 1e-6) if compiled else (torch.float64, 1e-12, 1e-12)
    x = features.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss, nll = nmt.fast.loss.output_layer_loss(x, w, gold, 0.1, fused, compiled, rows)
    grads = torch.autograd.grad(0.37 * loss, [x, w])
    torch.testing.assert_close(loss.double(), ref, rtol=rtol, atol=0)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=rtol, atol=0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol * 100, atol=atol)
    assert not grads[0][~rows].any()


@pytest.mark.parametrize("compiled", [False, True], ids=["torch-ops", "compiled"])
@pytest.mark.parametrize(
    ("dtype", "bound"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)], ids=["bf16", "fp16"]
)
def test_loss_under_autocast_is_close_to_float64(dtype, bound, compiled) -> None:
    """Under autocast the fused loss rounds its logits and the stored gradient G to the
    autocast dtype once each; with a GradScaler-sized incoming gradient (2^16 over the token
    count) the loss and the gradients stay within that dtype's precision of float64. The same
    with the compiled softmax kernel (bf16; fp16 runs torch ops either way)."""
    generator = torch.Generator().manual_seed(8)
    rows, width, vocab = 300, 32, 500
    scale = 2.0**16 / rows
    features = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    weight = 0.3 * torch.randn(vocab, width, generator=generator, dtype=torch.float64)
    gold = torch.randint(0, vocab, (rows,), generator=generator)
    ref_x, ref_w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(ref_x @ ref_w.t(), gold, label_smoothing=0.1, reduction="sum")
    (scale * ref).backward()
    x, w = features.float().requires_grad_(), weight.float().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        loss, nll = nmt.fast.loss.OutputLayerLoss.apply(x, w, gold, 0.1, dtype, True, compiled)
    (scale * loss).backward()
    assert loss.dtype == nll.dtype == torch.float32
    assert x.grad.dtype == w.grad.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 5e-4 * ref.item()
    for grad, ref_grad in [(x.grad, ref_x.grad), (w.grad, ref_w.grad)]:
        error = (grad.double() - ref_grad).norm() / ref_grad.norm()
        assert error < bound


def test_loss_backpropagates() -> None:
    model = _model(_config("luong", "lstm", "final", True, layers=2), seed=4).train()
    loss, _ = model.loss(*_batch([3, 5], [4, 2]).tensors(), 0.1)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.decoder.embed.weight.grad[PAD_ID].abs().sum() == 0


def _run_direction(rnn: torch.nn.Module, xs: list[torch.Tensor], suffix: str) -> torch.Tensor:
    """Final state of one layer-0 direction, in float64, from the GRU/LSTM equations."""

    def weight(name: str) -> torch.Tensor:
        return getattr(rnn, f"{name}_l0{suffix}").detach().double()

    w_ih, w_hh, b_ih, b_hh = (
        weight("weight_ih"),
        weight("weight_hh"),
        weight("bias_ih"),
        weight("bias_hh"),
    )
    size = rnn.hidden_size
    h = torch.zeros(size, dtype=torch.float64)
    c = torch.zeros(size, dtype=torch.float64)
    for x in xs:
        gi, gh = w_ih @ x + b_ih, w_hh @ h + b_hh
        if isinstance(rnn, torch.nn.GRU):  # gates r, z, n
            r = torch.sigmoid(gi[:size] + gh[:size])
            z = torch.sigmoid(gi[size : 2 * size] + gh[size : 2 * size])
            n = torch.tanh(gi[2 * size :] + r * gh[2 * size :])
            h = (1 - z) * n + z * h
        else:  # gates i, f, g, o
            g = gi + gh
            i, f = torch.sigmoid(g[:size]), torch.sigmoid(g[size : 2 * size])
            cand, o = torch.tanh(g[2 * size : 3 * size]), torch.sigmoid(g[3 * size :])
            c = f * c + i * cand
            h = o * torch.tanh(c)
    return h


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_bridge_is_tanh_of_backward_state_of_first_word(rnn: str) -> None:
    model = _model(_config("bahdanau", rnn, "bridge"), seed=5)
    lengths = [6, 3, 1]
    batch = _batch(lengths, [2, 2, 2], seed=7)
    with torch.no_grad():
        enc = model.encoder(batch.src, batch.src_lengths)
        hidden, cell = model.bridge(enc)
    weight, bias = model.bridge.proj.weight.double(), model.bridge.proj.bias.double()
    for b, n in enumerate(lengths):
        xs = [model.encoder.embed.weight[i].detach().double() for i in batch.src[b, :n]]
        backward = _run_direction(model.encoder.rnn, xs[::-1], "_reverse")  # h_backward_1
        forward = _run_direction(model.encoder.rnn, xs, "")
        # the final backward state is the annotation of the first word (its backward half)
        torch.testing.assert_close(enc.hidden[-1, -1, b].double(), backward, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            enc.outputs[b, 0, ENC_HIDDEN:].double(), backward, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(enc.hidden[-1, 0, b].double(), forward, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            enc.outputs[b, n - 1, :ENC_HIDDEN].double(), forward, atol=1e-5, rtol=0
        )
        s0 = torch.tanh(weight @ backward + bias)
        torch.testing.assert_close(hidden[0, b].double(), s0[:DEC_HIDDEN], atol=1e-5, rtol=0)
        if rnn == "lstm":
            torch.testing.assert_close(cell[0, b].double(), s0[DEC_HIDDEN:], atol=1e-5, rtol=0)
        else:
            assert cell is None


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_bridge_two_layers_reads_top_backward_state(rnn: str) -> None:
    model = _model(_config("bahdanau", rnn, "bridge", layers=2), seed=6)
    batch = _batch([5, 2], [2, 2], seed=8)
    with torch.no_grad():
        enc = model.encoder(batch.src, batch.src_lengths)
        hidden, cell = model.bridge(enc)
        top_backward = enc.outputs[:, 0, ENC_HIDDEN:]  # top layer, backward, first word
        torch.testing.assert_close(enc.hidden[-1, -1], top_backward)
        states = torch.tanh(model.bridge.proj(top_backward))  # (B, parts*L*H)
    produced = [hidden[0], hidden[1]] + ([cell[0], cell[1]] if rnn == "lstm" else [])
    # every part of the projection is used once, each as one layer's initial state
    torch.testing.assert_close(torch.cat(produced, dim=-1), states)
    assert hidden.shape == (2, 2, DEC_HIDDEN)


def test_unidirectional_bridge_reads_forward_final_state() -> None:
    model = _model(_config("bahdanau", "gru", "bridge", bidirectional=False), seed=7)
    lengths = [4, 2]
    batch = _batch(lengths, [2, 2], seed=9)
    with torch.no_grad():
        enc = model.encoder(batch.src, batch.src_lengths)
        hidden, _ = model.bridge(enc)
        last = torch.stack([enc.outputs[b, n - 1] for b, n in enumerate(lengths)])
        torch.testing.assert_close(hidden[0], torch.tanh(model.bridge.proj(last)))


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_final_init_concatenates_directions(rnn: str) -> None:
    model = _model(_config("luong", rnn, "final", layers=2), seed=8)
    batch = _batch([5, 3], [2, 2], seed=10)
    with torch.no_grad():
        enc = model.encoder(batch.src, batch.src_lengths)
        hidden, cell = model.bridge(enc)
    for layer in range(2):
        for b in range(2):
            expected = torch.cat([enc.hidden[layer, 0, b], enc.hidden[layer, 1, b]])
            torch.testing.assert_close(hidden[layer, b], expected)
            if rnn == "lstm":
                expected = torch.cat([enc.cell[layer, 0, b], enc.cell[layer, 1, b]])
                torch.testing.assert_close(cell[layer, b], expected)


def test_final_init_with_mismatched_sizes_is_rejected_by_the_schema() -> None:
    raw = {"encoder": {"hidden_size": 4}, "decoder": {"hidden_size": 6, "init": "final"}}
    with pytest.raises(ConfigError, match="bridge") as info:
        from_dict({"model": raw})  # before a run writes anything
    assert "model.decoder.init" in str(info.value)


@pytest.mark.parametrize(
    "cfg",
    [
        _config("luong", "gru", "bridge", embedding_size=DEC_HIDDEN, tie_embeddings=True),
        _config("bahdanau", "gru", "bridge", tie_embeddings=True),
    ],
    ids=["luong", "bahdanau"],
)
def test_tied_embeddings_share_storage(cfg: ModelConfig) -> None:
    model = _model(cfg).train()
    assert model.generator.weight is model.decoder.embed.weight
    assert model.generator.weight.data_ptr() == model.decoder.embed.weight.data_ptr()
    names = [name for name, _ in model.named_parameters()]
    assert "generator.weight" not in names or "decoder.embed.weight" not in names
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _ = model.loss(*_batch([3, 2], [3, 1]).tensors(), 0.1)
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(model.generator.weight, model.decoder.embed.weight)


def test_untied_embeddings_are_separate() -> None:
    model = _model(_config("bahdanau"))
    assert model.generator.weight.data_ptr() != model.decoder.embed.weight.data_ptr()


@pytest.mark.parametrize("score", SCORES)
def test_every_score_the_schema_accepts_builds(score: str) -> None:
    model = _model(_config("luong", score=score))
    batch = _batch([4, 2], [3, 2])
    with torch.no_grad():
        features, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
    assert torch.isfinite(features).all()
    assert torch.all(alphas[1, :, 2:] == 0)
    sums = alphas.sum(-1)
    if score == "local-p":  # Luong eq. 10: the Gaussian is not renormalised
        assert torch.all((sums > 0) & (sums <= 1 + 1e-6))
    else:
        torch.testing.assert_close(sums, torch.ones(2, 4))


@pytest.mark.parametrize(
    ("options", "attribute", "expected"),
    [
        ({"score": "multihead", "heads": 2}, "heads", 2),
        ({"score": "local-p", "window": 3}, "window", 3),
        ({"score": "location", "max_source_length": 7}, "max_source_length", 7),
    ],
)
def test_attention_settings_reach_the_model(options, attribute, expected) -> None:
    raw = {
        "embedding_size": EMBED,
        "encoder": {"hidden_size": ENC_HIDDEN},
        "decoder": {"hidden_size": DEC_HIDDEN},
        "attention": options,
    }
    model = build_model(from_dict({"model": raw}).model, SRC_VOCAB, TRG_VOCAB)
    assert getattr(model.decoder.attention, attribute) == expected
