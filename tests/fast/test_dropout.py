"""nmt.dropout: the 16-bit mask keeps each element with probability 1 - p (p rounded to 2^-16),
scales kept elements by the inverse keep probability, routes the gradient through the same
mask, follows torch's seeded generator, and is the identity in eval mode."""

from __future__ import annotations

import math

import pytest
import torch

from nmt.fast import FastPaths
from nmt.fast.dropout import LEVELS, FastDropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_keep_rate_matches_p(p) -> None:
    torch.manual_seed(0)
    n = 1 << 20
    mask, scale = keep_mask(torch.Size([n]), p, torch.device("cpu"))
    rounded = round(p * LEVELS) / LEVELS
    assert abs(rounded - p) <= 0.5 / LEVELS
    assert scale == pytest.approx(1 / (1 - rounded), rel=1e-12)
    kept = mask.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma, (kept, 1 - p)


def test_mask_bits_are_independent_of_position() -> None:
    """Each int64 draw feeds four elements: neighbours must not be correlated, and every one
    of the four lanes must keep at the same rate."""
    torch.manual_seed(1)
    n = 1 << 20
    mask, _ = keep_mask(torch.Size([n]), 0.5, torch.device("cpu"))
    lanes = mask.view(-1, 4).double()
    for lane in range(4):
        assert abs(lanes[:, lane].mean().item() - 0.5) < 5 * math.sqrt(0.25 / (n / 4))
    both = (lanes[:, 0] * lanes[:, 1]).mean().item()  # P(keep, keep) = 0.25 if independent
    assert abs(both - 0.25) < 5 * math.sqrt(0.25 * 0.75 / (n / 4))


def test_forward_and_backward_use_one_mask() -> None:
    torch.manual_seed(2)
    x = (torch.rand(64, 33) + 0.5).double().requires_grad_()  # no element is zero
    out = dropout(x, 0.3, training=True)
    kept = out != 0
    assert 0 < kept.sum() < x.numel()
    scale = LEVELS / (LEVELS - round(0.3 * LEVELS))
    torch.testing.assert_close(out[kept], x[kept] * scale, rtol=0, atol=0)
    grad = torch.randn_like(x)
    (x_grad,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(x_grad, grad * kept * scale, rtol=0, atol=0)


def test_expectation_is_kept() -> None:
    torch.manual_seed(3)
    x = torch.ones(1 << 20)
    assert dropout(x, 0.4, training=True).mean().item() == pytest.approx(1.0, abs=5e-3)


def test_eval_and_zero_p_are_identity() -> None:
    x = torch.randn(4, 5)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    module = FastDropout(0.5).eval()
    assert module(x) is x


def test_seeded_and_resumable() -> None:
    x = torch.randn(8, 100)
    torch.manual_seed(4)
    first = dropout(x, 0.5, training=True)
    state = torch.get_rng_state()
    second = dropout(x, 0.5, training=True)
    torch.set_rng_state(state)
    torch.testing.assert_close(dropout(x, 0.5, training=True), second, rtol=0, atol=0)
    torch.manual_seed(4)
    torch.testing.assert_close(dropout(x, 0.5, training=True), first, rtol=0, atol=0)


def test_the_seam_picks_the_mask_with_cpu_kernels_and_torch_dropout_without() -> None:
    x = torch.randn(8, 100)
    fast, plain = FastPaths().dropout(0.5).train(), FastPaths(cpu_kernels=False).dropout(0.5)
    assert isinstance(fast, FastDropout) and isinstance(plain, torch.nn.Dropout)
    torch.manual_seed(5)
    ours = plain.train()(x)
    torch.manual_seed(5)
    theirs = torch.nn.functional.dropout(x, 0.5, training=True)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.manual_seed(5)
    ours = fast(x)
    torch.manual_seed(5)
    torch.testing.assert_close(ours, dropout(x, 0.5, training=True), rtol=0, atol=0)


def test_p_one_drops_everything() -> None:
    assert (dropout(torch.randn(3, 4), 1.0, training=True) == 0).all()


def test_rejects_bad_p() -> None:
    with pytest.raises(ValueError, match="dropout probability"):
        FastDropout(1.5)
