"""A decoder's search products (``Decoder.search_products``, ``fast.packed.StepProducts``):
a search step that multiplies through them (W_hh with b_hh per RNN layer, Luong's W_c and its
W_ch half over a folded memory) equals the step through the modules' own weights, in float64
(the plain products) and in float32 (oneDNN's prepared layouts where torch has them), for
both decoders, GRU and LSTM, one and two layers, with padding in the source."""

from __future__ import annotations

import pytest
import torch

from nmt.config import from_dict
from nmt.data.batching import pad
from nmt.model import Seq2Seq, build_model
from nmt.model.decoder import Prepared

VOCAB = 23


def _model(style: str, rnn: str, layers: int, feeding: bool, dtype: torch.dtype) -> Seq2Seq:
    raw = {
        "embedding_size": 6,
        "encoder": {"rnn": rnn, "hidden_size": 5},
        "decoder": {
            "style": style,
            "rnn": rnn,
            "hidden_size": 10,
            "layers": layers,
            "input_feeding": feeding,
        },
        "attention": {"score": "general"},
    }
    torch.manual_seed(layers * 7 + feeding + len(style + rnn))
    model = build_model(from_dict({"model": raw}).model, VOCAB, VOCAB).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    return model


CASES = [
    ("luong", "gru", 1, False),
    ("luong", "gru", 2, True),
    ("luong", "lstm", 1, False),
    ("bahdanau", "gru", 1, True),
    ("bahdanau", "lstm", 2, True),
]


@pytest.mark.parametrize(("style", "rnn", "layers", "feeding"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("greedy", [False, True], ids=["as-is", "folded-greedy"])
def test_the_step_through_the_products_is_the_step(
    style: str, rnn: str, layers: int, feeding: bool, dtype: torch.dtype, greedy: bool
) -> None:
    model = _model(style, rnn, layers, feeding, dtype)
    products = model.decoder.search_products()
    assert products is not None and len(products.hidden) == layers
    assert (products.combine is not None) is (style == "luong")
    table = model.decoder.gate_table()
    assert table is not None
    rows = [[5, 9, 4, 11, 6, 7], [7, 8], [12, 4, 13], [20, 21, 22, 4]]
    src, lengths = pad(rows), torch.tensor([len(r) for r in rows])
    generator = torch.Generator().manual_seed(3)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    with torch.no_grad():
        memory, state = model.encode(src, lengths)
        memory = model.decoder.for_search(memory, greedy=greedy)
        states = {"modules": state, "products": state}
        for _ in range(4):
            prev = torch.randint(4, VOCAB, (len(rows),), generator=generator)
            gates = table.index_select(0, prev)
            out = {}
            for kind in ("modules", "products"):
                given = products if kind == "products" else None
                features, alphas, states[kind] = model.decoder.step(
                    prev, memory, states[kind], Prepared(gates, given)
                )
                out[kind] = (features, alphas, states[kind].hidden)
            for got, want in zip(out["products"], out["modules"], strict=True):
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
