"""The reference alignment from Strong's numbers (scripts/build_corpus.py), trap by trap on
inline OSIS snippets, and the shipped gold against the shipped text."""

from __future__ import annotations

import gzip
from collections import Counter

import pytest
from test_build_corpus import DATA, bc


def w(number: str, words: str) -> str:
    return f'<w lemma="strong:{number}">{words}</w>'


def links(es_markup: str, en_markup: str) -> tuple[set, set]:
    return bc.link_verse(bc.tag_verse(es_markup, "es"), bc.tag_verse(en_markup, "en"))


def test_a_phrase_tag_links_its_content_word_sure_and_the_rest_possible() -> None:
    es = f"{w('H7225', 'EN el principio')} {w('H1254', 'crió')} {w('H0430', 'Dios')}"
    en = f"{w('H0430', 'In')} {w('H0853', 'the')} {w('H7225', 'beginning')}, {w('H0430', 'God')}"
    en += f" {w('H1254', 'created')}"
    sure, possible = links(es, en)
    # es: EN0 el1 principio2 crió3 Dios4; en: In0 the1 beginning,2 God3 created4
    assert sure == {(2, 2), (3, 4), (4, 3)}
    assert possible == {(0, 2), (1, 2)}, "EN and el go with beginning, maybe"


def test_function_words_carrying_a_neighbours_number_do_not_count() -> None:
    """'In' carries God's H430 as well: an element of function words alone is not an
    occurrence, so Dios-God stays a one-to-one, sure link and 'In' gets none."""
    sure, possible = links(w("H430", "Dios"), f"{w('H430', 'In')} {w('H430', 'God')}")
    assert sure == {(0, 1)} and possible == set()


def test_the_object_marker_h0853_is_never_linked() -> None:
    sure, possible = links(f"{w('H0853', 'á')} {w('H1', 'Abraham')}", w("H853", "Abraham"))
    assert sure == set() and possible == set()


def test_repeated_numbers_pair_in_order_when_the_counts_match() -> None:
    es = f"{w('H1', 'casa')} y {w('H2', 'perro')} y {w('H1', 'casa')}"
    en = f"{w('H1', 'house')} and {w('H2', 'dog')} and {w('H1', 'house')}"
    sure, possible = links(es, en)
    assert sure == {(0, 0), (2, 2), (4, 4)} and possible == set()


def test_repeated_numbers_with_different_counts_are_all_possible() -> None:
    es = f"{w('H1', 'casa')} {w('H1', 'casa')}"
    sure, possible = links(es, w("H1", "house"))
    assert sure == set() and possible == {(0, 0), (1, 0)}


def test_several_numbers_in_one_lemma_and_leading_zeros() -> None:
    """'strong:H1121 H5971': only the first with the prefix; H05971 is H5971; G5971 is not."""
    assert bc.strong_numbers("strong:H1121 H5971") == {"H1121", "H5971"}
    assert bc.strong_numbers("strong:H05971") == {"H5971"}
    assert bc.strong_numbers("strong:G5971 lemma.TR:λαος") == {"G5971"}
    es = '<w lemma="strong:H1121 H5971">el pueblo</w>'
    sure, _ = links(es, f"{w('H05971', 'people')} {w('G1121', 'sons')}")
    assert sure == {(1, 0)}, "H5971 matches across the zeros, the Greek G1121 matches nothing"


def test_two_content_words_on_both_sides_are_only_possible() -> None:
    sure, possible = links(w("H1", "las aguas profundas"), w("H1", "deep waters"))
    assert sure == set() and possible == {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)}


def test_tokens_follow_the_text_conversion_exactly() -> None:
    """A footnote inside a word's neighbourhood goes, words never glue, punctuation after a
    tag stays on its word and carries no number of its own."""
    markup = (
        f"{w('H430', 'God')}<note>a note</note>{w('H1254', 'created')} "
        f"{w('H8064', 'the heavens')}, and gave<transChange>it</transChange> away"
    )
    tagged = bc.tag_verse(markup, "en")
    expected = "God created the heavens, and gaveit away"
    assert " ".join(tagged.tokens) == bc.osis_to_text(markup) == expected
    numbers = [sorted(n for e in owners for n in tagged.numbers[e]) for owners in tagged.elements]
    assert numbers == [["H430"], ["H1254"], ["H8064"], ["H8064"], [], [], []]


def _ref(book: str, chapter: int, verse: int) -> bc.VerseRef:
    return bc.VerseRef(bc.BOOK_ORDER[book], chapter, verse, book)


def test_an_english_verse_with_its_neighbours_numbers_is_dropped() -> None:
    """Where the WEB follows the Hebrew verse division its tags belong to the verse before."""
    es = {
        _ref("Gen", 32, 5): f"{w('H1', 'bueyes')} {w('H2', 'asnos')} {w('H3', 'ovejas')}",
        _ref("Gen", 32, 6): f"{w('H4', 'mensajeros')} {w('H5', 'volvieron')}",
        _ref("Gen", 32, 7): f"{w('H6', 'temió')} {w('H7', 'Jacob')}",
    }
    en = dict(es)
    en[_ref("Gen", 32, 6)] = f"{w('H1', 'messengers')} {w('H2', 'returned')}"
    en[_ref("Gen", 32, 7)] = f"{w('H7', 'Jacob')} {w('H6', 'feared')}"
    pairs = [
        (_ref("Gen", 32, 6), "mensajeros volvieron", "messengers returned"),
        (_ref("Gen", 32, 7), "temió Jacob", "Jacob feared"),
    ]
    gold = bc.gold_for(pairs, es, en)
    assert gold.lines == ["", "0-1 1-0"]
    assert gold.dropped == Counter({"numbers of another verse (verse division differs)": 1})


def test_a_verse_whose_tokens_do_not_spell_the_text_is_dropped() -> None:
    ref = _ref("Gen", 1, 1)
    es, en = {ref: w("H1", "casa")}, {ref: w("H1", "house")}
    gold = bc.gold_for([(ref, "otra cosa", "house")], es, en)
    assert gold.lines == [""] and gold.dropped["tokens do not spell the shipped text"] == 1
    cut = bc.gold_for([(ref, "casa", "house")], {ref: f"{w('H1', 'casa')} Amén."}, en)
    assert cut.lines == ["0-0"], "a cut subscription keeps the tokens before it"


# ----------------------------------------------------------------------------- shipped gold


def _lines(path: object) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:  # type: ignore[call-overload]
        return handle.read().splitlines()


@pytest.mark.parametrize("split", ["dev", "test", "books"])
def test_the_shipped_gold_indexes_the_shipped_tokens(split: str) -> None:
    gold = _lines(DATA / f"{split}.align.gz")
    es, en = _lines(DATA / f"{split}.es.gz"), _lines(DATA / f"{split}.en.gz")
    assert len(gold) == len(es) == len(en)
    aligned = [line for line in gold if line]
    assert len(aligned) > 0.9 * len(gold), "most verses have a reference alignment"
    sure = possible = 0
    for line, src, trg in zip(gold, es, en, strict=True):
        for link in line.split():
            mark = "?" if "?" in link else "-"
            i, j = map(int, link.split(mark))
            assert i < len(src.split()) and j < len(trg.split()), (link, src, trg)
            sure += mark == "-"
            possible += mark == "?"
    assert sure > 3 * len(aligned) and possible > 0
