"""Every score function against a float64 reference written loop by loop from its equation.

The references loop over batch, target step and source position on vectors, reading the
module's own weights (after ``module.double()``); they share nothing with the vectorised code
but the parameters.
"""

from __future__ import annotations

import math

import pytest
import torch

from nmt.config import AttentionConfig
from nmt.model.attention import masked_softmax
from nmt.model.positional import LocalAttention
from nmt.model.registry import SCORES as SCORE_CLASSES
from nmt.model.registry import build_attention

SCORES = tuple(SCORE_CLASSES)  # the shipped names, aliases included

B, T, S = 3, 3, 6
LENGTHS = [6, 4, 1]
QUERY, KEY, HIDDEN = 4, 6, 5
POSITIONS = [0, 3, 7]  # target steps of the T queries: 7 is past every sentence's end
WINDOW = 1  # local D, small enough that the window cuts the 6 source positions

# (test id, config keys): every score name once, then the options that change the maths.
CASES = [(score, {"score": score}) for score in SCORES] + [
    ("dot-learned-scale", {"score": "dot", "scale": "learned"}),
    ("dot-fixed-scale", {"score": "dot", "scale": "fixed"}),
    ("general-fixed-scale", {"score": "general", "scale": "fixed"}),
    ("general-learned-scale", {"score": "general", "scale": "learned"}),
    ("cosine-learned-beta", {"score": "cosine", "beta": 2.0, "learn_beta": True}),
    ("location-truncated", {"score": "location", "max_source_length": 4}),
    ("multihead-1", {"score": "multihead", "heads": 1}),
    ("multihead-3", {"score": "multihead", "heads": 3}),
    ("local-m-additive", {"score": "local-m", "local_score": "additive"}),
    ("local-m-dot", {"score": "local-m", "local_score": "dot"}),
    ("local-p-cosine", {"score": "local-p", "local_score": "cosine"}),
    ("local-p-dot-learned", {"score": "local-p", "local_score": "dot", "scale": "learned"}),
    ("local-p-concat", {"score": "local-p", "local_score": "concat"}),
]
IDS = [name for name, _ in CASES]


def _config(keys: dict) -> AttentionConfig:
    defaults = {"hidden_size": HIDDEN, "heads": 2, "window": WINDOW}
    return AttentionConfig(**{**defaults, **keys})


def _inner_score(cfg: AttentionConfig) -> str:
    return cfg.local_score if cfg.score in ("local-m", "local-p") else cfg.score


def _key_size(cfg: AttentionConfig) -> int:
    return QUERY if SCORE_CLASSES[_inner_score(cfg)].equal_sizes else KEY


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)


def _module(cfg: AttentionConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = build_attention(cfg, QUERY, _key_size(cfg))
    with torch.no_grad():  # every weight, bias and scalar clearly non-default
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.7)
    return module


