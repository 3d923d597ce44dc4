"""The GNMT coverage penalty cp(x; Y) = beta * sum_i log(min(sum_j a_ij, 1)): the function
against a float64 reference, and greedy and beam scores recomputed from the returned
attention and teacher forcing."""

from __future__ import annotations

import math

import pytest
import torch
from searchref import forced, lp, model, options, source

from nmt.config import DecodingConfig
from nmt.decoding.search import beam_search, coverage_penalty, greedy_search

VOCAB = 10


def _reference_penalty(alphas: torch.Tensor, src_length: int, beta: float) -> float:
    """beta * sum over real source positions i of log(min(sum_j a_ji, 1)), in float64;
    alphas (T, S) one row per output step, EOS's included."""
    total = 0.0
    for i in range(src_length):
        column = sum(float(alphas[j, i]) for j in range(alphas.size(0)))
        total += math.log(min(column, 1.0))
    return beta * total


def test_coverage_penalty_matches_the_equation_with_padding() -> None:
    """coverage_penalty on random attention over padded sources equals the float64 equation."""
    generator = torch.Generator().manual_seed(0)
    lengths = [7, 3, 1, 5, 7, 2]
    width = max(lengths)
    steps = [1, 4, 2, 9, 3, 6]  # few steps: coverage < 1 somewhere; many: capped at 1
    coverages, expected = [], []
    for n, t in zip(lengths, steps, strict=True):
        scores = torch.randn(t, width, generator=generator) * 2
        scores[:, n:] = -math.inf  # padding gets no attention
        alphas = torch.softmax(scores, dim=-1)
        alphas[:, n:] = torch.rand(t, width - n, generator=generator)  # junk that must be ignored
        coverages.append(alphas.sum(dim=0))
        expected.append(_reference_penalty(alphas, n, 0.7))
    coverage = torch.stack(coverages)  # (N, S)
    got = coverage_penalty(coverage, torch.tensor(lengths), 0.7)
    assert got.shape == (len(lengths),) and got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    real = coverage[:, :width] * (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])
    assert (real > 1).any() and ((real > 0) & (real < 1)).any()  # both branches of the min
    assert expected[0] < 0 and expected[1] < 0
    assert expected[2] == 0.0 and float(got[2]) == 0.0  # a one-token source is fully covered


def test_coverage_penalty_scales_with_beta_and_is_never_positive() -> None:
    """cp is linear in beta, 0 for beta 0, and <= 0 (log of a number capped at 1)."""
    coverage = torch.tensor([[0.2, 1.5, 0.9, 0.0], [3.0, 0.5, 0.25, 0.25]])
    lengths = torch.tensor([3, 4])
    one = coverage_penalty(coverage, lengths, 1.0)
    assert torch.all(one <= 0)
    assert torch.equal(coverage_penalty(coverage, lengths, 0.0), torch.zeros(2))
    torch.testing.assert_close(coverage_penalty(coverage, lengths, 2.5), 2.5 * one)
    expected = [math.log(0.2) + 0 + math.log(0.9), 0 + math.log(0.5) + 2 * math.log(0.25)]
    assert one.tolist() == pytest.approx(expected, abs=1e-6)


def _check_hypothesis(m, src_one: torch.Tensor, h, alpha: float, beta: float) -> float:
    """Assert h's log_prob, attention and score against float64 teacher forcing and the
    equation; returns the penalty."""
    n = src_one.size(1)
    log_prob, (attention,) = forced([m], src_one, h.tokens)
    assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
    assert h.alphas is not None and h.alphas.shape[0] == len(h.tokens) + 1
    torch.testing.assert_close(h.alphas[:, :n].double(), attention, atol=1e-5, rtol=0)
    assert torch.all(h.alphas[:, n:] == 0)
    penalty = _reference_penalty(h.alphas.double(), n, beta)
    expected = h.log_prob / lp(len(h.tokens) + 1, alpha) + penalty
    assert h.score == pytest.approx(expected, abs=1e-5)
    return penalty


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
@pytest.mark.parametrize(("alpha", "beta"), [(0.0, 0.3), (1.0, 0.2), (0.6, 2.0)])
def test_beam_scores_include_the_penalty_of_their_attention(style: str, alpha: float, beta: float):
    """Each n-best score is log P / lp + cp, cp recomputed in float64 from the returned alphas."""
    m = model(VOCAB, seed={"bahdanau": 21, "luong": 13}[style], style=style)
    lengths = [6, 2, 4, 5]
    src, src_lengths = source(lengths, VOCAB, seed=14)
    cfg = options(beam_size=4, alpha=alpha, ratio=0.5, offset=1, coverage=beta)
    results = beam_search(m, src, src_lengths, cfg, n_best=4, return_attention=True)
    penalised, capped = 0, 0
    for b, (hyps, n) in enumerate(zip(results, lengths, strict=True)):
        assert 1 <= len(hyps) <= 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            penalised += _check_hypothesis(m, src[b : b + 1, :n], h, alpha, beta) < -1e-3
            capped += int((h.alphas[:, :n].sum(dim=0) > 1).sum())
    assert penalised > 0 and capped > 0  # preconditions: both sides of min(coverage, 1)


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_greedy_scores_include_the_penalty_of_their_attention(style: str) -> None:
    """Greedy (beam 1, both paths) scores log P / lp + cp of its own attention; tokens unchanged."""
    m = model(VOCAB, seed=15, style=style)
    lengths = [6, 2, 4, 5]
    src, src_lengths = source(lengths, VOCAB, seed=16)
    alpha, beta = 0.8, 0.5
    cfg = options(beam_size=1, alpha=alpha, ratio=1.0, offset=2, coverage=beta)
    plain = greedy_search(
        m, src, src_lengths, options(beam_size=1, alpha=alpha, ratio=1.0, offset=2)
    )
    hyps = greedy_search(m, src, src_lengths, cfg, return_attention=True)
    fast = beam_search(m, src, src_lengths, cfg, return_attention=True)
    penalised = 0
    for b, n in enumerate(lengths):
        h = hyps[b]
        assert h.tokens == plain[b].tokens  # the penalty only rescored the finished output
        assert fast[b][0].tokens == h.tokens and fast[b][0].score == h.score
        penalty = _check_hypothesis(m, src[b : b + 1, :n], h, alpha, beta)
        assert h.score == pytest.approx(plain[b].score + penalty, abs=1e-5)
        penalised += penalty < -1e-3
    assert penalised > 0


