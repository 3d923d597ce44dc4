"""Search's dot-product attention in one compiled kernel (nmt.fast.attend, kernels.c's
``nmt_attend_f32``): against its equation in float64 on random inputs with padding (garbage
behind it), shared memories of several rows per sentence and a scale; what it declines; and
the dot scores' forward through it against their plain products, taken only without
gradients."""

from __future__ import annotations

import pytest
import torch

from nmt.fast import FastPaths, sinks
from nmt.fast import compiled as native
from nmt.fast.attend import KERNEL_PRODUCTS
from nmt.model.attention import Memory
from nmt.model.scores import DotAttention, GeneralAttention, ScaledDotAttention

needs_kernels = pytest.mark.skipif(
    native.library() is None, reason=f"no compiled kernels: {native.status()}"
)


def _memory(
    sentences: int, length: int, width: int, features: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys (B, S, A), values (B, S, F) and mask (B, S): each sentence its own length, one
    of a single position and one of all; large values behind the padding (never read)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(sentences, length, width, generator=generator)
    values = torch.randn(sentences, length, features, generator=generator)
    lengths = torch.randint(1, length + 1, (sentences,), generator=generator)
    lengths[0], lengths[-1] = length, 1
    mask = torch.arange(length)[None, :] < lengths[:, None]
    keys[~mask] = 1e4
    values[~mask] = -1e4
    return keys, values, mask


def _reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, g: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The equation, float64, row by row: e_s = g q^T k_s over the real s of the row's
    sentence, a = softmax(e), context = sum_s a_s v_s."""
    rows = query.size(0) // keys.size(0)
    contexts, alphas = [], []
    for n in range(query.size(0)):
        b = n // rows
        real = mask[b].nonzero().flatten()
        e = g * (keys[b, real].double() @ query[n].double())
        a = torch.softmax(e, dim=0)
        full = torch.zeros(keys.size(1), dtype=torch.float64)
        full[real] = a
        alphas.append(full)
        contexts.append(a @ values[b, real].double())
    return torch.stack(contexts), torch.stack(alphas)


@needs_kernels
@pytest.mark.parametrize(
    ("sentences", "rows", "length", "width", "features"),
    [(1, 1, 1, 1, 1), (5, 1, 9, 16, 16), (3, 4, 13, 37, 21), (7, 5, 40, 256, 512)],
)
@pytest.mark.parametrize("g", [1.0, 0.37])
def test_the_attention_kernel_matches_float64(
    sentences: int, rows: int, length: int, width: int, features: int, g: float
) -> None:
    keys, values, mask = _memory(sentences, length, width, features, seed=length)
    query = torch.randn(sentences * rows, width, generator=torch.Generator().manual_seed(5))
    query = query / width**0.5
    found = native.attend(query, keys, values, mask, g)
    assert found is not None
    context, alphas = found
    want_context, want_alphas = _reference(query, keys, values, mask, g)
    assert context.shape == (sentences * rows, features)
    assert alphas.shape == (sentences * rows, length)
    assert torch.equal(alphas == 0, want_alphas == 0)  # exactly 0 at the padding alone
    torch.testing.assert_close(alphas.double(), want_alphas, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(context.double(), want_context, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_attention_kernel_declines_what_it_cannot_take() -> None:
    keys, values, mask = _memory(2, 5, 4, 3, seed=1)
    query = torch.randn(2, 4)
    assert native.attend(query, keys, values, mask, 1.0) is not None
    assert native.attend(query.double(), keys, values, mask, 1.0) is None
    assert native.attend(query, keys.bfloat16(), values, mask, 1.0) is None
    strided = values.transpose(0, 1).contiguous().transpose(0, 1)
    assert native.attend(query, keys, strided, mask, 1.0) is None
    assert native.attend(query, keys, values, mask.int(), 1.0) is None
    assert native.attend(torch.randn(3, 4), keys, values, mask, 1.0) is None  # 3 rows, 2 sentences
    assert native.attend(torch.randn(2, 5), keys, values, mask, 1.0) is None  # width


def _scores() -> list[DotAttention]:
    torch.manual_seed(3)
    learned = GeneralAttention(6, 10, scale="learned")
    with torch.no_grad():
        learned.scale.fill_(0.6)  # type: ignore[union-attr]
    return [DotAttention(6, 6), ScaledDotAttention(6, 6), GeneralAttention(6, 10), learned]


@needs_kernels
@pytest.mark.parametrize("score", range(4))
@pytest.mark.parametrize("beams", [1, 3])
def test_dot_scores_attend_through_the_kernel_as_through_their_products(
    score: int, beams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's memory (``FastPaths.search_products``), held once for its beams or not:
    the kernel gives the plain products' context and alphas to float32's round-off; with
    gradients wanted it is not called, and autograd follows the plain products."""
    attention = _scores()[score]
    calls = []
    kernel = native.attend

    def counted(*args: object) -> object:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "attend", counted)
    values, _, mask = _memory(4, 7, attention.key_size, 1, seed=2)
    values = values.masked_fill(~mask[..., None], 0.0)
    plain = attention.prepare(values, mask)
    if beams > 1:
        plain = plain.shared(beams)
    searched = plain.for_steps(FastPaths().search_products())
    assert searched.products is KERNEL_PRODUCTS
    query = torch.randn(4 * beams, 1, attention.query_size)
    with torch.no_grad():
        want = attention(query, plain)
        got = attention(query, searched)
    assert len(calls) == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls.clear()
    context, _ = attention(query.requires_grad_(), searched)
    assert not calls and context.requires_grad
    assert FastPaths(native_kernels=False).search_products() is sinks.PLAIN_PRODUCTS


def test_a_memory_keeps_its_products_when_search_drops_rows() -> None:
    values, _, mask = _memory(3, 4, 5, 1, seed=4)
    memory = Memory(values, values, mask, products=KERNEL_PRODUCTS)
    assert memory.index_select(torch.tensor([0, 2])).products is KERNEL_PRODUCTS


def test_off_a_cpu_the_kernel_products_decline_before_reading_the_scale() -> None:
    """On another device (meta here) the plain products run, and the learned scale is not
    read on the host (on a GPU a wait; inside a CUDA graph's capture an error)."""
    meta = torch.device("meta")
    keys = torch.empty(2, 5, 4, device=meta)
    mask = torch.ones(2, 5, dtype=torch.bool, device=meta)
    scale = torch.nn.Parameter(torch.ones((), device=meta), requires_grad=False)
    query = torch.empty(2, 1, 4, device=meta)
    assert KERNEL_PRODUCTS.attend(query, keys, keys, mask, scale) is None
