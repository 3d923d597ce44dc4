"""Ensembles against references: a model with itself, one member, the combination rules in
float64, exhaustive search under a Bahdanau + Luong mixture, forced decoding step by step and
the averaged attention."""

from __future__ import annotations

import math

import pytest
import torch
from searchref import (
    contains,
    enumerate_outputs,
    forced,
    lp,
    mix,
    model,
    options,
    sequence_log_probs,
    source,
)

from nmt.data.tokenizer import BOS_ID, EOS_ID
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.search import beam_search, greedy_search
from nmt.decoding.steering import Steering

VOCAB = 9
AVERAGES = ["linear", "log_linear"]


def _pair() -> tuple:
    """A Bahdanau and a Luong model over the same vocabularies."""
    return model(VOCAB, seed=21, style="bahdanau"), model(VOCAB, seed=22, style="luong")


@pytest.mark.parametrize("average", AVERAGES)
def test_model_with_itself_decodes_as_the_model(average: str) -> None:
    """Ensemble([m, m]) gives m's outputs and scores in greedy and n-best beam search."""
    m = model(VOCAB, seed=3)
    src, src_lengths = source([6, 2, 4, 3], VOCAB, seed=4)
    twice = Ensemble([m, m], average)
    cfg = options(beam_size=4, alpha=0.6, ratio=1.5, offset=3, average=average)
    alone = beam_search(m, src, src_lengths, cfg, n_best=4, return_attention=True)
    doubled = beam_search(twice, src, src_lengths, cfg, n_best=4, return_attention=True)
    for a, d in zip(alone, doubled, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in d]
        for x, y in zip(a, d, strict=True):
            assert y.score == pytest.approx(x.score, abs=1e-5)
            assert y.log_prob == pytest.approx(x.log_prob, abs=1e-5)
            torch.testing.assert_close(y.alphas, x.alphas, atol=1e-6, rtol=0)
    greedy_cfg = options(beam_size=1, alpha=0.6, ratio=1.5, offset=3, average=average)
    g_alone = greedy_search(m, src, src_lengths, greedy_cfg)
    g_doubled = greedy_search(twice, src, src_lengths, greedy_cfg)
    assert [h.tokens for h in g_alone] == [h.tokens for h in g_doubled]
    for x, y in zip(g_alone, g_doubled, strict=True):
        assert y.score == pytest.approx(x.score, abs=1e-5)


def test_single_member_is_the_member_bit_for_bit() -> None:
    """Ensemble([m]) and m give exactly the same hypotheses, scores and attention."""
    m = model(VOCAB, seed=5, style="luong")
    src, src_lengths = source([5, 3, 1], VOCAB, seed=6)
    cfg = options(beam_size=3, alpha=1.0, coverage=0.4)
    for average in AVERAGES:
        one = Ensemble([m], average)
        plain = beam_search(m, src, src_lengths, cfg, n_best=3, return_attention=True)
        wrapped = beam_search(one, src, src_lengths, cfg, n_best=3, return_attention=True)
        for a, w in zip(plain, wrapped, strict=True):
            assert [(h.tokens, h.score, h.log_prob) for h in a] == [
                (h.tokens, h.score, h.log_prob) for h in w
            ]
            for x, y in zip(a, w, strict=True):
                assert torch.equal(x.alphas, y.alphas)
        g_plain = greedy_search(m, src, src_lengths, cfg, return_attention=True)
        g_wrapped = greedy_search(one, src, src_lengths, cfg, return_attention=True)
        for x, y in zip(g_plain, g_wrapped, strict=True):
            assert (x.tokens, x.score, x.log_prob) == (y.tokens, y.score, y.log_prob)
            assert torch.equal(x.alphas, y.alphas)


@pytest.mark.parametrize("average", AVERAGES)
@pytest.mark.parametrize("members", [2, 3])
def test_combine_matches_the_definitions_in_float64(average: str, members: int) -> None:
    """combine: linear = log mean_m exp(lp_m), log_linear = log_softmax(mean_m lp_m); normalised."""
    generator = torch.Generator().manual_seed(members)
    logits = [torch.randn(3, 4, 11, generator=generator) * 3 for _ in range(members)]
    log_probs = [torch.log_softmax(x, dim=-1) for x in logits]
    stacked = torch.stack([x.double() for x in log_probs])
    if average == "linear":
        expected = torch.log(torch.exp(stacked).sum(dim=0) / members)
    else:
        mean = stacked.sum(dim=0) / members
        expected = mean - torch.logsumexp(mean, dim=-1, keepdim=True)
    got = Ensemble([None] * members, average).combine(log_probs)  # combine reads no model
    assert got.dtype == torch.float32 and got.shape == (3, 4, 11)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.logsumexp(got.double(), dim=-1),
        torch.zeros(3, 4, dtype=torch.float64),
        atol=1e-5,
        rtol=0,
    )