def test_greedy_penalty_without_returned_attention() -> None:
    """With coverage on and return_attention off, greedy still adds cp and returns no alphas."""
    m = model(VOCAB, seed=17)
    src, src_lengths = source([5, 3], VOCAB, seed=18)
    cfg = options(beam_size=1, alpha=1.0, ratio=1.0, offset=2, coverage=0.5)
    with_alphas = greedy_search(m, src, src_lengths, cfg, return_attention=True)
    without = greedy_search(m, src, src_lengths, cfg)
    for a, w in zip(with_alphas, without, strict=True):
        assert w.alphas is None
        assert (w.tokens, w.score, w.log_prob) == (a.tokens, a.score, a.log_prob)
    beam_with = beam_search(m, src, src_lengths, options(3, 1.0, 1.0, 2, coverage=0.5), 3, True)
    beam_without = beam_search(m, src, src_lengths, options(3, 1.0, 1.0, 2, coverage=0.5), 3)
    for a, w in zip(beam_with, beam_without, strict=True):
        assert [(h.tokens, h.score) for h in a] == [(h.tokens, h.score) for h in w]
        assert all(h.alphas is None for h in w)


def test_zero_beta_is_bit_identical_to_the_default() -> None:
    """coverage_penalty=0 gives exactly the default config's hypotheses, scores and attention."""
    m = model(VOCAB, seed=19, style="luong")
    src, src_lengths = source([6, 3, 4], VOCAB, seed=20)
    base = {"beam_size": 4, "length_penalty": 0.7, "max_len_ratio": 1.2, "max_len_offset": 3}
    default = DecodingConfig(**base)
    zero = DecodingConfig(**base, coverage_penalty=0.0)
    a = beam_search(m, src, src_lengths, default, n_best=4, return_attention=True)
    z = beam_search(m, src, src_lengths, zero, n_best=4, return_attention=True)
    for x, y in zip(a, z, strict=True):
        assert [(h.tokens, h.score, h.log_prob) for h in x] == [
            (h.tokens, h.score, h.log_prob) for h in y
        ]
        assert all(torch.equal(h.alphas, g.alphas) for h, g in zip(x, y, strict=True))
    ga = greedy_search(m, src, src_lengths, default, return_attention=True)
    gz = greedy_search(m, src, src_lengths, zero, return_attention=True)
    for h, g in zip(ga, gz, strict=True):
        assert (h.tokens, h.score, h.log_prob) == (g.tokens, g.score, g.log_prob)
        assert torch.equal(h.alphas, g.alphas)


def test_a_large_beta_reorders_the_n_best() -> None:
    """With beta > 0 the n-best follows log P / lp + cp, an order that differs from log P / lp."""
    m = model(VOCAB, seed=13, sharpen=2.0)
    lengths = [6, 5, 7, 4]
    src, src_lengths = source(lengths, VOCAB, seed=22)
    alpha, beta = 0.5, 3.0
    cfg = options(beam_size=6, alpha=alpha, ratio=0.5, offset=1, coverage=beta)
    plain_cfg = options(beam_size=6, alpha=alpha, ratio=0.5, offset=1)
    results = beam_search(m, src, src_lengths, cfg, n_best=6, return_attention=True)
    plain = beam_search(m, src, src_lengths, plain_cfg, n_best=6)
    reordered = best_changed = 0
    for b, (hyps, n) in enumerate(zip(results, lengths, strict=True)):
        penalised, unpenalised = {}, {}
        for h in hyps:
            penalty = _check_hypothesis(m, src[b : b + 1, :n], h, alpha, beta)
            unpenalised[tuple(h.tokens)] = h.log_prob / lp(len(h.tokens) + 1, alpha)
            penalised[tuple(h.tokens)] = unpenalised[tuple(h.tokens)] + penalty
        order = [tuple(h.tokens) for h in hyps]
        assert order == sorted(penalised, key=penalised.__getitem__, reverse=True)
        unpenalised = sorted(unpenalised, key=unpenalised.__getitem__, reverse=True)
        reordered += order != unpenalised
        best_changed += hyps[0].tokens != plain[b][0].tokens
    assert reordered > 0 and best_changed > 0  # the penalty acted on the ranking
