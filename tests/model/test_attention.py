"""Score functions against float64 references written loop by loop from their equations."""

from __future__ import annotations

import math

import pytest
import torch

from nmt.config import AttentionConfig, from_dict
from nmt.errors import ConfigError
from nmt.model.attention import masked_softmax
from nmt.model.registry import build_attention

B, T, S = 3, 2, 5
LENGTHS = [5, 3, 1]
POSITIONS = [1, 4]  # target steps of the T queries: 4 lies past the end of the short rows
QUERY, KEY, HIDDEN = 4, 6, 5
EQUAL_SIZE = ("dot", "scaled_dot", "cosine")


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)


def _content_energy(score: str, module, cfg: AttentionConfig, q, k) -> torch.Tensor:
    """One unnormalised score f(q, k) of a single query vector and a single key vector."""
    if score in ("additive", "concat", "mlp"):  # Bahdanau eq. 6: v^T tanh(W_q q + W_k k + b)
        w_q, w_k = module.query_proj.weight, module.key_proj.weight
        b_k, v = module.key_proj.bias, module.v.weight[0]
        return torch.dot(v, torch.tanh(w_q @ q + w_k @ k + b_k))
    if score == "cosine":  # Graves et al. eq. 6: beta * q.k / (|q| |k|)
        beta = module.beta if cfg.learn_beta else cfg.beta
        return beta * torch.dot(q, k) / (torch.linalg.norm(q) * torch.linalg.norm(k))
    if score in ("dot", "scaled_dot"):  # Luong eq. 8: q^T k
        energy = torch.dot(q, k)
    else:  # general, Luong eq. 8: q^T W_a k
        energy = torch.dot(q, module.key_proj.weight @ k)
    if score == "scaled_dot" or cfg.scale == "fixed":  # Vaswani eq. 1: / sqrt(d)
        return energy / math.sqrt(q.numel())
    if cfg.scale == "learned":
        return module.scale * energy
    return energy


def _softmax(energies: dict[int, torch.Tensor]) -> dict[int, float]:
    top = max(float(e) for e in energies.values())
    weights = {s: math.exp(float(e) - top) for s, e in energies.items()}
    total = sum(weights.values())
    return {s: w / total for s, w in weights.items()}


def _reference(cfg: AttentionConfig, module, query, values, lengths, positions):
    """alphas[b, t, s] and context[b, t] for every sentence b and query t, one at a time."""
    batch, steps, width = query.size(0), query.size(1), values.size(1)
    alphas = torch.zeros(batch, steps, width, dtype=torch.float64)
    context = torch.zeros(batch, steps, values.size(2), dtype=torch.float64)
    for b in range(batch):
        n = lengths[b]
        for t in range(steps):
            q = query[b, t]
            if cfg.score == "multihead":
                alphas[b, t], context[b, t] = _multihead(module, q, values[b, :n], width)
                continue
            if cfg.score == "location":  # Luong eq. 8: a_t = softmax(W_a h_t), truncated
                w_a = module.location_proj.weight
                energies = {s: torch.dot(w_a[s], q) for s in range(min(n, cfg.max_source_length))}
            elif cfg.score in ("local-m", "local-p"):
                if cfg.score == "local-m":  # p_t = t, kept inside the sentence
                    centre = float(min(positions[t], n - 1))
                else:  # Luong eq. 9: p_t = S sigmoid(v_p^T tanh(W_p h_t))
                    w_p, v_p = module.position_proj.weight, module.position_v.weight[0]
                    centre = n * float(torch.sigmoid(torch.dot(v_p, torch.tanh(w_p @ q))))
                window = [s for s in range(n) if abs(s - centre) <= cfg.window]
                energies = {
                    s: _content_energy(cfg.local_score, module.inner, cfg, q, values[b, s])
                    for s in window
                }
            else:
                energies = {
                    s: _content_energy(cfg.score, module, cfg, q, values[b, s]) for s in range(n)
                }
            for s, weight in _softmax(energies).items():
                if cfg.score == "local-p":  # Luong eq. 10, sigma = D / 2
                    sigma = cfg.window / 2
                    weight *= math.exp(-((s - centre) ** 2) / (2 * sigma**2))
                alphas[b, t, s] = weight
                context[b, t] += weight * values[b, s]
    return context, alphas


