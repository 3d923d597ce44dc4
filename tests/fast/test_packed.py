"""nmt.fast.packed.Product, search's products by fixed weights on a CPU: the prepared
(oneDNN) and the plain product against features W^T (+ b) in float64, for one row (the plain
product), a few and more than the layout was prepared for; a shortlist's columns; the
seam's choice; and StepProducts."""

from __future__ import annotations

import pytest
import torch

from nmt.fast import FastPaths, packed
from nmt.fast.packed import Product, StepProducts

needs_onednn = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN")


def _weight(vocab: int = 3001, width: int = 96, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, width, generator=generator) / width**0.5


@pytest.mark.parametrize("prepared", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 301])
def test_the_product_equals_features_times_w_transposed(prepared: bool, rows: int) -> None:
    weight = _weight()
    product = Product(weight, prepared)
    features = torch.randn(rows, weight.size(1), generator=torch.Generator().manual_seed(rows))
    want = features.double() @ weight.double().t()  # (N, V)
    for _ in range(2):  # the layout made on the first call, then reused
        got = product(features)
        assert got.shape == (rows, weight.size(0)) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # not a view of the features' storage or the weight's: a later product leaves it
    again = product(features * 2)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(again.double(), 2 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prepared", [False, pytest.param(True, marks=needs_onednn)])
def test_a_shortlist_multiplies_its_own_rows_of_w(prepared: bool) -> None:
    weight = _weight()
    columns = torch.tensor([0, 1, 2, 3, 17, 400, 401, 2999, 3000])
    product = Product(weight, prepared)
    product(torch.randn(8, weight.size(1)))  # the whole product's layout made first
    restricted = product.columns(columns)
    features = torch.randn(40, weight.size(1), generator=torch.Generator().manual_seed(3))
    want = features.double() @ weight.double()[columns].t()
    got = restricted(features)
    assert got.shape == (40, len(columns))
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert restricted.prepared is prepared


def test_the_seam_prepares_only_where_asked_and_oned_nn_is_there() -> None:
    weight = _weight(50, 8)
    assert FastPaths().product(weight).prepared is packed.available()
    assert FastPaths.plain().product(weight).prepared is False


@needs_onednn
def test_noncontiguous_features_multiply_as_contiguous_ones() -> None:
    weight = _weight(500, 64)
    product = Product(weight, prepared=True)
    wide = torch.randn(20, 128, generator=torch.Generator().manual_seed(5))
    features = wide[:, ::2]  # (20, 64), strided
    want = features.double() @ weight.double().t()
    assert torch.allclose(product(features).double(), want, rtol=1e-5, atol=1e-5)


def test_a_float64_weight_is_multiplied_plainly() -> None:
    weight = _weight(300, 16).double()
    product = Product(weight, prepared=True)
    assert product.prepared is False
    features = torch.randn(7, 16, dtype=torch.float64)
    assert torch.allclose(product(features), features @ weight.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prepared", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("rows", [1, 3, 50])
def test_a_product_with_a_bias_adds_it(prepared: bool, rows: int) -> None:
    """x W^T + b (a decoder's W_hh with b_hh), also for (B, 1, I) inputs (a step's shape),
    and a shortlist of its outputs takes their biases."""
    weight = _weight(768, 256, seed=2)
    bias = torch.randn(768, generator=torch.Generator().manual_seed(4))
    product = Product(weight, prepared, bias)
    x = torch.randn(rows, 1, 256, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ weight.double().t() + bias.double()  # (N, 1, O)
    got = product(x)
    assert got.shape == (rows, 1, 768)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    index = torch.tensor([5, 0, 767])
    assert torch.allclose(
        product.columns(index)(x[:, 0]).double(), want[:, 0, index], rtol=1e-5, atol=1e-5
    )


def test_step_products_list_every_product() -> None:
    first, second, combine = (Product(_weight(6, 4, seed=s), False) for s in range(3))
    assert StepProducts([first, second]).all() == [first, second]
    assert StepProducts([first], combine=combine).all() == [first, combine]
