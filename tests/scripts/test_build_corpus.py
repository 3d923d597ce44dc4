"""scripts/build_corpus.py: OSIS stripping, verse alignment checks, splits and the shipped corpus.

The OSIS fixtures are real entries of ``mod2imp engWEB2015eb`` (World English Bible) and
``mod2imp spaRV1909eb`` (Reina-Valera 1909), some trimmed; no SWORD package is needed.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from scripted import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "bible"


bc = load_script("build_corpus")
text = bc.osis_to_text


def ref(key: str):
    parsed = bc.parse_key(key)
    assert parsed is not None, key
    return parsed


# --- real markup -------------------------------------------------------------------------------

WEB_GEN_1_1 = (
    '<w lemma="strong:H0430">In</w> <w lemma="strong:H0853">the</w> <w lemma="strong:H7225">'
    'beginning</w>, <w lemma="strong:H0430">God</w><note placement="foot"><reference '
    'type="annotateRef">1:1 </reference>The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).'
    '</note><w lemma="strong:H1254">created</w> <w lemma="strong:H0853">the</w> <w lemma="strong:'
    'H8064">heavens</w> <w lemma="strong:H0430">and</w> <w lemma="strong:H0853">the</w> <w '
    'lemma="strong:H0776">earth</w>.'
)
RV_GEN_2_12 = (
    '<w lemma="strong:H2091">Y el oro</w> <w lemma="strong:H1931">de aquella</w> <w lemma="strong:'
    'H0776">tierra</w> <w lemma="strong:H2896">es bueno</w>: <w lemma="strong:H8033">hay allí</w>'
    '<transChange type="added">también</transChange><w lemma="strong:H0916">bdelio</w> <w '
    'lemma="strong:H0068">y piedra</w> <w lemma="strong:H7718">cornerina</w>.'
)
RV_2CHR_35_13_END = (
    '<w lemma="strong:H6745">y calderas</w>, y repartiéron<transChange type="added">lo'
    '</transChange> <w lemma="strong:H7323">prestamente</w> <w lemma="strong:H3605">á todo</w> '
    '<w lemma="strong:H1121 H5971">el pueblo</w>.'
)
WEB_REV_1_6 = (
    '<w lemma="strong:G2532">and</w> <w lemma="strong:G2532">he</w> <w lemma="strong:G4160">made'
    '</w> <w lemma="strong:G4160">us</w> <w lemma="strong:G1519">to</w> <w lemma="strong:G2532">be'
    '</w> <w lemma="strong:G4160">a</w> <w lemma="strong:G0932">Kingdom</w>, <w lemma="strong:'
    'G2409">priests</w><note type="crossReference"><reference subType="x-origin" type='
    '"annotateRef">1:6 </reference><reference>Exodus 19:6; Isaiah 61:6 </reference></note> <w '
    'lemma="strong:G1519">to</w> <w lemma="strong:G0846">his</w> <w lemma="strong:G2316">God</w> '
    '<w lemma="strong:G2532">and</w> <w lemma="strong:G3962">Father</w>—<w lemma="strong:G1519">'
    'to</w> <w lemma="strong:G0846">him</w> <w lemma="strong:G2532">be</w> <w lemma="strong:G3588"'
    '>the</w> <w lemma="strong:G1391">glory</w> <w lemma="strong:G2532">and</w> <w lemma="strong:'
    'G3588">the</w> <w lemma="strong:G2904">dominion</w> <w lemma="strong:G0165">forever</w> <w '
    'lemma="strong:G2532">and</w> <w lemma="strong:G0165">ever</w>. <w lemma="strong:G0281">Amen'
    '</w>. <div eID="gen35578" type="x-p"/>'
)
WEB_MARK_11_1_START = (
    '<w lemma="strong:G1519">to</w> Bethsphage<note placement="foot"><reference type='
    '"annotateRef">11:1 </reference>TR &amp;NU read “Bethphage” instead of “Bethsphage”</note> '
    '<w lemma="strong:G2532">and</w> <w lemma="strong:G0963">Bethany</w>,'
)
WEB_PS_3_1 = (
    '<div type="x-milestone" subType="x-preverse" sID="pv4877"/><title canonical="true" type='
    '"psalm">A Psalm by David, when he fled from Absalom his son.</title> <lg sID="gen7860"/> <l '
    'level="1" sID="gen7861"/><div type="x-milestone" subType="x-preverse" eID="pv4877"/>Yahweh, '
    'how <w lemma="strong:H1732">my</w> adversaries <w lemma="strong:H1121">have</w> increased!<l '
    'eID="gen7861" level="1"/> <l level="2" sID="gen7862"/>Many <w lemma="strong:H1121">are</w> <w '
    'lemma="strong:H1121">those</w> <w lemma="strong:H1121">who</w> rise <w lemma="strong:H1121">'
    'up</w> <w lemma="strong:H6440">against</w> <w lemma="strong:H6440">me</w>. <l eID="gen7862" '
    'level="2"/>'
)
RV_PS_3_1 = (
    '<w lemma="strong:H4210">Salmo</w> <w lemma="strong:H1732">de David</w>, <w lemma="strong:'
    'H1272">cuando huía</w> <w lemma="strong:H6440">de delante</w> <w lemma="strong:H0053">de '
    'Absalom</w> <w lemma="strong:H1121">su hijo</w>. ¡<w lemma="strong:H1121">OH</w> <w lemma='
    '"strong:H3068">Jehová</w>, <w lemma="strong:H4100">cuánto se</w> <w lemma="strong:H7231">han '
    'multiplicado</w> <w lemma="strong:H6862">mis enemigos</w>! <w lemma="strong:H7227">muchos</w> '
    '<w lemma="strong:H4100">se</w> <w lemma="strong:H6965">levantan</w> <w lemma="strong:H5921">'
    "contra</w> mí."
)
WEB_PS_1_0 = (
    '<chapter n="1" osisID="Ps.1" sID="Ps.1"/> <milestone n="Psalm 1" type="x-chapterLabel"/> '
    '<title>BOOK 1</title> <lg sID="gen7817"/> <l level="1" sID="gen7818"/>'
)
WEB_SONG_1_4_END = (
    '<l level="2" sID="gen15628"/>We <w lemma="strong:H4428">will</w> praise <w lemma="strong:'
    'H0935">your</w> <w lemma="strong:H0157">love</w> more <w lemma="strong:H4428">than</w> <w '
    'lemma="strong:H3196">wine</w>!<l eID="gen15628" level="2"/> <lg eID="gen15626"/> <speaker>'
    'Beloved</speaker> <lg sID="gen15629"/> <l level="1" sID="gen15630"/><w lemma="strong:H0935">'
    'They</w> <w lemma="strong:H4428">are</w> <w lemma="strong:H4339">right</w> <w lemma="strong:'
    'H0935">to</w> <w lemma="strong:H0157">love</w> <w lemma="strong:H0935">you</w>. <l eID='
    '"gen15630" level="1"/>'
)
WEB_LUKE_12_6 = (
    '<div type="x-milestone" subType="x-preverse" sID="pv14617"/><div sID="gen32746" type="x-p"/> '
    '<div type="x-milestone" subType="x-preverse" eID="pv14617"/> <q marker="" who="Jesus">“<w '
    'lemma="strong:G3756">Aren’t</w> <w lemma="strong:G4002">five</w> <w lemma="strong:G4765">'
    'sparrows</w> <w lemma="strong:G4453">sold</w> <w lemma="strong:G1520">for</w> <w lemma='
    '"strong:G1417">two</w> assaria coins</q> <note placement="foot"><reference type="annotateRef">'
    "12:6 </reference>An assarion was a small copper coin worth about an hour’s wages for an "
    'agricultural laborer.</note> <q marker="" who="Jesus">? <w lemma="strong:G3756">Not</w> <w '
    'lemma="strong:G1520">one</w> <w lemma="strong:G1537">of</w> <w lemma="strong:G0846">them</w> '
    '<w lemma="strong:G1510">is</w> <w lemma="strong:G1950">forgotten</w> <w lemma="strong:G1537">'
    'by</w> <w lemma="strong:G2316">God</w>. </q>'
)
# Revelation 22:21 with the glossary that follows it in the same entry (two of its items kept).
WEB_REV_22_21 = (
    '<div type="x-milestone" subType="x-preverse" sID="pv16039"/><div sID="gen35836" type="x-p"/>'
    '<div type="x-milestone" subType="x-preverse" eID="pv16039"/><w lemma="strong:G3956">The</w> '
    '<w lemma="strong:G5485">grace</w> <w lemma="strong:G5485">of</w> <w lemma="strong:G3956">the'
    '</w> <w lemma="strong:G2962">Lord</w> <w lemma="strong:G2424">Jesus</w> <w lemma="strong:'
    'G2962">Christ</w> <w lemma="strong:G3956">be</w> <w lemma="strong:G3326">with</w> <w lemma='
    '"strong:G3956">all</w> <w lemma="strong:G3956">the</w> saints. Amen.  <chapter eID="Rev.22"/>'
    '<div eID="gen35836" type="x-p"/> <div canonical="true" eID="gen35575" osisID="Rev" type="book"'
    '/> <div sID="gen35837" type="glossary"/> <milestone n="Glossary" type="x-usfm-h"/> <title '
    'level="1" type="main">World English Bible Glossary</title> <div sID="gen35838" type='
    '"introduction"/> <div sID="gen35839" type="x-p"/> The following words used in the World '
    'English Bible (WEB) are not very common.<div eID="gen35839" type="x-p"/> <list> <item '
    'subType="x-introduction" type="x-indent-1"><seg type="keyword">Abaddon</seg> Abaddon is '
    'Hebrew for destruction.</item> <item subType="x-introduction" type="x-indent-1"><seg type='
    '"keyword">Zion</seg> Zion is a name which originally referred one of the mountains of '
    'Jerusalem.</item> </list> <div eID="gen35838" type="introduction"/> <div eID="gen35837" type='
    '"glossary"/>'
)
RV_HEB_13_25 = (
    '<w lemma="strong:G3588">La</w> <w lemma="strong:G5485">gracia</w> <w lemma="strong:G3326">sea '
    'con</w> <w lemma="strong:G3956">todos</w> <w lemma="strong:G5216">vosotros</w>. <w lemma='
    '"strong:G0281">Amén</w>. <w lemma="strong:G1125">Fué escrita</w> <w lemma="strong:G1445">á '
    'los Hebreos</w> <w lemma="strong:G0575">desde</w> <w lemma="strong:G2482">Italia</w> <w lemma'
    '="strong:G1223">con</w> <w lemma="strong:G5095">Timoteo</w>.  <chapter eID="Heb.13"/><div '
    'eID="gen1205" type="x-p"/> <div canonical="true" eID="gen1192" osisID="Heb" type="book"/>'
)


# --- markup to text ----------------------------------------------------------------------------


def test_footnote_is_removed_with_its_content_and_words_do_not_glue() -> None:
    # God</w><note>…</note><w>created: the words of the two <w> elements must stay apart.
    assert text(WEB_GEN_1_1) == "In the beginning, God created the heavens and the earth."


def test_cross_reference_note_goes_with_its_references() -> None:
    result = text(WEB_REV_1_6)
    assert "Exodus" not in result and "1:6" not in result
    assert result.startswith("and he made us to be a Kingdom, priests to his God and Father—to him")
    assert result.endswith("forever and ever. Amen.")


def test_w_and_transchange_words_are_kept_with_spaces_between_elements() -> None:
    # hay allí</w><transChange>también</transChange><w>bdelio
    assert text(RV_GEN_2_12) == (
        "Y el oro de aquella tierra es bueno: hay allí también bdelio y piedra cornerina."
    )


def test_transchange_glued_to_plain_text_stays_one_word() -> None:
    # An added enclitic pronoun: "repartiéron<transChange>lo</transChange>" is one word.
    assert text(RV_2CHR_35_13_END) == "y calderas, y repartiéronlo prestamente á todo el pueblo."


@pytest.mark.parametrize(
    ("markup", "expected"),
    [
        ("<w>God</w><w>created</w>", "God created"),
        ("<w>Look</w><milestone type='x-p'/><w>here</w>", "Look here"),
        ('<w>one</w><lb type="x-p"/><w>two</w>', "one two"),
        ('<w>said</w>, <q marker="“" sID="q1"/><w>Go</w>', "said, Go"),
        ("<w>word</w>.", "word."),
        ("<w>word</w><note>n</note>, <w>next</w>", "word, next"),
        ("“<w>Let</w> <w>there</w>", "“Let there"),
        ("¿<w>Con</w> <w>qué</w>?", "¿Con qué?"),
        ("<w>Father</w>—<w>to</w>", "Father—to"),
        ("<w>Yahweh</w>’s", "Yahweh’s"),
        (
            "<hi type='italic'>Emphasis</hi> and <divineName>Yahweh</divineName>",
            "Emphasis and Yahweh",
        ),
        ("<seg><foreign n='x'>Talitha</foreign></seg> <q who='Jesus'>cumi</q>", "Talitha cumi"),
    ],
)
def test_element_boundaries(markup: str, expected: str) -> None:
    assert text(markup) == expected


def test_entities_are_unescaped() -> None:
    assert (
        text("Tom &amp; Jerry &quot;x&quot; &#8220;y&#8221; &#x41;&lt;") == 'Tom & Jerry "x" “y” A<'
    )
    # The only entities in the real WEB are inside footnotes, which go.
    assert text(WEB_MARK_11_1_START) == "to Bethsphage and Bethany,"


def test_whitespace_is_normalised() -> None:
    assert text("  <w>a</w> \n\t <w>b</w>\u00a0 c  ") == "a b c"
    assert text(WEB_LUKE_12_6) == (
        "“Aren’t five sparrows sold for two assaria coins? Not one of them is forgotten by God."
    )


def test_milestones_contribute_no_text() -> None:
    assert text(WEB_PS_1_0) == ""
    assert text('<q marker="“" sID="q1"/><milestone n="Psalm 1" type="x-chapterLabel"/>') == ""


def test_canonical_psalm_title_is_kept_like_rv1909_inline_superscription() -> None:
    english, spanish = text(WEB_PS_3_1), text(RV_PS_3_1)
    assert english == (
        "A Psalm by David, when he fled from Absalom his son. Yahweh, how my adversaries have "
        "increased! Many are those who rise up against me."
    )
    assert spanish.startswith(
        "Salmo de David, cuando huía de delante de Absalom su hijo. ¡OH Jehová"
    )


def test_non_canonical_titles_and_speakers_are_dropped() -> None:
    assert text('<title type="x-section">Heading</title><w>Text</w>') == "Text"
    assert text('<title type="psalm">Not canonical</title>Body') == "Body"
    assert text('<title>THE SONG<note placement="foot">n</note></title> Body') == "Body"
    assert "Beloved" not in text(WEB_SONG_1_4_END)
    assert text(WEB_SONG_1_4_END) == (
        "We will praise your love more than wine! They are right to love you."
    )


def test_glossary_after_revelation_22_21_does_not_leak() -> None:
    assert text(WEB_REV_22_21) == (
        "The grace of the Lord Jesus Christ be with all the saints. Amen."
    )


def test_glossary_div_is_skipped_even_without_a_book_end() -> None:
    markup = (
        'Amen. <div sID="g1" type="glossary"/>Abba means father.<div eID="g1" type="glossary"/>'
    )
    assert text(markup) == "Amen."


def test_malformed_fragments_do_not_break_the_text() -> None:
    assert text("walk’</q> ?” <w>Then</w>") == "walk’?” Then"
    assert text("<note>never closed <w>lost</w>") == ""
    assert text("a < b") == "a < b"


def test_epistle_subscription_is_cut() -> None:
    verses = {ref("Hebrews 13:24"): "Saludad á todos.", ref("Hebrews 13:25"): text(RV_HEB_13_25)}
    assert bc.strip_subscriptions(verses) == 1
    assert verses[ref("Hebrews 13:25")] == "La gracia sea con todos vosotros. Amén."


# --- the imp format ----------------------------------------------------------------------------

IMP = """$$$[ Module Heading ]