def _inputs(key_size: int, dtype: torch.dtype = torch.float64, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(B, T, QUERY, generator=generator).to(dtype)
    values = torch.randn(B, S, key_size, generator=generator).to(dtype)
    return query, values, _mask(LENGTHS, S)


# ---- the references: one query vector q, one key vector k at a time --------------------------


def _content_energy(score: str, module, cfg: AttentionConfig, q, k) -> float:
    """f(q, k) for the scores of one query and one key (Bahdanau eq. 6, Luong eq. 8, NTM eq. 6)."""
    if score in ("additive", "concat", "mlp"):
        w_q, w_k, b_k = module.query_proj.weight, module.key_proj.weight, module.key_proj.bias
        return float(torch.dot(module.v.weight[0], torch.tanh(w_q @ q + w_k @ k + b_k)))
    if score == "cosine":
        beta = float(module.beta)
        norms = max(float(q.norm()), 1e-8) * max(float(k.norm()), 1e-8)
        return beta * float(torch.dot(q, k)) / norms
    if score in ("dot", "scaled_dot"):
        energy = float(torch.dot(q, k))
    else:  # general, bilinear, multiplicative: q^T W_a k
        energy = float(torch.dot(q, module.key_proj.weight @ k))
    if score == "scaled_dot" or cfg.scale == "fixed":
        energy /= math.sqrt(q.numel())
    if cfg.scale == "learned":
        energy *= float(module.scale)
    return energy


def _softmax(energies: dict[int, float]) -> dict[int, float]:
    top = max(energies.values())
    exps = {s: math.exp(e - top) for s, e in energies.items()}
    total = sum(exps.values())
    return {s: x / total for s, x in exps.items()}


def _row(weights: dict[int, float]) -> torch.Tensor:
    row = torch.zeros(S, dtype=torch.float64)
    for s, w in weights.items():
        row[s] = w
    return row


def _local_weights(module, cfg, q, values_b, length, step) -> tuple[dict, dict]:
    """Luong sec. 3.2: (window softmax, final weights) for one query."""
    if cfg.score == "local-m":
        centre = float(min(step, length - 1))
    else:  # eq. 9: p_t = S sigmoid(v_p^T tanh(W_p h_t))
        logit = float(
            torch.dot(module.position_v.weight[0], torch.tanh(module.position_proj.weight @ q))
        )
        centre = length / (1 + math.exp(-logit))
    window = [s for s in range(length) if abs(s - centre) <= cfg.window]
    align = _softmax(
        {s: _content_energy(cfg.local_score, module.inner, cfg, q, values_b[s]) for s in window}
    )
    if cfg.score == "local-m":
        return align, align
    sigma = cfg.window / 2  # eq. 10
    return align, {s: a * math.exp(-((s - centre) ** 2) / (2 * sigma**2)) for s, a in align.items()}


def _multihead(module, cfg, q, values_b, length) -> tuple[torch.Tensor, torch.Tensor]:
    """Vaswani et al. sec. 3.2.2 for one query: (context, mean of the heads' weights)."""
    size = values_b.size(1) // cfg.heads
    heads, mean = [], torch.zeros(S, dtype=torch.float64)
    for i in range(cfg.heads):
        rows = slice(i * size, (i + 1) * size)
        w_q = module.query_proj.weight[rows]
        w_k, w_v = module.key_proj.weight[rows], module.value_proj.weight[rows]
        weights = _softmax(
            {
                s: float(torch.dot(w_q @ q, w_k @ values_b[s])) / math.sqrt(size)
                for s in range(length)
            }
        )
        heads.append(sum(weights[s] * (w_v @ values_b[s]) for s in range(length)))
        mean += _row(weights) / cfg.heads
    return module.output_proj.weight @ torch.cat(heads), mean


def _reference(module, cfg: AttentionConfig, query, values, positions):
    """-> context (B, T, Hk), alphas (B, T, S), window softmax (B, T, S) (local; else alphas)."""
    context = torch.zeros(B, T, values.size(2), dtype=torch.float64)
    alphas = torch.zeros(B, T, S, dtype=torch.float64)
    align = torch.zeros(B, T, S, dtype=torch.float64)
    for b in range(B):
        length = LENGTHS[b]
        for t in range(T):
            q = query[b, t]
            if cfg.score == "multihead":
                context[b, t], alphas[b, t] = _multihead(module, cfg, q, values[b], length)
                align[b, t] = alphas[b, t]
                continue
            if cfg.score in ("local-m", "local-p"):
                pre, weights = _local_weights(module, cfg, q, values[b], length, positions[t])
            elif cfg.score == "location":  # Luong eq. 8: softmax(W_a h_t), first S rows
                reach = min(length, cfg.max_source_length)
                energies = module.location_proj.weight[:reach] @ q
                weights = pre = _softmax({s: float(energies[s]) for s in range(reach)})
            else:
                weights = pre = _softmax(
                    {
                        s: _content_energy(cfg.score, module, cfg, q, values[b, s])
                        for s in range(length)
                    }
                )
            alphas[b, t], align[b, t] = _row(weights), _row(pre)
            for s, w in weights.items():
                context[b, t] += w * values[b, s]
    return context, alphas, align


# ---- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "keys"), CASES, ids=IDS)
def test_matches_float64_reference(name: str, keys: dict) -> None:
    cfg = _config(keys)
    module = _module(cfg).double()
    query, values, mask = _inputs(_key_size(cfg))
    positions = torch.tensor(POSITIONS)
    with torch.no_grad():
        context, alphas = module(query, module.prepare(values, mask), positions)
        ref_context, ref_alphas, _ = _reference(module, cfg, query, values, POSITIONS)
    assert context.shape == (B, T, values.size(2)) and alphas.shape == (B, T, S)
    assert alphas.dtype == torch.float64
    torch.testing.assert_close(alphas, ref_alphas, rtol=0, atol=1e-10)
    torch.testing.assert_close(context, ref_context, rtol=0, atol=1e-10)
    assert torch.all(alphas[~mask[:, None, :].expand(B, T, S)] == 0)  # exactly zero


@pytest.mark.parametrize(("name", "keys"), CASES, ids=IDS)
def test_rows_sum_to_one(name: str, keys: dict) -> None:
    """Every row sums to 1, except local-p, whose Gaussian (Luong eq. 10) only shrinks them:
    there the window softmax sums to 1, is exactly 0 outside the window, and the final weights
    equal the reference."""
    cfg = _config(keys)
    module = _module(cfg).double()
    query, values, mask = _inputs(_key_size(cfg))
    positions = torch.tensor(POSITIONS)
    memory = module.prepare(values, mask)
    ones = torch.ones(B, T, dtype=torch.float64)
    with torch.no_grad():
        _, alphas = module(query, memory, positions)
    if cfg.score != "local-p":
        torch.testing.assert_close(alphas.sum(-1), ones, rtol=0, atol=1e-12)
        return
    with torch.no_grad():
        align, distance = module.alignment(query, memory, positions)
        _, _, ref_align = _reference(module, cfg, query, values, POSITIONS)
    torch.testing.assert_close(align.sum(-1), ones, rtol=0, atol=1e-12)
    torch.testing.assert_close(align, ref_align, rtol=0, atol=1e-10)
    outside = (distance.abs() > cfg.window) | ~mask[:, None, :]
    assert torch.all(align[outside] == 0) and torch.all(alphas[outside] == 0)
    assert torch.all(alphas.sum(-1) <= 1) and torch.all(alphas <= align)


def test_local_m_window_positions() -> None:
    """local-m puts weight exactly on the real positions s with |s - min(t, len-1)| <= D."""
    cfg = _config({"score": "local-m"})
    module = _module(cfg)
    query, values, mask = _inputs(KEY, torch.float32)
    with torch.no_grad():
        _, alphas = module(query, module.prepare(values, mask), torch.tensor(POSITIONS))
    for b, length in enumerate(LENGTHS):
        for t, step in enumerate(POSITIONS):
            centre = min(step, length - 1)
            expected = [s for s in range(length) if abs(s - centre) <= WINDOW]
            assert torch.nonzero(alphas[b, t]).flatten().tolist() == expected


def test_local_m_positions_default_to_the_query_steps() -> None:
    cfg = _config({"score": "local-m"})
    module = _module(cfg)
    query, values, mask = _inputs(KEY, torch.float32)
    memory = module.prepare(values, mask)
    with torch.no_grad():
        torch.testing.assert_close(module(query, memory), module(query, memory, torch.arange(T)))


def test_local_p_centre_is_scaled_by_each_sentence_length() -> None:
    cfg = _config({"score": "local-p"})
    module = _module(cfg)
    assert isinstance(module, LocalAttention)
    query, values, mask = _inputs(KEY, torch.float32)
    with torch.no_grad():
        centres = module.centres(query, module.prepare(values, mask), None)  # (B, T)
    lengths = torch.tensor(LENGTHS, dtype=torch.float32)[:, None]
    assert torch.all(centres >= 0) and torch.all(centres <= lengths)
    assert torch.all(centres[2] <= 1)  # the one-word sentence


def test_location_truncates_to_the_sentence_and_to_max_source_length() -> None:
    """W_a h_t has max_source_length rows; a sentence sees the first len of them, whatever the
    padded width, and positions past max_source_length get no weight (no crash)."""
    cfg = _config({"score": "location", "max_source_length": 4})
    module = _module(cfg)
    query, values, mask = _inputs(KEY, torch.float32)
    with torch.no_grad():
        _, alphas = module(query, module.prepare(values, mask))  # S = 6 > 4
        _, alone = module(query[1:2], module.prepare(values[1:2, :4], mask[1:2, :4]))
        expected = torch.softmax(module.location_proj(query[0]), dim=-1)  # (T, 4)
    assert torch.all(alphas[0, :, 4:] == 0)
    torch.testing.assert_close(alphas[0, :, :4], expected)
    torch.testing.assert_close(alphas[1, :, :4], alone[0])


def test_multihead_alphas_are_the_mean_of_the_heads() -> None:
    cfg = _config({"score": "multihead", "heads": 3})
    module = _module(cfg).double()
    query, values, mask = _inputs(KEY)
    with torch.no_grad():
        memory = module.prepare(values, mask)
        _, alphas = module(query, memory)
        heads = masked_softmax(module._split(module.query_proj(query)) @ memory.keys.mT, mask)
    assert heads.shape == (B, 3, T, S)
    torch.testing.assert_close(alphas, heads.mean(dim=1), rtol=0, atol=1e-12)
    assert not torch.allclose(heads[:, 0], heads[:, 1])  # the heads do differ


@pytest.mark.parametrize(
    ("keys", "parameter"),
    [
        ({"score": "dot", "scale": "learned"}, "scale"),
        ({"score": "general", "scale": "learned"}, "scale"),
        ({"score": "cosine", "learn_beta": True}, "beta"),
        ({"score": "local-p", "local_score": "general", "scale": "learned"}, "inner.scale"),
    ],
)
def test_learned_scale_and_beta_get_gradients(keys: dict, parameter: str) -> None:
    cfg = AttentionConfig(**keys)
    module = build_attention(cfg, QUERY, _key_size(cfg))
    value = module.get_parameter(parameter)
    assert float(value.detach()) == (cfg.beta if parameter == "beta" else 1.0)  # initialisation
    query, values, mask = _inputs(_key_size(cfg), torch.float32)
    context, alphas = module(query, module.prepare(values, mask))
    (context.square().sum() + alphas[..., 0].sum()).backward()
    assert value.grad is not None and torch.isfinite(value.grad) and value.grad != 0


def test_cosine_survives_zero_vectors() -> None:
    cfg = AttentionConfig(score="cosine", learn_beta=True)
    module = build_attention(cfg, KEY, KEY)
    _, values, mask = _inputs(KEY, torch.float32)
    query = torch.cat([torch.zeros(B, 1, KEY), torch.randn(B, T - 1, KEY)], dim=1)
    values[:, 0] = 0.0
    query.requires_grad_(True)
    values.requires_grad_(True)
    context, alphas = module(query, module.prepare(values, mask))
    context.sum().backward()
    assert torch.isfinite(context).all() and torch.isfinite(alphas).all()
    assert torch.isfinite(query.grad).all() and torch.isfinite(values.grad).all()
    # a zero query scores 0 everywhere: uniform weights over the real positions
    torch.testing.assert_close(alphas[1, 0, :4], torch.full((4,), 0.25))


def test_masked_softmax_keeps_float64_and_widens_half() -> None:
    energies = torch.randn(2, 3, 4, dtype=torch.float64)
    mask = _mask([4, 2], 4)
    assert masked_softmax(energies, mask).dtype == torch.float64
    assert masked_softmax(energies.to(torch.bfloat16), mask).dtype == torch.float32
    full = mask[:, None, :].expand(2, 3, 4)
    torch.testing.assert_close(masked_softmax(energies, full), masked_softmax(energies, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("name", "keys"), CASES, ids=IDS)
def test_autocast_smoke(name: str, keys: dict, dtype: torch.dtype) -> None:
    """Under CPU autocast: finite outputs, float32 alphas, rows summing to 1 (local-p: the
    window softmax), exact zeros at padding, with large-magnitude inputs."""
    cfg = _config(keys)
    module = _module(cfg)
    query, values, mask = _inputs(_key_size(cfg), torch.float32)
    query, values = query * 30, values * 30
    positions = torch.tensor(POSITIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        memory = module.prepare(values, mask)
        context, alphas = module(query, memory, positions)
        rows = module.alignment(query, memory, positions)[0] if cfg.score == "local-p" else alphas
    assert alphas.dtype == torch.float32
    assert torch.isfinite(context.float()).all() and torch.isfinite(alphas).all()
    assert torch.all(alphas[~mask[:, None, :].expand(B, T, S)] == 0)
    torch.testing.assert_close(rows.sum(-1), torch.ones(B, T), rtol=0, atol=1e-5)


BEAMS = 3


@pytest.mark.parametrize(("name", "keys"), CASES, ids=IDS)
def test_a_memory_shared_by_the_beams_gives_each_beams_own(name: str, keys: dict) -> None:
    """A score that shares its memory among a sentence's beams (Memory.shared) gives every
    beam row what a copy of the memory per row gives, in float64, padding included, and
    dropping sentences keeps their memory; the others are given a copy per row."""
    cfg = _config(keys)
    module = _module(cfg).double()
    _, values, mask = _inputs(_key_size(cfg))
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(B * BEAMS, T, QUERY, generator=generator).double()  # (B*K, T, Hq)
    rows = torch.arange(B).repeat_interleave(BEAMS)  # (B*K,) each row's sentence
    memory = module.prepare(values, mask)
    copied = memory.index_select(rows)
    positions = torch.tensor(POSITIONS)
    with torch.no_grad():
        want = module(query, copied, positions)
        if not module.shares_beams:
            return
        shared = memory.shared(BEAMS)
        got = module(query, shared, positions)
        kept = torch.tensor([0, 1, 2, 6, 7, 8])  # sentences 0 and 2, beam rows in order
        dropped = module(query[kept], shared.index_select(kept), positions)
        want_dropped = module(query[kept], copied.index_select(kept), positions)
    for a, b in [(got, want), (dropped, want_dropped)]:
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-12)  # context
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-12)  # alphas
    assert shared.values.shape[0] == B and shared.index_select(kept).values.shape[0] == 2


def test_the_scores_that_share_the_beams_memory() -> None:
    """dot, scaled_dot, general (bilinear, multiplicative) and cosine read the memory through
    with_keys, with_values and row_mask alone; every other score is given a copy per beam
    row."""
    sharing = sorted(name for name, score in SCORE_CLASSES.items() if score.shares_beams)
    assert sharing == ["bilinear", "cosine", "dot", "general", "multiplicative", "scaled_dot"]