def _multihead(module, q, values, width):
    """Vaswani et al. section 3.2.2 with K = V = encoder states: heads, concat, W^O."""
    heads, size = module.heads, module.head_size
    w_q, w_k = module.query_proj.weight, module.key_proj.weight
    w_v, w_o = module.value_proj.weight, module.output_proj.weight
    mean = torch.zeros(width, dtype=torch.float64)
    concat = []
    for i in range(heads):
        rows = slice(i * size, (i + 1) * size)
        q_i = w_q[rows] @ q
        energies = {
            s: torch.dot(q_i, w_k[rows] @ h) / math.sqrt(size) for s, h in enumerate(values)
        }
        head = torch.zeros(size, dtype=torch.float64)
        for s, weight in _softmax(energies).items():
            mean[s] += weight / heads
            head += weight * (w_v[rows] @ values[s])
        concat.append(head)
    return mean, w_o @ torch.cat(concat)


CASES = [
    ("additive", {}),
    ("concat", {}),
    ("dot", {}),
    ("scaled_dot", {}),
    ("general", {}),
    ("bilinear", {"scale": "fixed"}),
    ("general", {"scale": "learned"}),
    ("dot", {"scale": "learned"}),
    ("cosine", {"beta": 3.0}),
    ("cosine", {"learn_beta": True}),
    ("location", {"max_source_length": 4}),  # row 0's last word is out of reach
    ("location", {"max_source_length": 7}),
    ("multihead", {"heads": 2}),
    ("local-m", {"window": 1, "local_score": "additive"}),
    ("local-p", {"window": 1, "local_score": "general"}),
    ("local-p", {"window": 2, "local_score": "dot"}),
]


def _build(score: str, options: dict, seed: int) -> tuple[AttentionConfig, torch.nn.Module, int]:
    cfg = AttentionConfig(score=score, hidden_size=HIDDEN, **options)
    inner = cfg.local_score if score in ("local-m", "local-p") else score
    key = QUERY if inner in EQUAL_SIZE else KEY
    torch.manual_seed(seed)
    module = build_attention(cfg, QUERY, key).double()
    with torch.no_grad():  # every parameter clearly non-zero, learned scales away from 1
        for param in module.parameters():
            param.normal_()
    return cfg, module, key