def test_linear_keeps_a_token_one_member_rules_out_and_log_linear_does_not() -> None:
    """A token at -inf in one member keeps the other's mass / M (linear), stays -inf (log_linear)."""
    a = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.5, -1.0]]), dim=-1)
    b = torch.log_softmax(torch.tensor([[0.0, -math.inf, 1.0, 2.0]]), dim=-1)
    linear = Ensemble([None, None], "linear").combine([a, b])
    assert float(linear[0, 1]) == pytest.approx(math.log(float(a[0, 1].exp()) / 2), abs=1e-6)
    log_linear = Ensemble([None, None], "log_linear").combine([a, b])
    assert float(log_linear[0, 1]) == -math.inf
    assert float(torch.logsumexp(log_linear[0], dim=0)) == pytest.approx(0.0, abs=1e-6)


def test_one_member_combine_is_the_identity() -> None:
    """combine of one member returns its tensor unchanged."""
    x = torch.log_softmax(torch.randn(2, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    for average in AVERAGES:
        assert Ensemble([None], average).combine([x]) is x


SMALL = 6  # PAD UNK BOS EOS + two words
RATIO = 1e-3  # ceil(S * ratio) = 1 for any S here, so the limit is 1 + offset


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("average", AVERAGES)
def test_exhaustive_ensemble_beam_is_the_float64_mixture(average: str, alpha: float) -> None:
    """With K = 150 no candidate is pruned, so a Bahdanau + Luong ensemble's finished list is
    every output up to the limit, each scored by the float64 mixture / lp, best first."""
    members = [model(SMALL, seed=31, style="bahdanau"), model(SMALL, seed=32, style="luong")]
    src, src_lengths = source([4, 2, 3], SMALL, seed=7)
    offset, limit = 3, 4
    candidates = enumerate_outputs(SMALL, limit - 1)  # 1 + 5 + 25 + 125 = 156
    cfg = options(beam_size=6 * 5 ** (limit - 2), alpha=alpha, ratio=RATIO, offset=offset)
    results = beam_search(Ensemble(members, average), src, src_lengths, cfg, n_best=len(candidates))
    for b, hyps in enumerate(results):
        one = src[b : b + 1, : int(src_lengths[b])]
        raw = sequence_log_probs(members, one, candidates, average)
        expected = {y: s / lp(len(y) + 1, alpha) for y, s in raw.items()}
        found = {tuple(h.tokens): h for h in hyps}
        assert len(found) == len(hyps) == len(candidates)
        assert found.keys() == expected.keys()
        for y, h in found.items():
            assert h.score == pytest.approx(expected[y], abs=1e-4)
            assert h.log_prob == pytest.approx(raw[y], abs=1e-4)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        best = max(expected, key=expected.get)
        assert tuple(hyps[0].tokens) == best
        # neither member alone gives these scores (a one-model ensemble would fail above)
        singles = [sequence_log_probs([m], one, candidates) for m in members]
        assert all(
            any(abs(s[y] - raw[y]) > 1e-3 for y in candidates) for s in singles
        )  # precondition: the mixture is neither member alone


def _greedy_mixture(members, src: torch.Tensor, max_len: int, average: str):
    """Argmax of the float64 mixture step by step for one sentence, EOS forced at the limit."""
    states = [m.encode(src, torch.tensor([src.size(1)])) for m in members]
    prev, tokens, total = torch.tensor([BOS_ID]), [], 0.0
    with torch.no_grad():
        for length in range(1, max_len + 1):
            step_lps = []
            for i, m in enumerate(members):
                memory, state = states[i]
                features, _, state = m.decoder.step(prev, memory, state)
                states[i] = (memory, state)
                step_lps.append(torch.log_softmax(m.generator(features[0]).double(), dim=-1))
            log_probs = mix(step_lps, average)
            token = EOS_ID if length == max_len else int(log_probs.argmax())
            total += float(log_probs[token])
            if token == EOS_ID:
                return tokens, total
            tokens.append(token)
            prev = torch.tensor([token])
    raise AssertionError("unreachable")


@pytest.mark.parametrize("average", AVERAGES)
def test_ensemble_greedy_is_the_argmax_of_the_float64_mixture(average: str) -> None:
    """Greedy over an ensemble picks, step by step, the argmax of the float64 mixture."""
    members = list(_pair())
    lengths = [5, 2, 4, 3]
    src, src_lengths = source(lengths, VOCAB, seed=8)
    cfg = options(beam_size=1, alpha=0.0, ratio=1.0, offset=3, average=average)
    got = greedy_search(Ensemble(members, average), src, src_lengths, cfg)
    for b, n in enumerate(lengths):
        tokens, total = _greedy_mixture(members, src[b : b + 1, :n], n + 3, average)
        assert got[b].tokens == tokens
        assert got[b].score == pytest.approx(total, abs=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 0.8])
@pytest.mark.parametrize("average", AVERAGES)
def test_ensemble_n_best_scores_are_the_float64_mixture(average: str, alpha: float) -> None:
    """Every n-best hypothesis of a two-model beam scores its float64 mixture log P / lp."""
    members = list(_pair())
    lengths = [6, 3, 4, 1]
    src, src_lengths = source(lengths, VOCAB, seed=9)
    cfg = options(beam_size=5, alpha=alpha, ratio=1.5, offset=3, average=average)
    results = beam_search(Ensemble(members, average), src, src_lengths, cfg, n_best=5)
    for b, (hyps, n) in enumerate(zip(results, lengths, strict=True)):
        assert 1 <= len(hyps) <= 5
        for h in hyps:
            log_prob, _ = forced(members, src[b : b + 1, :n], h.tokens, average)
            assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
            assert h.score == pytest.approx(log_prob / lp(len(h.tokens) + 1, alpha), abs=1e-4)


@pytest.mark.parametrize("average", AVERAGES)
def test_teacher_forced_equals_stepwise(average: str) -> None:
    """Ensemble.teacher_forced gives the log-probs and attention of Ensemble.step fed the target."""
    members = list(_pair())
    src, src_lengths = source([5, 2, 4], VOCAB, seed=10)
    generator = torch.Generator().manual_seed(11)
    trg_in = torch.randint(4, VOCAB, (3, 6), generator=generator)
    trg_in[:, 0] = BOS_ID
    ensemble = Ensemble(members, average)
    with torch.no_grad():
        forced_lp, forced_alphas, _ = ensemble.teacher_forced(src, src_lengths, trg_in)
        state = ensemble.encode(src, src_lengths)
        steps, step_alphas = [], []
        for t in range(trg_in.size(1)):
            log_probs, alphas, state = ensemble.step(trg_in[:, t], state)
            steps.append(log_probs)
            step_alphas.append(alphas)
    assert forced_lp.shape == (3, 6, VOCAB)
    torch.testing.assert_close(forced_lp, torch.stack(steps, dim=1), atol=1e-5, rtol=0)
    torch.testing.assert_close(forced_alphas, torch.stack(step_alphas, dim=1), atol=1e-6, rtol=0)
    # and from the definitions: the float64 mixture of the members' forced log-probabilities
    with torch.no_grad():
        members_lp = [
            torch.log_softmax(m.generator(m(src, src_lengths, trg_in)[0]).double(), dim=-1)
            for m in members
        ]
    torch.testing.assert_close(forced_lp.double(), mix(members_lp, average), atol=1e-5, rtol=0)


def test_ensemble_attention_is_the_members_mean() -> None:
    """Returned attention = mean of the members' forced attention; rows sum to 1, 0 on padding."""
    members = list(_pair())
    lengths = [6, 2, 4]
    src, src_lengths = source(lengths, VOCAB, seed=12)
    cfg = options(beam_size=3, alpha=1.0, ratio=1.5, offset=2)
    results = beam_search(Ensemble(members), src, src_lengths, cfg, n_best=3, return_attention=True)
    greedy = greedy_search(Ensemble(members), src, src_lengths, cfg, return_attention=True)
    checked = 0
    for b, n in enumerate(lengths):
        for h in [*results[b], greedy[b]]:
            assert h.alphas is not None and h.alphas.shape == (len(h.tokens) + 1, src.size(1))
            _, attention = forced(members, src[b : b + 1, :n], h.tokens)
            assert not torch.allclose(attention[0], attention[1], atol=1e-3)  # members differ
            expected = (attention[0] + attention[1]) / 2
            torch.testing.assert_close(h.alphas[:, :n].double(), expected, atol=1e-5, rtol=0)
            torch.testing.assert_close(
                h.alphas[:, :n].sum(dim=1).double(),
                torch.ones(len(h.tokens) + 1, dtype=torch.float64),
                atol=1e-5,
                rtol=0,
            )
            assert torch.all(h.alphas[:, n:] == 0)
            checked += n < src.size(1)
    assert checked > 0  # precondition: padding was present


def test_ensemble_with_coverage_prefix_and_constraints() -> None:
    """All at once: each output meets its prefix and phrases and scores the float64 mixture
    log P / lp plus beta * sum_i log(min(coverage_i, 1)) of the mean attention."""
    members = list(_pair())
    lengths = [5, 3, 4]
    src, src_lengths = source(lengths, VOCAB, seed=13)
    prefixes, constraints = [[4], [], [6, 7]], [[[8]], [[5, 6]], []]
    alpha, beta = 0.7, 0.4
    penalised = 0
    for average in AVERAGES:
        cfg = options(beam_size=4, alpha=alpha, ratio=0.7, offset=1, coverage=beta, average=average)
        results = beam_search(
            Ensemble(members, average),
            src,
            src_lengths,
            cfg,
            n_best=4,
            return_attention=True,
            steering=Steering(prefixes, constraints),
        )
        for b, n in enumerate(lengths):
            assert results[b]
            for h in results[b]:
                assert h.tokens[: len(prefixes[b])] == prefixes[b]
                assert all(contains(h.tokens, p) for p in constraints[b])
                log_prob, attention = forced(members, src[b : b + 1, :n], h.tokens, average)
                coverage = ((attention[0] + attention[1]) / 2).sum(dim=0)  # (n,)
                penalty = beta * sum(math.log(min(float(c), 1.0)) for c in coverage)
                expected = log_prob / lp(len(h.tokens) + 1, alpha) + penalty
                assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
                assert h.score == pytest.approx(expected, abs=1e-4)
                penalised += penalty < -1e-3
    assert penalised > 0  # precondition: the coverage penalty is not 0 everywhere
