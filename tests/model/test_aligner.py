"""The alignment head (model.alignment_head): its weights against the equation in float64,
its loss leaving the translation model untouched, and a head that learns to align where the
attention cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_learning import VOCAB

from nmt.config import from_dict
from nmt.data.batching import Batch, make_batch
from nmt.data.guidance import guide_matrix
from nmt.decoding.ensemble import Ensemble
from nmt.errors import ConfigError
from nmt.model import build_model
from nmt.model.aligner import AlignmentHead
from nmt.model.seq2seq import Guide, guided_alignment_loss
from nmt.vocab import EOS_ID, PAD_ID


def reference_weights(
    features: np.ndarray,
    embedded: np.ndarray,
    values: np.ndarray,
    lengths: list[int],
    weight: np.ndarray,
    bias: np.ndarray,
) -> np.ndarray:
    """beta[b, t, s] = softmax_s over the real positions of (W [f_t; e_t] + b) . h_s, loop by
    loop in float64; padding positions get 0."""
    batch, steps, _ = features.shape
    out = np.zeros((batch, steps, values.shape[1]))
    for b in range(batch):
        for t in range(steps):
            x = np.concatenate([features[b, t], embedded[b, t]])
            query = weight @ x + bias
            scores = [float(query @ values[b, s]) for s in range(lengths[b])]
            top = max(scores)
            exps = [np.exp(v - top) for v in scores]
            for s in range(lengths[b]):
                out[b, t, s] = exps[s] / sum(exps)
    return out


def test_head_weights_are_the_equation() -> None:
    """Random inputs, 3 sentences with source lengths 5, 3 and 1 (padding present)."""
    torch.manual_seed(0)
    head = AlignmentHead(6, 4, 8).double()
    features = torch.randn(3, 4, 6, dtype=torch.float64)
    embedded = torch.randn(3, 4, 4, dtype=torch.float64)
    values = torch.randn(3, 5, 8, dtype=torch.float64)
    lengths = [5, 3, 1]
    mask = torch.arange(5).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    got = head(features, embedded, values, mask)
    expected = reference_weights(
        features.numpy(),
        embedded.numpy(),
        values.numpy(),
        lengths,
        head.query.weight.detach().numpy(),
        head.query.bias.detach().numpy(),
    )
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-10, atol=1e-12)


def reference_context(embedded: np.ndarray, length: int, module: torch.nn.GRU) -> np.ndarray:
    """r_t for t < length: the GRU's equations (r, z, n gates) run from the last real piece
    back to the first, from r = 0, in float64; rows past the length stay 0."""
    w_ih, w_hh = (getattr(module, f"weight_{k}_l0").detach().numpy() for k in ("ih", "hh"))
    b_ih, b_hh = (getattr(module, f"bias_{k}_l0").detach().numpy() for k in ("ih", "hh"))
    size = w_hh.shape[1]
    h = np.zeros(size)
    out = np.zeros((embedded.shape[0], size))

    def sigmoid(x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-x))

    for t in reversed(range(length)):
        gi, gh = w_ih @ embedded[t] + b_ih, w_hh @ h + b_hh
        r = sigmoid(gi[:size] + gh[:size])
        z = sigmoid(gi[size : 2 * size] + gh[size : 2 * size])
        n = np.tanh(gi[2 * size :] + r * gh[2 * size :])
        h = (1 - z) * n + z * h
        out[t] = h
    return out


def test_the_context_head_is_the_equation() -> None:
    """model.alignment_head_context: x_t = [f_t; e(y_t); r_t] with r the backward GRU over
    each sentence's own target pieces. Random inputs in float64; target lengths 4, 2 and 3
    of 4 and source lengths 5, 3 and 1 (padding on both sides, holding random values that
    must not leak into a real row)."""
    torch.manual_seed(3)
    head = AlignmentHead(6, 4, 8, context=True).double()
    assert head.context is not None
    features = torch.randn(3, 4, 6, dtype=torch.float64)
    embedded = torch.randn(3, 4, 4, dtype=torch.float64)
    values = torch.randn(3, 5, 8, dtype=torch.float64)
    trg_lengths, src_lengths = [4, 2, 3], [5, 3, 1]
    mask = torch.arange(5).unsqueeze(0) < torch.tensor(src_lengths).unsqueeze(1)
    got = head(features, embedded, values, mask, torch.tensor(trg_lengths))
    assert got.dtype == torch.float64
    weight, bias = head.query.weight.detach().numpy(), head.query.bias.detach().numpy()
    for b, length in enumerate(trg_lengths):
        context = reference_context(embedded[b].numpy(), length, head.context)
        inputs = np.concatenate([embedded[b].numpy(), context], axis=-1)[None]
        expected = reference_weights(
            features[b : b + 1].numpy(), inputs, values[b : b + 1].numpy(),
            [src_lengths[b]], weight, bias,
        )  # fmt: skip
        np.testing.assert_allclose(
            got[b, :length].detach().numpy(), expected[0, :length], rtol=1e-10, atol=1e-12
        )


def _config(head: bool, style: str = "luong", joint: bool = False) -> dict:
    rnn = {"hidden_size": 16, "dropout": 0.0}
    model = {
        "embedding_size": 12,
        "embedding_dropout": 0.0,
        "encoder": rnn,
        "decoder": {**rnn, "style": style},
        "attention": {"score": "general" if style == "luong" else "additive"},
        "alignment_head": head,
        "alignment_head_joint": joint,
    }
    return {"model": model, "training": {"guided_alignment": "train.align"}}


def _model(head: bool, style: str = "luong", seed: int = 0, joint: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(from_dict(_config(head, style, joint)).model, VOCAB, VOCAB)


def shuffle_batch(rng: np.random.Generator, size: int) -> Batch:
    """Sources of 3-8 distinct symbols, targets a random permutation of them: the source
    word of each target word is certain once the word is known and a guess before. Each
    target piece is guided to its source position; EOS rows unguided."""
    src, trg, cells = [], [], []
    for _ in range(size):
        n = int(rng.integers(3, 9))
        seq = rng.choice(np.arange(4, VOCAB), size=n, replace=False).tolist()
        order = rng.permutation(n).tolist()
        src.append([*seq, EOS_ID])
        trg.append([seq[k] for k in order])
        cells.append([x for t, k in enumerate(order) for x in (t, k)])
    batch = make_batch(src, trg, np.arange(size))
    batch.guide = guide_matrix(cells, batch.trg_out.size(1), batch.src.size(1))
    return batch


@pytest.mark.parametrize("style", ["luong", "bahdanau"])
def test_the_head_leaves_the_translation_model_untouched(style: str) -> None:
    """With a head, the guided loss adds the head's cross-entropy (the float64 equation on
    the weights ``read`` returns), not the attention's; every gradient outside the head is
    bit for bit that of the unguided loss, and the model without a head built from the
    same seed computes the same features."""
    model = _model(True, style).eval()
    plain_model = _model(False, style).eval()
    batch = shuffle_batch(np.random.default_rng(1), 6)
    features, _, beta = model.read(batch.src, batch.src_lengths, batch.trg_in, batch.trg_out)
    plain_features, _ = plain_model(batch.src, batch.src_lengths, batch.trg_in)
    assert torch.equal(features, plain_features)
    assert beta is not None

    plain, nll = model.loss(*batch.tensors())
    model.zero_grad()
    plain.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    guided, guided_nll = model.loss(*batch.tensors(), guide=Guide(batch.guide, 0.7))
    model.zero_grad()
    guided.backward()
    term = 0.7 * float(guided_alignment_loss(beta.detach().double(), batch.guide.double()))
    assert float((guided - plain).detach()) == pytest.approx(term, rel=1e-5)
    assert float(guided_nll) == float(nll)
    for name, parameter in model.named_parameters():
        if name.startswith("aligner."):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert torch.equal(parameter.grad, plain_grads[name]), name


@pytest.mark.parametrize("style", ["luong", "bahdanau"])
def test_a_joint_head_trains_the_model_with_it(style: str) -> None:
    """model.alignment_head_joint: the head's term (the float64 equation on beta) sends
    gradient into the encoder, the decoder and the target embedding as well as the head."""
    model = _model(True, style, joint=True).eval()
    batch = shuffle_batch(np.random.default_rng(2), 6)
    _, _, beta = model.read(batch.src, batch.src_lengths, batch.trg_in, batch.trg_out)
    assert beta is not None
    plain, _ = model.loss(*batch.tensors())
    guided, _ = model.loss(*batch.tensors(), guide=Guide(batch.guide, 0.7))
    term = 0.7 * float(guided_alignment_loss(beta.detach().double(), batch.guide.double()))
    assert float((guided - plain).detach()) == pytest.approx(term, rel=1e-5)
    model.zero_grad()
    guided_alignment_loss(beta, batch.guide).backward()
    reached = {
        n.split(".")[0] for n, p in model.named_parameters() if p.grad is not None and p.grad.any()
    }
    assert {"encoder", "decoder", "aligner"} <= reached, reached
    assert model.decoder.embed.weight.grad is not None and model.decoder.embed.weight.grad.any()


def _accuracy(weights: torch.Tensor, batch: Batch) -> float:
    """Share of target words whose weights' argmax is their guided source position."""
    hits = total = 0
    for b in range(batch.src.size(0)):
        rows, columns = batch.guide[b].nonzero(as_tuple=True)
        for t, s in zip(rows.tolist(), columns.tolist(), strict=True):
            hits += int(weights[b, t].argmax()) == s
            total += 1
    return hits / total


