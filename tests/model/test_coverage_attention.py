"""Coverage attention (Tu et al. 2016) against a float64 reference written from its equations,
loop by loop, reading the module's own weights; then through both decoders, beam search and the
CPU training path.

    e_{t,j} = v^T tanh(W_q q_t + W_k h_j + b + W_c C_{t-1,j}),  C_0 = 0
    sum:        C_{t,j} = C_{t-1,j} + alpha_{t,j}
    linguistic: C_{t,j} = C_{t-1,j} + alpha_{t,j} / Phi_j,  Phi_j = N sigmoid(U_f h_j + b_f)
    neural:     C_{t,j} = GRU(C_{t-1,j}, [alpha_{t,j}; h_j; q_t])
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from decode import run_beam, run_greedy
from test_learning import exact_match, reverse_batch, train_reverse

from nmt.config import AttentionConfig, from_dict
from nmt.data.batching import make_batch
from nmt.errors import ConfigError
from nmt.model import build_model
from nmt.model.registry import build_attention

B, T, S = 3, 4, 6
LENGTHS = [6, 4, 1]
QUERY, KEY, HIDDEN, COVERAGE = 4, 6, 5, 3
KINDS = ["sum", "linguistic", "neural"]


def _module(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = AttentionConfig(
        score="additive",
        hidden_size=HIDDEN,
        coverage=kind,
        coverage_size=COVERAGE,
        fertility_max=1.5,
    )
    module = build_attention(cfg, QUERY, KEY)
    with torch.no_grad():  # every weight clearly non-default
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.7)
    return module.double()


def _inputs(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(B, T, QUERY, generator=generator, dtype=torch.float64)
    values = torch.randn(B, S, KEY, generator=generator, dtype=torch.float64)
    mask = torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]
    return query, values, mask


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _update(module, kind: str, c: list[float], alpha: float, h, q) -> list[float]:
    """C_{t,j} from C_{t-1,j} (a list of d_c floats) for one source position."""
    cov = module.coverage
    if kind == "sum":
        return [c[0] + alpha]
    if kind == "linguistic":
        fertility = cov.fertility_max * _sigmoid(
            float(cov.fertility.weight[0] @ h + cov.fertility.bias[0])
        )
        return [c[0] + alpha / fertility]
    d = len(c)
    c_vec = torch.tensor(c, dtype=torch.float64)
    x_alpha, w_h, b_ih = cov.from_alpha, cov.from_key.weight, cov.from_key.bias
    w_q, w_hh, b_hh = cov.from_query.weight, cov.recurrent.weight, cov.recurrent.bias

    def gate(k: int) -> tuple[float, ...]:
        rows = range(k * d, (k + 1) * d)
        inputs = [float(x_alpha[r] * alpha + w_h[r] @ h + w_q[r] @ q + b_ih[r]) for r in rows]
        hidden = [float(w_hh[r] @ c_vec + b_hh[r]) for r in rows]
        return tuple(zip(inputs, hidden, strict=True))

    r = [_sigmoid(i + h_) for i, h_ in gate(0)]
    z = [_sigmoid(i + h_) for i, h_ in gate(1)]
    n = [math.tanh(i + r[u] * h_) for u, (i, h_) in enumerate(gate(2))]
    return [(1 - z[u]) * n[u] + z[u] * c[u] for u in range(d)]


def _reference(module, kind: str, query, values):
    """-> context (B, T, Hk), alphas (B, T, S), final coverage (B, S, d_c), loop by loop."""
    d = COVERAGE if kind == "neural" else 1
    context = torch.zeros(B, T, KEY, dtype=torch.float64)
    alphas = torch.zeros(B, T, S, dtype=torch.float64)
    final = torch.zeros(B, S, d, dtype=torch.float64)
    w_q, w_k, b_k = module.query_proj.weight, module.key_proj.weight, module.key_proj.bias
    v, w_c = module.v.weight[0], module.coverage.proj.weight
    for b in range(B):
        length = LENGTHS[b]
        coverage = [[0.0] * d for _ in range(length)]
        for t in range(T):
            q = query[b, t]
            energies = [
                float(
                    v
                    @ torch.tanh(
                        w_q @ q
                        + w_k @ values[b, s]
                        + b_k
                        + w_c @ torch.tensor(coverage[s], dtype=torch.float64)
                    )
                )
                for s in range(length)
            ]
            top = max(energies)
            exps = [math.exp(e - top) for e in energies]
            weights = [x / sum(exps) for x in exps]
            for s in range(length):
                alphas[b, t, s] = weights[s]
                context[b, t] += weights[s] * values[b, s]
            coverage = [
                _update(module, kind, coverage[s], weights[s], values[b, s], q)
                for s in range(length)
            ]
        for s in range(length):
            final[b, s] = torch.tensor(coverage[s], dtype=torch.float64)
    return context, alphas, final


@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_reference(kind: str) -> None:
    module = _module(kind).eval()
    query, values, mask = _inputs()
    with torch.no_grad():
        memory = module.prepare(values, mask)
        context, alphas, coverage = module.attend(query, memory, torch.arange(T), None)
        ref_context, ref_alphas, ref_coverage = _reference(module, kind, query, values)
    assert alphas.dtype == coverage.dtype == torch.float64
    torch.testing.assert_close(alphas, ref_alphas, rtol=0, atol=1e-10)
    torch.testing.assert_close(context, ref_context, rtol=0, atol=1e-10)
    torch.testing.assert_close(coverage, ref_coverage, rtol=0, atol=1e-10)
    assert torch.all(alphas[~mask[:, None, :].expand(B, T, S)] == 0)
    assert torch.all(coverage[~mask] == 0)  # padding collects no coverage
    assert not torch.allclose(alphas[:, 1], alphas[:, 0])  # the coverage changes the weights


@pytest.mark.parametrize("kind", KINDS)
def test_steps_carry_the_coverage(kind: str) -> None:
    """T queries at once equal T calls of one query, each given the coverage the last left."""
    module = _module(kind).eval()
    query, values, mask = _inputs()
    with torch.no_grad():
        memory = module.prepare(values, mask)
        context, alphas, final = module.attend(query, memory, torch.arange(T), None)
        coverage = None
        for t in range(T):
            step_context, step_alphas, coverage = module.attend(
                query[:, t : t + 1], memory, torch.arange(t, t + 1), coverage
            )
            torch.testing.assert_close(step_alphas[:, 0], alphas[:, t], rtol=0, atol=1e-12)
            torch.testing.assert_close(step_context[:, 0], context[:, t], rtol=0, atol=1e-12)
    torch.testing.assert_close(coverage, final, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_training_path_gives_the_plain_gradients(kind: str) -> None:
    """In training, the additive energies take nmt's recomputing CPU path; the gradients of
    every parameter and input equal the plain path's (eval mode) in float64."""
    grads = {}
    for training in (False, True):
        module = _module(kind).train(training)
        query, values, mask = _inputs()
        query.requires_grad_(True)
        values.requires_grad_(True)
        context, alphas, coverage = module.attend(
            query, module.prepare(values, mask), torch.arange(T), None
        )
        (context.square().sum() + alphas[..., 0].sum() + coverage.sum()).backward()
        grads[training] = [query.grad, values.grad] + [p.grad for p in module.parameters()]
    for plain, fast in zip(grads[False], grads[True], strict=True):
        assert plain is not None and fast is not None
        torch.testing.assert_close(fast, plain, rtol=0, atol=1e-10)
    assert all(g.abs().sum() > 0 for g in grads[True])  # W_c, U_f and the GRU all learn


