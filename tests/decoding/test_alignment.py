"""Attention as word alignment: pieces mapped to whitespace words, word attention against a
float64 reference written from its definition, the extractions, and Och & Ney's scores."""

from __future__ import annotations

import random

import pytest
import sentencepiece as spm
import torch

from nmt.decoding.alignment import (
    ReferenceLinks,
    extract_links,
    parse_links,
    piece_words,
    score_alignments,
    word_attention,
)
from nmt.decoding.alignment import grow_diag_final_and as gdfa

WORDS = ["fuego", "sol", "agua", "mar", "tierra", "libro", "luna", "árbol", "“casa”,", "Dios."]


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> spm.SentencePieceProcessor:
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(300)]
    folder = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(folder / "m"),
        vocab_size=40,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(folder / "m.model"))


@pytest.mark.parametrize(
    "text", ["fuego sol", "  agua   mar ", "“casa”, Dios.", "árbol", "libro luna “casa”,"]
)
def test_pieces_map_onto_the_whitespace_words(processor, text: str) -> None:  # type: ignore[no-untyped-def]
    """One word index per piece, non-decreasing, covering every whitespace token; the pieces
    of each word spell it (whitespace-only pieces aside)."""
    words = piece_words(processor, text)
    pieces = processor.encode(text, out_type=str)
    assert len(words) == len(pieces)
    assert words == sorted(words) and set(words) == set(range(len(text.split())))
    for index, word in enumerate(text.split()):
        spelled = "".join(p for p, w in zip(pieces, words, strict=True) if w == index)
        assert spelled.replace("▁", "") == word


def _reference_word_attention(alphas, src_words, trg_words):  # type: ignore[no-untyped-def]
    """Straight from the definition: mean over a target word's pieces of the summed mass on
    a source word's pieces (EOS row and column left out)."""
    n_trg, n_src = max(trg_words) + 1, max(src_words) + 1
    out = [[0.0] * n_src for _ in range(n_trg)]
    for w in range(n_trg):
        rows = [t for t, owner in enumerate(trg_words) if owner == w]
        for v in range(n_src):
            cols = [s for s, owner in enumerate(src_words) if owner == v]
            total = sum(float(alphas[t, s]) for t in rows for s in cols)
            out[w][v] = total / len(rows)
    return torch.tensor(out, dtype=torch.float64)


def test_word_attention_against_its_definition() -> None:
    """Random attention over pieces with EOS on both sides, several pieces per word."""
    generator = torch.Generator().manual_seed(3)
    src_words, trg_words = [0, 0, 1, 2, 2, 2, 3], [0, 1, 1, 2, 3, 3]
    logits = torch.randn(len(trg_words) + 1, len(src_words) + 1, generator=generator)
    alphas = logits.softmax(dim=-1).float()
    got = word_attention(alphas, src_words, trg_words)
    want = _reference_word_attention(alphas, src_words, trg_words)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_extractions() -> None:
    """argmax: one link per target word; threshold: every pair with enough mass; next: the
    following step's row."""
    alphas = torch.tensor(
        [  # rows: target pieces then EOS; columns: source pieces then EOS
            [0.7, 0.2, 0.1, 0.0],
            [0.1, 0.5, 0.4, 0.0],
            [0.0, 0.1, 0.8, 0.1],
            [0.0, 0.0, 0.2, 0.8],
        ]
    )
    src_words, trg_words = [0, 1, 2], [0, 1, 2]
    assert extract_links(alphas, src_words, trg_words) == [(0, 0), (1, 1), (2, 2)]
    assert extract_links(alphas, src_words, trg_words, "threshold", 0.4) == [
        (0, 0),
        (1, 1),
        (2, 1),
        (2, 2),
    ]
    assert extract_links(alphas, src_words, trg_words, "next") == [(1, 0), (2, 1), (2, 2)]
    merged = extract_links(alphas, [0, 0, 1], trg_words)  # source pieces 0, 1 form one word
    assert merged == [(0, 0), (0, 1), (1, 2)]


