"""The CPU's chunked top-k and row maximum against torch.topk and Tensor.max."""

from __future__ import annotations

import pytest
import torch

from nmt.fast.topk import CHUNK, MIN_ROWS, row_max, top_k


@pytest.mark.parametrize("width", [CHUNK * 12, CHUNK * 12 + 5, CHUNK * 3, 40, 9])
@pytest.mark.parametrize("k", [1, 2, 10])
def test_top_k_and_row_max_match_torch(width: int, k: int) -> None:
    generator = torch.Generator().manual_seed(width * 10 + k)
    values = torch.randn(MIN_ROWS + 7, width, generator=generator, dtype=torch.float64)
    values[3] = -torch.inf  # a row forced to one token, as at the length limit
    values[3, 3] = -1.0
    values[5] = 0.5  # a row of ties: any k of its places will do
    values[7, -1] = 9.0  # the maximum in the tail beyond the last whole chunk
    if k > width:
        return
    got, want = top_k(values, k), values.topk(k, dim=-1)
    assert torch.equal(got[0], want[0])  # the values, bit for bit, best first
    assert torch.equal(values.gather(1, got[1]), got[0])  # the indices point at them
    untied = [r for r in range(values.size(0)) if r != 5]
    assert torch.equal(got[1][untied], want[1][untied])
    best, where = row_max(values)
    expected = values.max(dim=-1)
    assert torch.equal(best, expected.values) and torch.equal(where, expected.indices)


def test_row_max_takes_the_first_of_equal_maxima() -> None:
    values = torch.zeros(MIN_ROWS, CHUNK * 4)
    values[0, [CHUNK + 3, 2 * CHUNK + 1, 5]] = 1.0
    values[1, [3 * CHUNK + 2, 3 * CHUNK + 7]] = 2.0
    assert row_max(values)[1][:3].tolist() == [5, 3 * CHUNK + 2, 0]