@pytest.mark.parametrize(("score", "options"), CASES, ids=[f"{s}{o}" for s, o in CASES])
def test_matches_float64_reference(score: str, options: dict) -> None:
    cfg, module, key = _build(score, options, seed=0)
    query = torch.randn(B, T, QUERY, dtype=torch.float64)
    values = torch.randn(B, S, key, dtype=torch.float64)
    mask = _mask(LENGTHS, S)
    with torch.no_grad():
        memory = module.prepare(values, mask)
        context, alphas = module(query, memory, torch.tensor(POSITIONS))
        ref_context, ref_alphas = _reference(cfg, module, query, values, LENGTHS, POSITIONS)
    assert context.shape == (B, T, key) and alphas.shape == (B, T, S)
    assert alphas.dtype == context.dtype == torch.float64  # float64 stays float64
    torch.testing.assert_close(alphas, ref_alphas, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(context, ref_context, rtol=1e-10, atol=1e-12)
    assert torch.all(alphas[~mask[:, None, :].expand(B, T, S)] == 0)  # exactly zero
    sums = alphas.sum(-1)
    if score == "local-p":  # the Gaussian is not renormalised (Luong eq. 10)
        assert torch.all((sums > 0) & (sums <= 1 + 1e-12))
    else:
        torch.testing.assert_close(sums, torch.ones(B, T, dtype=torch.float64))


@pytest.mark.parametrize("score", ["additive", "general", "dot", "cosine", "multihead"])
def test_padding_values_do_not_matter(score: str) -> None:
    torch.manual_seed(1)
    cfg = AttentionConfig(score=score, hidden_size=HIDDEN, heads=2)
    module = build_attention(cfg, QUERY, QUERY)
    query = torch.randn(B, T, QUERY)
    values = torch.randn(B, S, QUERY)
    mask = _mask(LENGTHS, S)
    garbage = values.masked_fill(~mask[:, :, None], 1e4)
    with torch.no_grad():
        context, alphas = module(query, module.prepare(values, mask))
        context2, alphas2 = module(query, module.prepare(garbage, mask))
    torch.testing.assert_close(context, context2)
    torch.testing.assert_close(alphas, alphas2)


def test_local_m_uses_the_step_index() -> None:
    """Queries at steps 0..T-1 by default, and the window follows the given positions."""
    cfg, module, _ = _build("local-m", {"window": 1, "local_score": "general"}, seed=2)
    query = torch.randn(1, 3, QUERY, dtype=torch.float64)
    values = torch.randn(1, S, KEY, dtype=torch.float64)
    memory = module.prepare(values, _mask([S], S))
    with torch.no_grad():
        _, default = module(query, memory)
        _, explicit = module(query, memory, torch.tensor([0, 1, 2]))
        _, shifted = module(query, memory, torch.tensor([2, 3, 4]))
    torch.testing.assert_close(default, explicit)
    for t, centre in enumerate([2, 3, 4]):
        outside = [s for s in range(S) if abs(s - centre) > 1]
        assert torch.all(shifted[0, t, outside] == 0)


def test_masked_softmax_single_real_position() -> None:
    energies = torch.tensor([[[3.0, -2.0, 100.0, 7.0]]])  # (1, 1, 4)
    mask = torch.tensor([[False, True, False, False]])
    alphas = masked_softmax(energies, mask)
    assert alphas.tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_softmax_low_precision_energies(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    energies = torch.tensor([[[-big, -big / 2, 0.0], [big, big / 2, -big]]], dtype=dtype)
    mask = torch.tensor([[True, True, False]])
    alphas = masked_softmax(energies, mask)
    assert alphas.dtype == torch.float32
    assert torch.isfinite(alphas).all()
    assert torch.all(alphas[..., 2] == 0)
    torch.testing.assert_close(alphas.sum(-1), torch.ones(1, 2))
    assert alphas[0, 0, 1] == 1.0 and alphas[0, 1, 0] == 1.0  # the larger energy wins


@pytest.mark.parametrize("score", ["general", "additive", "local-p"])
def test_bf16_module_gives_float32_alphas(score: str) -> None:
    torch.manual_seed(2)
    cfg = AttentionConfig(score=score, hidden_size=HIDDEN, window=2)
    module = build_attention(cfg, QUERY, KEY).to(torch.bfloat16)
    query = (torch.randn(B, T, QUERY) * 100).to(torch.bfloat16)
    values = (torch.randn(B, S, KEY) * 100).to(torch.bfloat16)
    mask = _mask(LENGTHS, S)
    with torch.no_grad():
        context, alphas = module(query, module.prepare(values, mask))
    assert alphas.dtype == torch.float32 and context.dtype == torch.bfloat16
    assert torch.isfinite(alphas).all() and torch.isfinite(context.float()).all()
    assert torch.all(alphas[~mask[:, None, :].expand(B, T, S)] == 0)
    assert torch.all(alphas.sum(-1) <= 1 + 1e-6) and torch.all(alphas.sum(-1) > 0)


def test_the_schema_rejects_unequal_sizes_for_dot_and_unknown_names() -> None:
    model = {"encoder": {"hidden_size": 4}, "decoder": {"hidden_size": 6}}
    with pytest.raises(ConfigError, match="use 'general' or 'additive'"):
        from_dict({"model": {**model, "attention": {"score": "dot"}}})
    with pytest.raises(ConfigError, match="additive"):
        from_dict({"model": {**model, "attention": {"score": "dott"}}})


@pytest.mark.parametrize(
    ("score", "options"),
    [
        ("additive", {}),
        ("general", {"scale": "learned"}),
        ("multihead", {"heads": 3}),
        ("local-p", {"window": 2, "local_score": "additive"}),
    ],
)
def test_gradcheck_float64(score: str, options: dict) -> None:
    _, module, key = _build(score, options, seed=3)
    mask = _mask(LENGTHS, S)
    query = torch.randn(B, T, QUERY, dtype=torch.float64, requires_grad=True)
    values = torch.randn(B, S, key, dtype=torch.float64, requires_grad=True)

    def attend(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return module(q, module.prepare(v, mask))

    assert torch.autograd.gradcheck(attend, (query, values))
