"""Search drops the rows of ended sentences from its batch (``kept_rows``): the outputs,
scores and attention are those of the search that keeps every row, with every option."""

from __future__ import annotations

import pytest
import torch
from searchref import model as _model
from searchref import source as _source

from nmt.config import DecodingConfig
from nmt.decoding import search
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.search import Hypothesis, beam_search, kept_rows
from nmt.decoding.steering import Steering

VOCAB = 12
LENGTHS = [7, 2, 5, 3, 6, 1, 4, 8, 2, 5, 3, 7]


def test_kept_rows_waits_for_an_eighth_and_keeps_the_floor() -> None:
    assert kept_rows([False] * 16) is None
    assert kept_rows([True] + [False] * 15) is None  # 1 of 16: not worth a copy yet
    assert kept_rows([True] * 16) is None  # 16 rows: the floor
    assert kept_rows([True] * 8 + [False] * 56) == list(range(8, 64))
    assert kept_rows([True] * 3 + [False] * 5, width=5) == [3, 4, 5, 6, 7]  # 25 >= 16
    assert kept_rows([True] * 6 + [False] * 2, width=5) == [0, 1, 6, 7]  # ended fill: 20 rows
    assert kept_rows([True, False, True, False], width=5) is None  # 20 rows: 4 sentences
    assert kept_rows([True] * 40 + [False] * 24) == list(range(40, 64))
    assert kept_rows([True] * 56 + [False] * 8) == [*range(8), *range(56, 64)]  # 8 filling


def _search(
    monkeypatch: pytest.MonkeyPatch, drop: bool, models, src, lengths, decoding, **kwargs
) -> list[list[Hypothesis]]:
    drops = []
    if drop:
        monkeypatch.setattr(search, "MIN_ROWS", 1)
        select = Ensemble.select

        def counted(self, state, index):
            drops.append(index.numel())
            return select(self, state, index)

        monkeypatch.setattr(Ensemble, "select", counted)
    else:
        monkeypatch.setattr(search, "kept_rows", lambda ended, width=1: None)
    scorer = Ensemble(models) if len(models) > 1 else models[0]
    out = beam_search(scorer, src, lengths, decoding, **kwargs)
    assert len(drops) >= 2 if drop else not drops  # the batch did shrink, more than once
    return out


def _same(a: list[list[Hypothesis]], b: list[list[Hypothesis]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert [h.tokens for h in x] == [h.tokens for h in y]
        assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-9)
        assert [h.log_prob for h in x] == pytest.approx([h.log_prob for h in y], abs=1e-9)
        for h, g in zip(x, y, strict=True):
            if h.alphas is None or g.alphas is None:
                assert h.alphas is None and g.alphas is None
            else:
                torch.testing.assert_close(h.alphas, g.alphas, atol=1e-9, rtol=0)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"length_penalty": 0.6, "coverage_penalty": 0.4},
        {"no_repeat_ngram": 2},
        {"max_len_ratio": 0.5, "max_len_offset": 1},
    ],
    ids=["plain", "penalties", "ngrams", "short"],
)
def test_dropping_ended_sentences_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, beam: int, options: dict
) -> None:
    models = [_model(VOCAB, seed=11, style="luong", feeding=False, eos=0.3).double()]
    src, lengths = _source(LENGTHS, VOCAB, seed=12)
    decoding = DecodingConfig(beam_size=beam, **options)
    kwargs = {"n_best": 1 if beam == 1 else 3, "return_attention": True}
    with monkeypatch.context() as patch:
        kept = _search(patch, False, models, src, lengths, decoding, **kwargs)
    with monkeypatch.context() as patch:
        dropped = _search(patch, True, models, src, lengths, decoding, **kwargs)
    _same(dropped, kept)


def test_dropping_with_steering_and_an_ensemble(monkeypatch: pytest.MonkeyPatch) -> None:
    models = [
        _model(VOCAB, seed=13, style="bahdanau", eos=0.3).double(),
        _model(VOCAB, seed=14, style="luong", eos=0.3).double(),
    ]
    src, lengths = _source(LENGTHS, VOCAB, seed=15)
    prefixes = [[5, 6] if b % 3 == 0 else [] for b in range(len(LENGTHS))]
    constraints = [[[7]] if b % 4 == 1 else [] for b in range(len(LENGTHS))]
    steering = Steering(prefixes, constraints)
    decoding = DecodingConfig(beam_size=4)
    kwargs = {"n_best": 2, "return_attention": True, "steering": steering}
    with monkeypatch.context() as patch:
        kept = _search(patch, False, models, src, lengths, decoding, **kwargs)
    with monkeypatch.context() as patch:
        dropped = _search(patch, True, models, src, lengths, decoding, **kwargs)
    _same(dropped, kept)
    greedy = DecodingConfig(beam_size=1)
    plain = Steering(prefixes)
    with monkeypatch.context() as patch:
        kept = _search(patch, False, models, src, lengths, greedy, steering=plain)
    with monkeypatch.context() as patch:
        dropped = _search(patch, True, models, src, lengths, greedy, steering=plain)
    _same(dropped, kept)