$$$[ Testament 1 Heading ]
<milestone type="x-importer" subType="x-osis2mod" n="$Rev: 3769 $ (SWORD: 1.9.0)"/>
$$$Genesis 0:0
<div canonical="true" osisID="Gen" sID="gen2" type="book"/> <title level="1" type="main">Génesis</title>
$$$Genesis 1:0
<chapter n="1" osisID="Gen.1" sID="Gen.1"/>
$$$Genesis 1:1
<w lemma="strong:H7225">EN el principio</w> <w lemma="strong:H1254">crió</w> <w lemma="strong:H0430">Dios</w> <w lemma="strong:H8064">los cielos</w> <w lemma="strong:H0776">y la tierra</w>.
$$$I Samuel 24:1
ENTONCES David subió de allí
$$$Tobit 1:1
The book of the words of Tobit
$$$Revelation of John 22:21
La gracia
"""


def test_parse_imp_entries_and_keys() -> None:
    entries = bc.parse_imp(IMP)
    assert [key for key, _ in entries] == [
        "[ Module Heading ]",
        "[ Testament 1 Heading ]",
        "Genesis 0:0",
        "Genesis 1:0",
        "Genesis 1:1",
        "I Samuel 24:1",
        "Tobit 1:1",
        "Revelation of John 22:21",
    ]
    assert entries[0][1] == ""
    assert entries[-1][1] == "La gracia"
    assert str(bc.parse_key("I Samuel 24:1")) == "1Sam 24:1"
    assert str(bc.parse_key("Revelation of John 22:21")) == "Rev 22:21"
    for key in ("[ Module Heading ]", "Genesis 0:0", "Genesis 1:0", "Tobit 1:1"):
        assert bc.parse_key(key) is None


def test_imp_verses_keeps_verses_only() -> None:
    verses = bc.imp_verses(IMP)
    assert {str(r): t for r, t in verses.items()} == {
        "Gen 1:1": "EN el principio crió Dios los cielos y la tierra.",
        "1Sam 24:1": "ENTONCES David subió de allí",
        "Rev 22:21": "La gracia",
    }
    assert bc.parse_ref("1Sam 24:1") == bc.parse_key("I Samuel 24:1")
    assert sorted(verses)[0] == bc.parse_ref("Gen 1:1")  # canon order


# --- alignment ---------------------------------------------------------------------------------

# Character lengths of the verses of a made-up chapter: varied, like real verses.
LENGTHS = [40, 150, 60, 210, 90, 35, 170, 75, 120, 50, 190, 80, 140, 45, 100]


def _verse(n: int, word: str) -> str:
    return " ".join([word] * (n // (len(word) + 1)))


def _imp(book: str, chapters: dict[int, list[str]]) -> str:
    return "".join(
        f"$$${book} {c}:{v}\n<w>{t}</w>\n"
        for c, verses in chapters.items()
        for v, t in enumerate(verses, 1)
    )


def _two_modules(shift_chapter_2: bool) -> tuple[str, str]:
    """Numbers 12-14 in two languages; if asked, the Spanish side divides chapter 13 the Hebrew way.

    As in RV1909: the last verse of chapter 12 moves to 13:1 (12:15 stays empty), every later
    verse of 13 is one off, and 13's last verse holds two.
    """
    en = {c: [_verse(n * (1 + c % 3) // 2, "word") for n in LENGTHS] for c in (12, 13, 14)}
    es = {c: [_verse(int(len(t) * 1.1), "palabra") for t in en[c]] for c in (12, 13, 14)}
    if shift_chapter_2:
        moved = es[12][-1]
        es[12][-1] = ""
        es[13] = [moved] + es[13][:-2] + [es[13][-2] + " " + es[13][-1]]
    return _imp("Numbers", es), _imp("Numbers", en)


def test_aligned_modules_have_no_misaligned_chapters() -> None:
    es_imp, en_imp = _two_modules(shift_chapter_2=False)
    es, en = bc.imp_verses(es_imp), bc.imp_verses(en_imp)
    assert bc.find_misaligned_chapters(es, en) == {}
    result = bc.pair_verses(es, en)
    assert len(result.pairs) == 3 * len(LENGTHS)
    assert not result.dropped


def test_hebrew_versification_shift_is_detected_and_dropped() -> None:
    es_imp, en_imp = _two_modules(shift_chapter_2=True)
    es, en = bc.imp_verses(es_imp), bc.imp_verses(en_imp)
    flagged = bc.find_misaligned_chapters(es, en)
    assert set(flagged) == {("Num", 12), ("Num", 13)}
    assert flagged[("Num", 12)].startswith("verse numbers differ")
    assert flagged[("Num", 13)] == "shifted by -1"
    result = bc.pair_verses(es, en)
    assert {r.chapter for r, _, _ in result.pairs} == {14}
    assert result.dropped["empty or missing on one side"] == 1  # Spanish 12:16
    assert result.dropped["misaligned chapter"] == 2 * len(LENGTHS) - 1


def test_shift_in_part_of_a_chapter_is_detected() -> None:
    # As in RV1909 1 Kings 22:43-53: only the last verses of a long chapter are one off.
    en = {v: _verse(n, "word") for v, n in enumerate(LENGTHS * 3, 1)}
    es = dict(en)
    for v in range(39, 45):  # each Spanish verse holds the previous English one ...
        es[v] = en[v - 1]
    es[45] = en[44] + " " + en[45]  # ... until the last, which holds two
    assert bc.best_shift(es, en) == 0
    assert bc.chapter_problem(es, en) == "partly shifted from verse 38"


def test_moved_verse_boundary_is_detected() -> None:
    en = {v: _verse(n, "word") for v, n in enumerate(LENGTHS, 1)}
    es = dict(en)
    es[4], es[5] = en[4] + " " + en[5][:60], en[5][60:]  # a clause of verse 5 ends Spanish 4
    assert bc.chapter_problem(es, en) is None
    assert bc.find_moved_boundaries(es, en) == {4, 5}
    assert bc.find_moved_boundaries(en, en) == set()


def test_length_ratio_empty_and_blind_test_filters() -> None:
    es = {
        ref("Genesis 1:1"): "En el principio creó Dios los cielos y la tierra.",
        ref("Genesis 2:1"): "Corto.",
        ref("Genesis 3:1"): "",
        ref("Ruth 1:1"): "Y aconteció en los días que gobernaban los jueces.",
        ref("II John 1:1"): "El anciano á la señora elegida.",
    }
    en = {
        ref("Genesis 1:1"): "In the beginning, God created the heavens and the earth.",
        ref("Genesis 2:1"): "This English side is far more than three times as long as Spanish.",
        ref("Genesis 3:1"): "God said, “Let there be light,” and there was light.",
        ref("Genesis 4:1"): "The man knew Eve his wife.",
        ref("Ruth 1:1"): "In the days when the judges judged, there was a famine in the land.",
        ref("II John 1:1"): "The elder, to the chosen lady and her children.",
    }
    assert bc.length_ratio("abc", "abcdefghi") == 3.0
    assert bc.length_ratio("", "abc") == float("inf")
    result = bc.pair_verses(es, en)
    assert [str(r) for r, _, _ in result.pairs] == ["Gen 1:1"]
    assert result.dropped == {
        "empty or missing on one side": 2,  # Gen 3:1 (empty), Gen 4:1 (missing)
        "length ratio > 3 (characters)": 1,  # Gen 2:1
        "blind-test book (held out)": 2,
    }


def test_blind_test_books_are_the_six_short_books() -> None:
    assert set(bc.BLIND_TEST_BOOKS) == {"Ruth", "Jonah", "Phlm", "Jude", "2John", "3John"}
    assert set(bc.BLIND_TEST_BOOKS) <= set(bc.BOOKS.values())


def test_book_split_takes_whole_books_apart_from_the_blind_test_books() -> None:
    assert set(bc.BOOK_SPLIT_BOOKS) <= set(bc.BOOKS.values())
    assert not set(bc.BOOK_SPLIT_BOOKS) & set(bc.BLIND_TEST_BOOKS)
    assert len(bc.BOOK_SPLIT_BOOKS) == len(set(bc.BOOK_SPLIT_BOOKS)) >= 4
    for book in bc.BOOK_SPLIT_BOOKS:  # every verse of the book, whatever its hash bucket
        assert {bc.split_of(f"{book} {c}:{v}") for c in range(1, 6) for v in range(1, 40)} == {
            "books"
        }
    assert bc.split_of("Est 1:1") != "books"  # the book itself, not a prefix of its name
    hashed = {bc.split_of(f"Gen {c}:{v}") for c in range(1, 50) for v in range(1, 30)}
    assert hashed == {"train", "dev", "test"}


# --- splits and files --------------------------------------------------------------------------


def test_split_is_deterministic_with_the_expected_proportions() -> None:
    refs = [
        f"{book} {c}:{v}"
        for book in ("Gen", "Ps", "Matt")
        for c in range(1, 51)
        for v in range(1, 201)
    ]
    splits = [bc.split_of(r) for r in refs]
    assert splits == [bc.split_of(r) for r in refs]
    assert bc.split_of("Gen 1:1") == bc.split_of("Gen 1:1")
    share = {name: splits.count(name) / len(refs) for name in bc.SPLITS}
    assert share["books"] == 0  # Gen, Ps and Matt are split by hash
    assert share["dev"] == pytest.approx(0.017, abs=0.003)
    assert share["test"] == pytest.approx(0.034, abs=0.004)


def test_gzip_output_is_byte_identical(tmp_path: Path) -> None:
    lines = ["uno", "dos ñ", "tres"]
    bc.write_gzip_lines(tmp_path / "a.gz", lines)
    bc.write_gzip_lines(tmp_path / "b.gz", lines)
    data = (tmp_path / "a.gz").read_bytes()
    assert data == (tmp_path / "b.gz").read_bytes()
    assert data[4:8] == b"\0\0\0\0"  # mtime
    assert gzip.decompress(data).decode("utf-8") == "uno\ndos ñ\ntres\n"
    with pytest.raises(ValueError):
        bc.write_gzip_lines(tmp_path / "c.gz", ["a\nb"])


def test_command_line_builds_from_imp_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    es_imp, en_imp = _two_modules(shift_chapter_2=True)
    es_path, en_path, out = tmp_path / "es.imp", tmp_path / "en.imp", tmp_path / "out"
    es_path.write_text(es_imp, encoding="utf-8")
    en_path.write_text(en_imp, encoding="utf-8")
    assert bc.main(["--out", str(out), "--es-imp", str(es_path), "--en-imp", str(en_path)]) == 0
    assert "Num 13: shifted by -1" in capsys.readouterr().out
    refs = [line for split in bc.SPLITS for line in _read(out / f"{split}.ref.gz")]
    assert sorted(refs, key=bc.parse_ref) == [f"Num 14:{v}" for v in range(1, len(LENGTHS) + 1)]
    with pytest.raises(SystemExit):
        bc.main(["--out", str(out), "--es-imp", str(es_path)])


# --- the shipped corpus ------------------------------------------------------------------------


def _read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
        return f.read().split("\n")[:-1]


@pytest.fixture(scope="module")
def shipped() -> dict[str, dict[str, list[str]]]:
    if not (DATA / "train.es.gz").exists():
        pytest.skip("data/bible has not been built")
    return {s: {k: _read(DATA / f"{s}.{k}.gz") for k in ("es", "en", "ref")} for s in bc.SPLITS}


def test_shipped_splits_are_line_aligned_and_clean(
    shipped: dict[str, dict[str, list[str]]],
) -> None:
    for split, files in shipped.items():
        assert len(files["es"]) == len(files["en"]) == len(files["ref"]) > 0, split
        for kind in ("es", "en", "ref"):
            assert all(line and line == line.strip() for line in files[kind]), (split, kind)
        for line in files["es"] + files["en"]:
            assert "<" not in line and ">" not in line, line
            assert "&amp;" not in line and "&quot;" not in line and "&#" not in line, line
            assert "  " not in line, line


def test_shipped_refs_are_unique_split_by_hash_and_exclude_blind_test_books(
    shipped: dict[str, dict[str, list[str]]],
) -> None:
    seen: set[str] = set()
    for split, files in shipped.items():
        refs = files["ref"]
        assert not seen & set(refs), split
        seen.update(refs)
        assert len(set(refs)) == len(refs)
        assert all(bc.split_of(r) == split for r in refs)
        assert not {bc.parse_ref(r).book for r in refs} & set(bc.BLIND_TEST_BOOKS)
    assert 400 <= len(shipped["dev"]["ref"]) <= 650
    assert 850 <= len(shipped["test"]["ref"]) <= 1200
    assert len(shipped["train"]["ref"]) > 25_000


def test_shipped_book_split_holds_its_books_whole_and_alone(
    shipped: dict[str, dict[str, list[str]]],
) -> None:
    books = {bc.parse_ref(r).book for r in shipped["books"]["ref"]}
    assert books == set(bc.BOOK_SPLIT_BOOKS)
    for split in ("train", "dev", "test"):
        assert not {bc.parse_ref(r).book for r in shipped[split]["ref"]} & books, split
    chapters = {(bc.parse_ref(r).book, bc.parse_ref(r).chapter) for r in shipped["books"]["ref"]}
    assert ("Lam", 5) in chapters and ("1Pet", 5) in chapters and ("Esth", 10) in chapters
    assert 800 <= len(shipped["books"]["ref"]) <= 1200


def test_shipped_corpus_keeps_known_verses(shipped: dict[str, dict[str, list[str]]]) -> None:
    pairs = {
        r: (es, en)
        for files in shipped.values()
        for r, es, en in zip(files["ref"], files["es"], files["en"], strict=True)
    }
    assert pairs["Gen 1:1"] == (
        "EN el principio crió Dios los cielos y la tierra.",
        "In the beginning, God created the heavens and the earth.",
    )
    assert (
        pairs["Rev 22:21"][1] == "The grace of the Lord Jesus Christ be with all the saints. Amen."
    )
    assert pairs["Ps 51:1"][0].startswith("Al Músico principal: Salmo de David")
    assert pairs["Ps 51:1"][1].startswith("For the Chief Musician. A Psalm by David")
    for shifted in ("Num 13:1", "1Sam 24:1", "Hos 12:1"):
        assert shifted not in pairs