def test_intersect_keeps_the_argmax_links_both_words_agree_on() -> None:
    """Target words 0 and 1 both look at source word 0 most, which looks at target word 0
    most: 1-0's link goes; 2-2 is each one's best. Source word 1 is nobody's argmax."""
    alphas = torch.tensor(
        [
            [0.6, 0.3, 0.1, 0.0],
            [0.5, 0.4, 0.1, 0.0],
            [0.1, 0.2, 0.7, 0.0],
            [0.0, 0.0, 0.1, 0.9],
        ]
    )
    words = [0, 1, 2]
    assert extract_links(alphas, words, words) == [(0, 0), (0, 1), (2, 2)]
    assert extract_links(alphas, words, words, "intersect") == [(0, 0), (2, 2)]


def test_gdfa_grows_the_intersection_with_neighbouring_argmax_links() -> None:
    """Target words 0 and 1 both look at source 0 most (0-0, 0-1); source 1 looks at target
    1 most (1-1); 2-2 both ways. From the intersection {0-0, 2-2}, 0-1 touches 0-0 and
    aligns target 1, 1-1 touches 0-0 diagonally and aligns source 1: both grow in."""
    alphas = torch.tensor(
        [
            [0.7, 0.2, 0.1, 0.0],
            [0.6, 0.3, 0.1, 0.0],
            [0.1, 0.2, 0.7, 0.0],
            [0.0, 0.0, 0.1, 0.9],
        ]
    )
    words = [0, 1, 2]
    assert extract_links(alphas, words, words, "intersect") == [(0, 0), (2, 2)]
    assert extract_links(alphas, words, words, "gdfa") == [(0, 0), (0, 1), (1, 1), (2, 2)]


def test_growing_adds_neighbours_that_align_a_new_word() -> None:
    """Intersection {0-0, 1-1}; 2-1 and 1-2 touch 1-1 and each aligns a word not yet
    aligned (source 2, target 2), so both are added."""
    forward, reverse = {(0, 0), (1, 1), (2, 1)}, {(0, 0), (1, 1), (1, 2)}
    assert gdfa(forward, reverse) == {(0, 0), (1, 1), (2, 1), (1, 2)}


def test_final_and_adds_links_between_two_unaligned_words() -> None:
    """2-2 and 1-3 touch nothing in the intersection {0-0}; both of their words are still
    unaligned after growing, so final-and adds them."""
    assert gdfa({(0, 0), (2, 2)}, {(0, 0), (1, 3)}) == {(0, 0), (2, 2), (1, 3)}


def test_a_link_between_aligned_words_is_not_added() -> None:
    """0-1 touches both intersection links, but source 0 and target 1 are aligned already."""
    assert gdfa({(0, 0), (1, 1), (0, 1)}, {(0, 0), (1, 1)}) == {(0, 0), (1, 1)}


def test_och_and_ney_scores_by_hand() -> None:
    """Two sentences counted by hand: |A|=5, |S|=3, |A&S|=2, |A&P|=4."""
    s1, p1 = parse_links("0-0 1-1 2?1", "gold")
    s2, p2 = parse_links("0-1 1?0", "gold")
    references = [ReferenceLinks(s1, s1 | p1), ReferenceLinks(s2, s2 | p2)]
    hypotheses = [{(0, 0), (2, 1), (2, 2)}, {(0, 1), (1, 0)}]
    scores = score_alignments(hypotheses, references)
    assert scores.precision == pytest.approx(4 / 5)
    assert scores.recall == pytest.approx(2 / 3)
    assert scores.aer == pytest.approx(1 - (2 + 4) / (5 + 3))
    perfect = score_alignments([s1, s2], references)
    assert perfect.aer == 0.0 and perfect.recall == 1.0


def test_a_link_that_is_not_one_names_its_place() -> None:
    """A token that is not i-j or i?j is refused with where it came from."""
    with pytest.raises(ValueError, match=r"gold line 3: '1-x'"):
        parse_links("0-0 1-x", "gold line 3")