def _model(style: str, feeding: bool, kind: str, seed: int = 0):
    cfg = from_dict(
        {
            "model": {
                "embedding_size": 8,
                "embedding_dropout": 0.0,
                "encoder": {"hidden_size": 8, "dropout": 0.0},
                "decoder": {
                    "style": style,
                    "hidden_size": 16,
                    "input_feeding": feeding,
                    "dropout": 0.0,
                },
                "attention": {"score": "additive", "coverage": kind, "coverage_size": 4},
            }
        }
    )
    torch.manual_seed(seed)
    return build_model(cfg.model, 12, 12).double().eval()


DECODERS = [("bahdanau", False), ("luong", True), ("luong", False)]
DECODER_IDS = ["bahdanau", "luong-feed", "luong"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("style", "feeding"), DECODERS, ids=DECODER_IDS)
def test_decoders_carry_coverage_from_step_to_step(style: str, feeding: bool, kind: str) -> None:
    """Teacher forcing (Luong without feeding: all queries in one call) equals stepping the
    decoder, whose state carries the coverage; beam reordering takes each beam's own."""
    model = _model(style, feeding, kind)
    src = [[4, 5, 6, 7, 8, 2], [9, 10, 2], [11, 2]]
    trg = [[5, 6, 7, 8], [9, 10], [11, 4, 4]]
    batch = make_batch(src, trg, np.arange(3))
    with torch.no_grad():
        features, alphas = model(batch.src, batch.src_lengths, batch.trg_in)
        memory, state = model.encode(batch.src, batch.src_lengths)
        for t in range(batch.trg_in.size(1)):
            step_features, step_alphas, state = model.decoder.step(
                batch.trg_in[:, t], memory, state
            )
            torch.testing.assert_close(step_features, features[:, t], rtol=0, atol=1e-10)
            torch.testing.assert_close(step_alphas, alphas[:, t], rtol=0, atol=1e-10)
    assert state.coverage is not None and state.coverage.shape[:2] == batch.src.shape
    picked = state.index_select(torch.tensor([2, 0, 0]))
    assert torch.equal(picked.coverage, state.coverage[[2, 0, 0]])
    if kind == "sum":  # each position's coverage is the sum of its weights so far
        torch.testing.assert_close(state.coverage[..., 0], alphas.sum(1), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("style", "feeding"), DECODERS, ids=DECODER_IDS)
