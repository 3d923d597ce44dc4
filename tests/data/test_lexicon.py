"""The lexicon behind the shortlist: IBM Model 1 against its EM equations written as loops in
float64, the ranking of each source piece's translations, the frequent pieces, the sample of
a large corpus, and a dictionary learnt from a synthetic parallel corpus."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from nmt.data import lexicon
from nmt.data.lexicon import build_lexicon, lexicon_sample, model1


def _corpus(pairs: int, src_vocab: int, trg_vocab: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    src = [[rng.randrange(src_vocab) for _ in range(rng.randint(1, 6))] for _ in range(pairs)]
    trg = [[rng.randrange(trg_vocab) for _ in range(rng.randint(1, 6))] for _ in range(pairs)]
    return src, trg


def _model1_reference(src: list, trg: list, null: int, iterations: int) -> dict:
    """t(t | s) by the E and M steps as written (lexicon's docstring), in dicts."""
    pairs = {(s, t) for x, y in zip(src, trg, strict=True) for s in [*x, null] for t in y}
    prob = dict.fromkeys(pairs, 1.0)
    for _ in range(iterations):
        count: dict = defaultdict(float)
        for x, y in zip(src, trg, strict=True):
            source = [*x, null]
            for t in y:
                norm = sum(prob[(s, t)] for s in source)
                for s in source:
                    count[(s, t)] += prob[(s, t)] / norm
        total: dict = defaultdict(float)
        for (s, _), c in count.items():
            total[s] += c
        prob = {(s, t): c / total[s] for (s, t), c in count.items()}
    return prob


@pytest.mark.parametrize(("dense", "sliced"), [(True, False), (False, False), (True, True)])
def test_model1_follows_its_em_equations(
    monkeypatch: pytest.MonkeyPatch, dense: bool, sliced: bool
) -> None:
    """Every t(t | s) after three iterations equals the reference's, keys through a table
    or by sorting, the E-step in one piece or in slices of a few sentences."""
    if not dense:
        monkeypatch.setattr(lexicon, "DENSE_KEYS", 0)
    if sliced:
        monkeypatch.setattr(lexicon, "SLICE_POSITIONS", 7)
    src, trg = _corpus(40, 7, 9, seed=3)
    keys, probs = model1(src, trg, 7, 9, iterations=3)
    reference = _model1_reference(src, trg, null=7, iterations=3)
    assert list(keys) == sorted(s * 9 + t for s, t in reference)
    for key, p in zip(keys.tolist(), probs.tolist(), strict=True):
        assert p == pytest.approx(reference[divmod(key, 9)], rel=1e-12)
    sums = defaultdict(float)
    for key, p in zip(keys.tolist(), probs.tolist(), strict=True):
        sums[key // 9] += p
    assert all(total == pytest.approx(1.0, abs=1e-12) for total in sums.values())


def test_table_ranks_translations_and_frequent_pieces() -> None:
    """Each source row holds its most probable targets (ties: lower id first), -1 after the
    last; NULL has no row; the frequent pieces go by count, ties by id."""
    src, trg = _corpus(60, 6, 10, seed=5)
    built = build_lexicon(src, trg, 6, 10, per_word=4, frequent=5, iterations=2)
    reference = _model1_reference(src, trg, null=6, iterations=2)
    assert built.table.shape == (6, 4)
    for s in range(6):
        ranked = sorted(
            (t for (a, t) in reference if a == s), key=lambda t: (-reference[(s, t)], t)
        )
        want = ranked[:4] + [-1] * (4 - len(ranked[:4]))
        # equal probabilities may differ in the last bits between the two sums: compare the
        # probabilities of the ranks, and the ids where they are apart
        got = built.table[s].tolist()
        assert [reference.get((s, t), -1) for t in got] == pytest.approx(
            [reference.get((s, t), -1) for t in want], rel=1e-9
        )
    counts = np.bincount(np.concatenate([np.asarray(y) for y in trg]), minlength=10)
    order = sorted(range(10), key=lambda t: (-counts[t], t))
    assert built.frequent.tolist() == [t for t in order if counts[t] > 0][:5]


def test_a_dictionary_is_learnt_from_parallel_sentences() -> None:
    """Sentences of random words and their word-for-word translations in shuffled order,
    with frequent filler words on the target side: each source word's best translation is
    its dictionary entry."""
    rng = random.Random(11)
    words, fillers = 30, 3
    dictionary = list(range(fillers, fillers + words))
    rng.shuffle(dictionary)
    src, trg = [], []
    for _ in range(400):
        x = [rng.randrange(words) for _ in range(rng.randint(2, 7))]
        y = [dictionary[w] for w in x] + [rng.randrange(fillers) for _ in range(2)]
        rng.shuffle(y)
        src.append(x)
        trg.append(y)
    built = build_lexicon(src, trg, words, fillers + words, per_word=3, frequent=3)
    assert built.table[:, 0].tolist() == dictionary
    assert sorted(built.frequent.tolist()) == list(range(fillers))


def test_a_large_corpus_is_sampled_by_its_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under MAX_EVENTS every pair; over it a seeded sample within the limit, the same for a
    seed and sorted."""
    src_lengths = np.array([3, 5, 2, 8, 4, 6, 1, 7])
    trg_lengths = np.array([4, 2, 6, 3, 5, 2, 7, 1])
    sizes = (src_lengths + 1) * trg_lengths
    assert lexicon_sample(src_lengths, trg_lengths, 0).tolist() == list(range(8))
    monkeypatch.setattr(lexicon, "MAX_EVENTS", int(sizes.sum()) // 2)
    first = lexicon_sample(src_lengths, trg_lengths, 0)
    assert first.tolist() == sorted(first.tolist())
    assert 0 < sizes[first].sum() <= lexicon.MAX_EVENTS
    assert lexicon_sample(src_lengths, trg_lengths, 0).tolist() == first.tolist()
    others = {tuple(lexicon_sample(src_lengths, trg_lengths, seed).tolist()) for seed in range(8)}
    assert len(others) > 1