def _train(head: bool, steps: int) -> torch.nn.Module:
    model = _model(head)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(100)
    model.train()
    for _ in range(steps):
        batch = shuffle_batch(rng, 32)
        loss, _ = model.loss(*batch.tensors(), guide=Guide(batch.guide, 1.0))
        optimizer.zero_grad()
        (loss / batch.n_target_tokens).backward()
        optimizer.step()
    return model.eval()


def test_the_head_aligns_where_the_attention_cannot() -> None:
    """The shuffle task, 150 updates each: a guided head finds the source of nearly every
    target word of held-out pairs; guided attention, which must choose before it sees the
    word, cannot do much better than guess among the words not yet translated."""
    held_out = shuffle_batch(np.random.default_rng(9999), 64)
    with_head, guided_attention = _train(True, 150), _train(False, 150)
    with torch.no_grad():
        _, _, beta = with_head.read(
            held_out.src, held_out.src_lengths, held_out.trg_in, held_out.trg_out
        )
        _, alphas = guided_attention(held_out.src, held_out.src_lengths, held_out.trg_in)
    head, attention = _accuracy(beta, held_out), _accuracy(alphas, held_out)
    assert head > 0.9 and attention < head - 0.3, (head, attention)


def test_a_head_needs_guided_alignment() -> None:
    config = _config(True)
    config["training"] = {}
    with pytest.raises(ConfigError, match="model.alignment_head: the head learns only from"):
        from_dict(config)
    with pytest.raises(ConfigError, match="model.alignment_head_joint: there is no head"):
        from_dict(_config(False, joint=True))
    config = _config(False)
    config["model"]["alignment_head_context"] = True
    with pytest.raises(ConfigError, match="model.alignment_head_context: there is no head"):
        from_dict(config)