def test_search_with_coverage_is_batch_invariant(style: str, feeding: bool) -> None:
    model = _model(style, feeding, "neural", seed=2)
    batch = make_batch([[4, 5, 6, 7, 2], [8, 9, 2]], [[4], [4]], np.arange(2))
    together = run_beam(model, batch.src, batch.src_lengths, beam_size=3, return_attention=True)
    alone = run_beam(
        model, batch.src[1:2, :3], batch.src_lengths[1:2], beam_size=3, return_attention=True
    )
    assert [h.tokens for h in together[1]] == [h.tokens for h in alone[0]]
    torch.testing.assert_close(together[1][0].alphas[:, :3], alone[0][0].alphas, rtol=0, atol=1e-10)
    greedy = run_greedy(model, batch.src, batch.src_lengths, return_attention=True)
    assert greedy[0].alphas.shape[1] == batch.src.size(1)


def test_coverage_feeds_only_the_additive_score() -> None:
    for score in ("general", "multihead", "local-p"):
        with pytest.raises(ConfigError) as info:
            from_dict({"model": {"attention": {"score": score, "coverage": "sum"}}})
        message = str(info.value)
        assert message.startswith(
            f"config: model.attention.coverage: 'sum' feeds the additive score, not '{score}'"
        )
        assert "\n" not in message
    for key, value in (("coverage", "fertility"), ("coverage_size", 0), ("fertility_max", 0)):
        with pytest.raises(ConfigError) as info:
            from_dict({"model": {"attention": {"score": "additive", key: value}}})
        assert f"model.attention.{key}" in str(info.value)


@pytest.mark.parametrize("kind", ["linguistic", "neural"])
def test_a_model_with_coverage_learns_to_reverse(kind: str) -> None:
    model = train_reverse(
        {
            "embedding_size": 16,
            "embedding_dropout": 0.0,
            "encoder": {"hidden_size": 24, "dropout": 0.0},
            "decoder": {"hidden_size": 32, "dropout": 0.0, "style": "bahdanau"},
            "attention": {"score": "additive", "coverage": kind},
        },
        steps=300,
    )
    test = reverse_batch(np.random.default_rng(123), 200)
    assert exact_match(model, test, beam=1) >= 0.95
    assert exact_match(model, test, beam=4) >= 0.95