def test_a_context_head_reads_a_sentence_alike_alone_or_padded() -> None:
    """The whole model's read(): with target context, each pair's weights are the same
    batched with longer pairs (padding on both sides) as read alone."""
    config = _config(True)
    config["model"]["alignment_head_context"] = True
    torch.manual_seed(4)
    model = build_model(from_dict(config).model, VOCAB, VOCAB).double().eval()
    batch = shuffle_batch(np.random.default_rng(5), 5)
    with torch.no_grad():
        _, _, together = model.read(batch.src, batch.src_lengths, batch.trg_in, batch.trg_out)
        assert together is not None
        for b in range(5):
            s, t = int(batch.src_lengths[b]), int((batch.trg_out[b] != PAD_ID).sum())
            _, _, alone = model.read(
                batch.src[b : b + 1, :s], batch.src_lengths[b : b + 1],
                batch.trg_in[b : b + 1, :t], batch.trg_out[b : b + 1, :t],
            )  # fmt: skip
            assert alone is not None
            torch.testing.assert_close(together[b, :t, :s], alone[0], rtol=1e-10, atol=1e-12)


MARKER = 4  # a target-only word whose source is that of the word after it


def marker_batch(rng: np.random.Generator, size: int) -> Batch:
    """Sources of 3-5 distinct symbols, targets a random permutation of them with MARKER
    before each: a marker's source is that of the word after it, which only a head that
    reads ahead can know; the words themselves are guided as in the shuffle task."""
    src, trg, cells = [], [], []
    for _ in range(size):
        n = int(rng.integers(3, 6))
        seq = rng.choice(np.arange(MARKER + 1, VOCAB), size=n, replace=False).tolist()
        order = rng.permutation(n).tolist()
        src.append([*seq, EOS_ID])
        trg.append([x for k in order for x in (MARKER, seq[k])])
        cells.append([x for t, k in enumerate(order) for x in (2 * t, k, 2 * t + 1, k)])
    batch = make_batch(src, trg, np.arange(size))
    batch.guide = guide_matrix(cells, batch.trg_out.size(1), batch.src.size(1))
    return batch


def _marker_accuracy(context: bool, held_out: Batch) -> float:
    """A detached head (with or without target context) trained 120 updates on the marker
    task: its share of held-out markers aligned to their source."""
    config = _config(True)
    config["model"]["alignment_head_context"] = context
    torch.manual_seed(0)
    model = build_model(from_dict(config).model, VOCAB, VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(200)
    model.train()
    for _ in range(120):
        batch = marker_batch(rng, 32)
        loss, _ = model.loss(*batch.tensors(), guide=Guide(batch.guide, 1.0))
        optimizer.zero_grad()
        (loss / batch.n_target_tokens).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        _, _, beta = model.read(
            held_out.src, held_out.src_lengths, held_out.trg_in, held_out.trg_out
        )
    assert beta is not None
    markers = held_out.trg_out == MARKER
    guided = held_out.guide.argmax(dim=-1)
    return float((beta.argmax(dim=-1) == guided)[markers].float().mean())


def test_target_context_aligns_a_word_by_the_word_after_it() -> None:
    """The marker task: with the backward GRU the head aligns nearly every held-out marker;
    without it the head can only guess among the words not yet translated."""
    held_out = marker_batch(np.random.default_rng(9999), 64)
    ahead, blind = _marker_accuracy(True, held_out), _marker_accuracy(False, held_out)
    assert ahead > 0.9 and blind < ahead - 0.3, (ahead, blind)


def test_an_ensemble_aligns_with_the_mean_of_its_heads() -> None:
    """`nmt align -m A -m B`: forced decoding of an ensemble returns the mean of its models'
    head weights (each as read() gives it), and none when a member has no head."""
    first, second = _model(True, seed=1).eval(), _model(True, seed=2).eval()
    batch = shuffle_batch(np.random.default_rng(7), 5)
    args = (batch.src, batch.src_lengths, batch.trg_in)
    with torch.no_grad():
        _, _, beta_first = first.read(*args, batch.trg_out)
        _, _, beta_second = second.read(*args, batch.trg_out)
        _, _, aligned = Ensemble([first, second]).teacher_forced(*args, batch.trg_out)
        _, _, without = Ensemble([first, _model(False).eval()]).teacher_forced(*args, batch.trg_out)
    assert beta_first is not None and beta_second is not None and aligned is not None
    assert not torch.allclose(beta_first, beta_second)
    torch.testing.assert_close(aligned, (beta_first + beta_second) / 2)
    assert without is None
