#!/usr/bin/env python3
"""Build the Spanish→English verse-aligned demo corpus from Debian's SWORD Bible modules.

Sources (both public domain), from Debian packages::

    apt-get update && apt-get install -y sword-text-sparv sword-text-web libsword-utils

* ``sword-text-sparv`` installs the SWORD module ``spaRV1909eb`` (Reina-Valera 1909, Spanish);
* ``sword-text-web`` installs ``engWEB2015eb`` (World English Bible, English);
* ``libsword-utils`` provides ``mod2imp``, which exports a module as "imp" text: a key line
  ``$$$Book C:V`` (e.g. ``$$$I Samuel 24:1``) followed by that entry's OSIS markup on the
  next line(s). Entries ``Book 0:0`` and ``Book C:0`` hold book and chapter intros, and a few
  keys such as ``$$$[ Module Heading ]`` are not verses at all.

Usage::

    python scripts/build_corpus.py --out data/bible
    python scripts/build_corpus.py --out data/bible --es-imp es.imp --en-imp en.imp

The second form reads exports made earlier with ``mod2imp spaRV1909eb > es.imp`` (and the same
for ``engWEB2015eb``), so the corpus can be rebuilt or tested without the Debian packages.

What the builder does, in order:

1. Converts each verse's OSIS markup to plain text (``osis_to_text``): footnotes and
   cross-references go with their content, non-canonical headings go, words inside ``<w>``
   and other inline elements stay, and words from neighbouring elements are never glued.
2. Cuts the subscription RV1909 appends to each Pauline epistle ("Fué escrita á los Hebreos
   desde Italia ...", ``strip_subscriptions``); the WEB has no such text.
3. Pairs verses by reference over the 66 books both modules share (the WEB's deuterocanon has
   no Spanish side) and drops pairs where either side is missing or empty.
4. Drops whole chapters whose verses do not line up between the two modules
   (``find_misaligned_chapters``): RV1909 keeps the Hebrew verse division in a few chapters,
   so pairing by reference there pairs each verse with its neighbour's translation.
5. Drops the few verses whose boundary with a neighbour lies elsewhere in the other
   translation (``find_moved_boundaries``).
6. Drops pairs whose length ratio, in characters, is above 3.
7. Holds out the blind-test books (Ruth, Jonah, Philemon, Jude, 2 John, 3 John): they are in
   no shipped split.
8. Puts the verses of twelve whole books (``BOOK_SPLIT_BOOKS``: Esther, Lamentations, Joel,
   Nahum, Habakkuk, Zephaniah, Haggai, 1 and 2 Thessalonians, Titus, James, 1 Peter) into
   the book split, ``books``, and splits the rest by a hash of the reference (``split_of``)
   into train, dev and test; writes ``{split}.es.gz``, ``{split}.en.gz`` and
   ``{split}.ref.gz``: one verse per line, line-aligned, gzip with mtime 0 so that rebuilds
   are byte-identical.
9. Builds the reference word alignment of dev, test and books from the Strong's numbers both
   modules tag their words with (``gold_for``; see data/README.md, "The reference
   alignment") and writes ``{dev,test,books}.align.gz``: Pharaoh links over the whitespace tokens
   of the shipped lines, ``i-j`` sure and ``i?j`` possible, an empty line for a verse left out.

Only the standard library and nmt's plain-Python function-word lists
(``nmt/function_words.py``) are used, so any ``python3`` (3.9 or newer) can run it from a
checkout.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import math
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nmt.function_words import content_mask  # noqa: E402 - plain Python, no dependencies

ES_MODULE = "spaRV1909eb"
EN_MODULE = "engWEB2015eb"
APT_HINT = "apt-get update && apt-get install -y sword-text-sparv sword-text-web libsword-utils"

# SWORD's English book names (as mod2imp writes them) -> OSIS book abbreviations, in canon order.
# fmt: off
BOOKS: dict[str, str] = {
    "Genesis": "Gen", "Exodus": "Exod", "Leviticus": "Lev", "Numbers": "Num",
    "Deuteronomy": "Deut", "Joshua": "Josh", "Judges": "Judg", "Ruth": "Ruth",
    "I Samuel": "1Sam", "II Samuel": "2Sam", "I Kings": "1Kgs", "II Kings": "2Kgs",
    "I Chronicles": "1Chr", "II Chronicles": "2Chr", "Ezra": "Ezra", "Nehemiah": "Neh",
    "Esther": "Esth", "Job": "Job", "Psalms": "Ps", "Proverbs": "Prov",
    "Ecclesiastes": "Eccl", "Song of Solomon": "Song", "Isaiah": "Isa", "Jeremiah": "Jer",
    "Lamentations": "Lam", "Ezekiel": "Ezek", "Daniel": "Dan", "Hosea": "Hos",
    "Joel": "Joel", "Amos": "Amos", "Obadiah": "Obad", "Jonah": "Jonah",
    "Micah": "Mic", "Nahum": "Nah", "Habakkuk": "Hab", "Zephaniah": "Zeph",
    "Haggai": "Hag", "Zechariah": "Zech", "Malachi": "Mal",
    "Matthew": "Matt", "Mark": "Mark", "Luke": "Luke", "John": "John", "Acts": "Acts",
    "Romans": "Rom", "I Corinthians": "1Cor", "II Corinthians": "2Cor", "Galatians": "Gal",
    "Ephesians": "Eph", "Philippians": "Phil", "Colossians": "Col",
    "I Thessalonians": "1Thess", "II Thessalonians": "2Thess", "I Timothy": "1Tim",
    "II Timothy": "2Tim", "Titus": "Titus", "Philemon": "Phlm", "Hebrews": "Heb",
    "James": "Jas", "I Peter": "1Pet", "II Peter": "2Pet", "I John": "1John",
    "II John": "2John", "III John": "3John", "Jude": "Jude", "Revelation of John": "Rev",
}
# fmt: on
BOOK_ORDER: dict[str, int] = {osis: i for i, osis in enumerate(BOOKS.values())}

# Short books kept out of every shipped split, for a blind test set built by the user.
BLIND_TEST_BOOKS: tuple[str, ...] = ("Ruth", "Jonah", "Phlm", "Jude", "2John", "3John")

# Whole books shipped as their own split, "books", none of their verses in train, dev or test:
# a test of text the model has never seen any part of (narrative, poetry, prophecy, letters).
BOOK_SPLIT_BOOKS: tuple[str, ...] = (
    "Esth", "Lam", "Joel", "Nah", "Hab", "Zeph", "Hag",
    "1Thess", "2Thess", "Titus", "Jas", "1Pet",
)  # fmt: skip

MAX_LENGTH_RATIO = 3.0
SPLIT_BUCKETS = 1000  # sha256(ref) mod 1000 ...
DEV_BUCKETS = 17  # ... below 17 -> dev (about 500 verses)
TEST_BUCKETS = 34  # ... 17 to 50 -> test (about 1,000 verses); the rest -> train
SPLITS: tuple[str, ...] = ("train", "dev", "test", "books")

# Chapter alignment check (see find_misaligned_chapters).
MAX_SHIFT = 2  # offsets tried: -2..+2 verses
SHIFT_GAIN = 0.75  # a shifted pairing must cost less than 75% of the by-reference pairing
SHIFT_COVERAGE = 0.75  # ... and pair at least 75% of the chapter's verses
MIN_SHIFT_OVERLAP = 4
MAX_CHAPTER_COST = 0.28  # about 2.6 times the median chapter's cost (0.11)
WINDOW = 5  # partly shifted chapters: a stretch of 5 verses ...
WINDOW_COST = 0.3  # ... costing more than this by reference ...
WINDOW_GAIN = 0.5  # ... and less than half of that one verse off
BOUNDARY_RATIO = 1.5  # moved verse boundaries: verses' lengths off by 1.5x on average ...
BOUNDARY_MIN_RATIO = 1.25  # ... each by more than 1.25x ...
BOUNDARY_SPAN_GAIN = 0.7  # ... and the span together off by less than 0.7 times the best one


# ---------------------------------------------------------------------------------------------
# References and the imp format
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class VerseRef:
    """A verse reference, ordered in canon order; ``str()`` gives ``"Gen 1:1"``."""

    book_index: int
    chapter: int
    verse: int
    book: str = field(compare=False)

    def __str__(self) -> str:
        return f"{self.book} {self.chapter}:{self.verse}"

    @property
    def chapter_key(self) -> tuple[str, int]:
        return (self.book, self.chapter)


_KEY_RE = re.compile(r"^(?P<book>.+?) (?P<chapter>\d+):(?P<verse>\d+)$")


def parse_imp(text: str) -> list[tuple[str, str]]:
    """Split mod2imp output into ``(key, markup)`` entries, in file order.

    A key line starts with ``$$$``; the markup is every line up to the next key line (in practice
    exactly one), joined with newlines.
    """
    entries: list[tuple[str, str]] = []
    key: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith("$$$"):
            if key is not None:
                entries.append((key, "\n".join(body)))
            key, body = line[3:].strip(), []
        elif key is not None:
            body.append(line)
    if key is not None:
        entries.append((key, "\n".join(body)))
    return entries


def parse_key(key: str) -> VerseRef | None:
    """Turn an imp key such as ``"I Samuel 24:1"`` into a VerseRef.

    Returns None for what is not a verse of the 66 shared books: headings (``[ Module Heading ]``),
    book and chapter intros (verse 0) and the WEB's deuterocanonical books.
    """
    match = _KEY_RE.match(key)
    if match is None or match["book"] not in BOOKS:
        return None
    chapter, verse = int(match["chapter"]), int(match["verse"])
    if chapter == 0 or verse == 0:
        return None
    osis = BOOKS[match["book"]]
    return VerseRef(BOOK_ORDER[osis], chapter, verse, osis)


def parse_ref(ref: str) -> VerseRef:
    """Parse a ``"Gen 1:1"`` reference as written to the ``.ref`` files."""
    book, _, chapter_verse = ref.rpartition(" ")
    chapter, verse = chapter_verse.split(":")
    return VerseRef(BOOK_ORDER[book], int(chapter), int(verse), book)


def imp_markup(text: str) -> dict[VerseRef, str]:
    """Map each verse of an imp export to its OSIS markup.

    A repeated key never extends a verse already read: the first entry wins.
    """
    verses: dict[VerseRef, str] = {}
    for key, markup in parse_imp(text):
        ref = parse_key(key)
        if ref is not None and ref not in verses:
            verses[ref] = markup
    return verses


def imp_verses(text: str) -> dict[VerseRef, str]:
    """Map each verse of an imp export to its plain text (see ``osis_to_text``)."""
    return {ref: osis_to_text(markup) for ref, markup in imp_markup(text).items()}


def export_module(module: str) -> str:
    """Run ``mod2imp MODULE`` and return its output."""
    if shutil.which("mod2imp") is None:
        sys.exit(f"mod2imp not found; install the SWORD packages first:\n  {APT_HINT}")
    result = subprocess.run(["mod2imp", module], capture_output=True, check=True)
    text = result.stdout.decode("utf-8")
    if "$$$" not in text:
        sys.exit(f"mod2imp {module} gave no entries; is the module installed?\n  {APT_HINT}")
    return text


# ---------------------------------------------------------------------------------------------
# OSIS markup -> plain text
# ---------------------------------------------------------------------------------------------

# Elements whose content is not verse text. Footnotes and cross-references (<note>) go whole,
# with the <reference>, <catchWord> and <rdg> inside them; <speaker> labels the speaker in the
# Song of Solomon; <title> is dropped unless canonical="true" (see _drops_content).
DROPPED_ELEMENTS: set[str] = {"note", "title", "speaker", "head", "figure", "index"}

# Inline elements whose edges are not word boundaries: RV1909 marks an added enclitic pronoun as
# "repartiéron<transChange>lo</transChange>", which must read "repartiéronlo".
INLINE_ELEMENTS: set[str] = set(
    "transChange hi q seg divineName foreign name reference rdg abbr catchWord a inscription"
    " mentioned date role placeName rf".split()
)

# Milestone <div>s opening a stretch that is not verse text until the matching eID.
NON_TEXT_DIV_TYPES: set[str] = {"glossary", "introduction", "front", "back", "preface"}

# No space is inserted at a word boundary after an opening mark or before a closing one.
NO_SPACE_AFTER = set("([{¿¡“‘«‹—–-/\u00a0")
NO_SPACE_BEFORE = set(".,;:!?)]}”’»›…—–-/\u00a0")

_TOKEN_RE = re.compile(r"<!--.*?-->|<[^<>]*>|[^<]+|<", re.DOTALL)
_TAG_RE = re.compile(r"<\s*(/?)\s*([A-Za-z_][\w:.-]*)(.*?)(/?)\s*>$", re.DOTALL)
_ATTR_RE = re.compile(r"""([\w:.-]+)\s*=\s*(?:"([^"]*)"|'([^']*)')""")


@dataclass
class Tag:
    """One parsed tag: ``name`` keeps the OSIS case (``transChange``, not ``transchange``)."""

    name: str
    attrs: dict[str, str]
    closing: bool = False
    empty: bool = False


def parse_tag(token: str) -> Tag | None:
    """Parse ``<name a="v">``, ``</name>`` or ``<name/>``; None for anything else (comments, ``<?``)."""
    match = _TAG_RE.match(token)
    if match is None:
        return None
    closing, name, rest, empty = match.groups()
    attrs = {
        m[1]: html.unescape(m[2] if m[2] is not None else m[3]) for m in _ATTR_RE.finditer(rest)
    }
    return Tag(name=name, attrs=attrs, closing=bool(closing), empty=bool(empty))


def tokenize(markup: str) -> Iterator[tuple[str, object]]:
    """Yield ``("tag", Tag)`` and ``("text", str)`` tokens.

    A small tokenizer rather than html.parser: a verse is a fragment that is not well-formed on
    its own (a ``<q>`` opened in one verse closes in a later one), html.parser lower-cases element
    names, and newer Pythons parse ``<title>`` as raw text, which would leak the ``<note>`` markup
    found inside some WEB titles. Text is unescaped (``&amp;``, ``&quot;``, ``&#8220;``) only
    after tokenizing, so an escaped ``&lt;`` can never start a tag. A stray ``<`` stays text.
    """
    for match in _TOKEN_RE.finditer(markup):
        token = match.group(0)
        if token.startswith("<!--"):
            continue
        if token.startswith("<") and token != "<":
            tag = parse_tag(token)
            if tag is not None:
                yield ("tag", tag)
            continue
        yield ("text", html.unescape(token))


def _drops_content(tag: Tag) -> bool:
    """Whether an element's content is left out of the verse text.

    Psalm superscriptions: the WEB marks them ``<title canonical="true" type="psalm">`` inside
    verse 1, and RV1909 has the same words as plain text at the start of verse 1, so canonical
    titles are kept to give both sides the same content. Every other title (section and book
    headings, "BOOK 1", acrostic headings that are not canonical) is dropped.
    """
    if tag.name == "title":
        return tag.attrs.get("canonical") != "true"
    return tag.name in DROPPED_ELEMENTS


class _TextBuilder:
    """Collects verse text, inserting a space at word boundaries only where one is needed.

    Trap: the WEB writes ``God</w><note>…</note><w>created``; with the note removed the two words
    would glue into "Godcreated". Every ``<w>`` edge, removed element and milestone therefore marks
    a boundary, and a boundary becomes a space unless there is whitespace already, the text before
    ends with an opening mark (``“``, ``¿``, ``(``, a dash) or the text after starts with closing
    punctuation (``word</w>.`` stays "word.").
    """

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.owners: list[int | None] = []  # per part: the <w> element it came from (0, 1, ...)
        self.boundary = False

    def mark_boundary(self) -> None:
        self.boundary = True

    def add(self, text: str, owner: int | None = None) -> None:
        if not text:
            return
        if self.boundary and self.parts:
            last, first = self.parts[-1][-1], text[0]
            if not (
                last.isspace()
                or first.isspace()
                or last in NO_SPACE_AFTER
                or first in NO_SPACE_BEFORE
            ):
                self.parts.append(" ")
                self.owners.append(None)
        self.boundary = False
        self.parts.append(text)
        self.owners.append(owner)

    def text(self) -> str:
        return normalize_space("".join(self.parts))

    def tokens(self) -> list[tuple[str, frozenset[int]]]:
        """The whitespace tokens of ``text()``, each with the ``<w>`` elements its characters
        came from: ``normalize_space`` replayed character by character."""
        chars = [
            (char, owner)
            for part, owner in zip(self.parts, self.owners)  # noqa: B905 - Python 3.9
            for char in part
            if char not in "\u200b\ufeff\u00ad"
        ]
        tokens: list[tuple[str, frozenset[int]]] = []
        word, owners = "", set()
        for char, owner in [*chars, (" ", None)]:
            if char.isspace():
                if word:
                    tokens.append((word, frozenset(owners)))
                word, owners = "", set()
                continue
            if not word and tokens and char in ".,;:!?)]":  # "coins ?" -> "coins?"
                word, merged = tokens.pop()
                owners = set(merged)
            word += char
            if owner is not None:
                owners.add(owner)
        return tokens


_SPACE_BEFORE_PUNCT_RE = re.compile(r" +(?=[.,;:!?)\]])")


def normalize_space(text: str) -> str:
    """Collapse every run of whitespace (also no-break and other Unicode spaces) to one space.

    Also removes a space left before closing punctuation where markup stood between them: the
    WEB writes ``coins</q> <note>…</note> <q>?``, which would read "coins ?".
    """
    text = text.replace("\u200b", "").replace("\ufeff", "").replace("\u00ad", "")
    return _SPACE_BEFORE_PUNCT_RE.sub("", " ".join(text.split()))


def osis_to_text(markup: str) -> str:
    """Convert one verse's OSIS markup to plain text (see ``convert``)."""
    return convert(markup)[0].text()


def convert(markup: str) -> tuple[_TextBuilder, list[str]]:
    """Convert one verse's OSIS markup to plain text.

    * ``<note>`` (footnotes and cross-references) is removed with all its content;
    * non-canonical ``<title>``, ``<speaker>`` and other headings are removed with their content;
    * ``<w>``, ``<transChange>``, ``<q>``, ``<hi>``, ``<seg>``, ``<divineName>``, ``<foreign>`` and
      other inline elements keep their text;
    * milestones and empty elements (``<milestone/>``, ``<lb/>``, ``<l sID/>``, ``<q marker/>``,
      ``<div sID/>``) add no text of their own (a ``marker`` is not text) but separate words;
    * text inside a glossary, introduction or front-matter ``<div sID/>`` … ``<div eID/>`` stretch
      is removed, and nothing after the end of a chapter or book (``<chapter eID/>``, ``<div
      type="book" eID/>``) belongs to the verse: the WEB appends its glossary to the markup of
      Revelation 22:21 that way, and osis2mod puts a following book's start there too;
    * entities are unescaped and whitespace is normalised.

    The markup of one verse need not be well-formed: an end tag with no start in this verse is
    ignored, and an element left open at the end simply ends with the verse.

    Returns the text builder, whose parts know the ``<w>`` element they came from, and each
    such element's ``lemma`` attribute (by the element's number).
    """
    out = _TextBuilder()
    lemmas: list[str] = []  # lemma of each <w lemma=...> element met, in order
    words: list[int] = []  # open <w lemma> elements (indices into lemmas)
    stack: list[tuple[str, bool]] = []  # open elements: (name, drops its content)
    skipped_divs: set[str] = set()  # sIDs of open non-text milestone divs
    dropping = 0  # how many open elements on the stack drop their content

    for kind, value in tokenize(markup):
        if kind == "text":
            if dropping == 0 and not skipped_divs:
                out.add(str(value), words[-1] if words else None)
            continue
        tag = value
        assert isinstance(tag, Tag)
        if _ends_verse(tag):
            break
        if tag.name == "div" and (tag.empty or "sID" in tag.attrs or "eID" in tag.attrs):
            _track_div(tag, skipped_divs)
            out.mark_boundary()
            continue
        is_boundary = tag.name not in INLINE_ELEMENTS
        if tag.empty:
            is_boundary = True  # a milestone never carries text, but separates words
        elif tag.closing:
            for depth in range(len(stack) - 1, -1, -1):
                if stack[depth][0].rstrip("*") == tag.name:
                    closed = stack[depth:]
                    dropping -= sum(1 for _, drops in closed if drops)
                    del stack[depth:]
                    del words[len(words) - sum(1 for name, _ in closed if name == "w*") :]
                    break
            else:
                is_boundary = True  # stray end tag: separate words, change nothing else
        else:
            drops = _drops_content(tag)
            name = tag.name
            if name == "w" and "lemma" in tag.attrs:
                name = "w*"  # an element that carries numbers
                words.append(len(lemmas))
                lemmas.append(tag.attrs["lemma"])
            stack.append((name, drops))
            dropping += drops
            is_boundary = is_boundary or drops
        if is_boundary:
            out.mark_boundary()
    return out, lemmas


def _ends_verse(tag: Tag) -> bool:
    """A chapter or book end milestone: what follows in this entry is not the verse's text."""
    if not (tag.empty and "eID" in tag.attrs):
        return False
    return tag.name == "chapter" or (tag.name == "div" and tag.attrs.get("type") == "book")


def _track_div(tag: Tag, skipped: set[str]) -> None:
    """Open or close a non-text milestone div (glossary, introduction, front matter)."""
    if tag.attrs.get("type") not in NON_TEXT_DIV_TYPES:
        return
    if "sID" in tag.attrs:
        skipped.add(tag.attrs["sID"])
    elif "eID" in tag.attrs:
        skipped.discard(tag.attrs["eID"])


# ---------------------------------------------------------------------------------------------
# Clean-up of whole verses
# ---------------------------------------------------------------------------------------------

# RV1909 ends each Pauline epistle with the Textus Receptus subscription, as plain text in the
# last verse: "... Amén. Fué escrita á los Hebreos desde Italia con Timoteo." The WEB has none.
PAULINE_EPISTLES: tuple[str, ...] = tuple(
    "Rom 1Cor 2Cor Gal Eph Phil Col 1Thess 2Thess 1Tim 2Tim Titus Phlm Heb".split()
)
_SUBSCRIPTION_RE = re.compile(r"^(?P<verse>.*\bAm[eé]n\.)\s+\S.*$", re.DOTALL)


def strip_subscriptions(verses: dict[VerseRef, str]) -> int:
    """Cut the subscription after the final "Amén." of each Pauline epistle's last verse.

    Changes ``verses`` in place and returns how many verses were cut.
    """
    last: dict[str, VerseRef] = {}
    for ref, text in verses.items():
        if text and ref.book in PAULINE_EPISTLES:
            last[ref.book] = max(last.get(ref.book, ref), ref)
    cut = 0
    for ref in last.values():
        match = _SUBSCRIPTION_RE.match(verses[ref])
        if match:
            verses[ref] = match["verse"]
            cut += 1
    return cut


# ---------------------------------------------------------------------------------------------
# Pairing and alignment checks
# ---------------------------------------------------------------------------------------------

Pair = tuple[VerseRef, str, str]
Link = tuple[int, int]
ChapterKey = tuple[str, int]
Chapter = dict[int, str]  # verse number -> text, non-empty verses only


def chapters_of(verses: dict[VerseRef, str]) -> dict[ChapterKey, Chapter]:
    """Group the non-empty verses of one module by chapter: ``{(book, ch): {verse: text}}``."""
    chapters: dict[ChapterKey, Chapter] = defaultdict(dict)
    for ref, text in verses.items():
        if text:
            chapters[ref.chapter_key][ref.verse] = text
    return chapters


def log_ratio(src: str, trg: str) -> float:
    """log(len(src) / len(trg)) in characters: 0 for equal lengths, symmetric around 0."""
    return math.log(len(src) / len(trg))


def length_cost(
    src: Chapter, trg: Chapter, offset: int, verses: Iterable[int] | None = None
) -> tuple[float, int]:
    """Mean |log_ratio(src[v], trg[v + offset])| over the verses both sides have.

    Returns ``(cost, overlap)``; the cost is infinite when fewer than MIN_SHIFT_OVERLAP verses
    overlap. Translations of the same verse have similar lengths and translations of
    neighbouring verses do not, so the right pairing of a chapter has the lowest cost (the
    median chapter paired by reference costs about 0.11).
    """
    logs = [
        abs(log_ratio(src[v], trg[v + offset]))
        for v in (src if verses is None else verses)
        if v in src and v + offset in trg
    ]
    if len(logs) < MIN_SHIFT_OVERLAP:
        return math.inf, len(logs)
    return sum(logs) / len(logs), len(logs)


def best_shift(src: Chapter, trg: Chapter) -> int:
    """The verse offset (``src v`` ↔ ``trg v + k``) that pairs a chapter best, or 0.

    A non-zero offset wins only if it costs clearly less (SHIFT_GAIN) than pairing by reference
    and still pairs most of the chapter (SHIFT_COVERAGE): in a short psalm, an offset of several
    verses leaves so few pairs that one of them can fit by chance.
    """
    base, _ = length_cost(src, trg, 0)
    best, best_cost = 0, base * SHIFT_GAIN
    for offset in range(-MAX_SHIFT, MAX_SHIFT + 1):
        cost, overlap = length_cost(src, trg, offset)
        if offset and overlap >= SHIFT_COVERAGE * len(src) and cost < best_cost:
            best, best_cost = offset, cost
    return best


def shifted_stretch(src: Chapter, trg: Chapter) -> int | None:
    """First verse of a stretch of WINDOW verses that pairs clearly better one verse off.

    Catches chapters where only the end is shifted (RV1909 1 Kings 22:43-53 follows the Hebrew
    division, squeezed back into the English count at the last verse), which the whole-chapter
    costs average away.
    """
    numbers = sorted(src)
    for i in range(len(numbers) - WINDOW + 1):
        window = numbers[i : i + WINDOW]
        base, _ = length_cost(src, trg, 0, window)
        if not base > WINDOW_COST:
            continue
        for offset in (-1, 1):
            cost, overlap = length_cost(src, trg, offset, window)
            if overlap >= WINDOW - 1 and cost < WINDOW_GAIN * base:
                return window[0]
    return None


def chapter_problem(src: Chapter, trg: Chapter) -> str | None:
    """Why pairing this chapter by verse number is unreliable, or None if it is fine.

    Trap: RV1909 keeps the Hebrew verse division in some chapters (Numbers 13 and 30,
    1 Samuel 24, Hosea 12, Jonah 2, Job 38-40, ...), while the module is in English (KJV)
    numbering. When the module was built, the extra verse was moved into its neighbour: the
    Spanish Jonah 1:17 is empty, its text is in Spanish 2:1, every later verse is one off, and
    the last verse of chapter 2 holds two. The WEB has such merges too (its Romans 14:24-26
    sit in 14:23). The checks, on non-empty verses:

    * ``verse numbers differ``: the modules have text under different verse numbers, so text
      has moved between verses (or one side leaves a verse out) somewhere in the chapter;
    * ``shifted by K``: the verse lengths line up clearly better K verses off (``best_shift``),
      which catches chapters whose numbers agree but where each verse holds its neighbour's text;
    * ``verse lengths disagree``: pairing by reference costs more than MAX_CHAPTER_COST although
      no single offset fits better: the division differs in part of the chapter (1 Chronicles 21);
    * ``partly shifted``: a stretch of the chapter pairs better one verse off (``shifted_stretch``).

    Chapters numbered differently as a whole (Malachi 4 = Hebrew Malachi 3:19-24, Joel
    2:28-3:21 = Hebrew 3-4) would show up as verses missing on one side plus a "verse numbers
    differ" chapter; both modules used here number those the English way.
    """
    if set(src) != set(trg):
        return f"verse numbers differ ({len(src)} es, {len(trg)} en)"
    shift = best_shift(src, trg)
    if shift:
        return f"shifted by {shift:+d}"
    cost, _ = length_cost(src, trg, 0)
    if math.isfinite(cost) and cost > MAX_CHAPTER_COST:
        return f"verse lengths disagree (cost {cost:.2f})"
    start = shifted_stretch(src, trg)
    if start is not None:
        return f"partly shifted from verse {start}"
    return None


def find_misaligned_chapters(
    es: dict[VerseRef, str], en: dict[VerseRef, str]
) -> dict[ChapterKey, str]:
    """Chapters (present in both modules) to drop whole, with the reason (``chapter_problem``)."""
    es_chapters, en_chapters = chapters_of(es), chapters_of(en)
    flagged: dict[ChapterKey, str] = {}
    for key in sorted(set(es_chapters) & set(en_chapters), key=chapter_order):
        problem = chapter_problem(es_chapters[key], en_chapters[key])
        if problem:
            flagged[key] = problem
    return flagged


def find_moved_boundaries(src: Chapter, trg: Chapter) -> set[int]:
    """Verses whose boundaries sit elsewhere in the other translation.

    Trap: a clause that one translation ends verse v with, the other starts verse v+1 with
    (Judges 14:19-20, 1 Samuel 10:25-26, Luke 7:18-19, Acts 11:25-26; over three verses in
    1 Chronicles 1:30-32). Each verse then pairs with part of its neighbour's translation,
    but the verses taken together match. A span of 2 or 3 verses is flagged when every verse
    is off (length ratio above BOUNDARY_MIN_RATIO), on average by more than BOUNDARY_RATIO,
    not all in the same direction, and the span as a whole is off by less than
    BOUNDARY_SPAN_GAIN times its best verse.
    """
    moved: set[int] = set()
    for first in sorted(src):
        for size in (2, 3):
            span = range(first, first + size)
            if not all(v in src and v in trg for v in span):
                break
            logs = [log_ratio(src[v], trg[v]) for v in span]
            sizes = [abs(x) for x in logs]
            whole = log_ratio("".join(src[v] for v in span), "".join(trg[v] for v in span))
            if (
                min(sizes) > math.log(BOUNDARY_MIN_RATIO)
                and sum(sizes) / size > math.log(BOUNDARY_RATIO)
                and min(logs) < 0 < max(logs)
                and abs(whole) < BOUNDARY_SPAN_GAIN * min(sizes)
            ):
                moved.update(span)
                break
    return moved


def chapter_order(key: ChapterKey) -> tuple[int, int]:
    return (BOOK_ORDER[key[0]], key[1])


def length_ratio(src: str, trg: str) -> float:
    """Ratio of the longer to the shorter side, in characters (inf if one side is empty)."""
    shorter, longer = sorted((len(src), len(trg)))
    return math.inf if shorter == 0 else longer / shorter


@dataclass
class PairingResult:
    pairs: list[Pair]
    dropped: Counter[str]
    misaligned: dict[ChapterKey, str]
    moved_boundaries: list[VerseRef]


def pair_verses(es: dict[VerseRef, str], en: dict[VerseRef, str]) -> PairingResult:
    """Pair verses by reference and apply every filter, counting what each one drops.

    Reasons, in the order they are applied (a verse is counted once, under the first):
    empty or missing on one side, misaligned chapter, verse boundary moved, length ratio above
    MAX_LENGTH_RATIO, blind-test book. A reference counts as a verse if either module has text
    for it.
    """
    misaligned = find_misaligned_chapters(es, en)
    es_chapters, en_chapters = chapters_of(es), chapters_of(en)
    moved: set[VerseRef] = set()
    for key in set(es_chapters) & set(en_chapters):
        if key not in misaligned:
            moved.update(
                VerseRef(BOOK_ORDER[key[0]], key[1], v, key[0])
                for v in find_moved_boundaries(es_chapters[key], en_chapters[key])
            )

    dropped: Counter[str] = Counter()
    pairs: list[Pair] = []
    for ref in sorted(r for r in set(es) | set(en) if es.get(r) or en.get(r)):
        src, trg = es.get(ref, ""), en.get(ref, "")
        if not src or not trg:
            dropped["empty or missing on one side"] += 1
        elif ref.chapter_key in misaligned:
            dropped["misaligned chapter"] += 1
        elif ref in moved:
            dropped["verse boundary moved"] += 1
        elif length_ratio(src, trg) > MAX_LENGTH_RATIO:
            dropped[f"length ratio > {MAX_LENGTH_RATIO:g} (characters)"] += 1
        elif ref.book in BLIND_TEST_BOOKS:
            dropped["blind-test book (held out)"] += 1
        else:
            pairs.append((ref, src, trg))
    return PairingResult(pairs, dropped, misaligned, sorted(moved))


# ---------------------------------------------------------------------------------------------
# The reference alignment, from Strong's numbers
# ---------------------------------------------------------------------------------------------

# The Hebrew object marker (et) has no translation; the WEB tags "the" with it.
UNTRANSLATED: frozenset[str] = frozenset({"H853"})
_STRONG_RE = re.compile(r"^(?:strong:)?([HG])0*(\d+)[A-Za-z]?$")
MIN_SHARED = 0.5  # a pair shares at least half of the numbers of its less tagged side ...
GOLD_SPLITS: tuple[str, ...] = ("dev", "test", "books")


def strong_numbers(lemma: str) -> frozenset[str]:
    """The Strong's numbers of a ``lemma`` attribute: ``"strong:H5315 H2416"`` gives
    {H5315, H2416} (only the first carries the prefix), leading zeros go (H07225 is H7225),
    Hebrew H and Greek G stay apart, other lemma schemes and H853 are left out."""
    numbers = set()
    for item in lemma.split():
        match = _STRONG_RE.match(item)
        if match:
            numbers.add(f"{match[1]}{int(match[2])}")
    return frozenset(numbers - UNTRANSLATED)


@dataclass
class TaggedVerse:
    """A verse's whitespace tokens, each with the ``<w>`` elements it came from, and each
    element's numbers; ``content`` marks the content words (``nmt.function_words``)."""

    tokens: list[str]
    elements: list[frozenset[int]]
    numbers: dict[int, frozenset[str]]
    content: list[bool]

    @property
    def all_numbers(self) -> frozenset[str]:
        return frozenset().union(*self.numbers.values()) if self.numbers else frozenset()

    def occurrences(self, number: str) -> list[list[int]]:
        """The tokens of each element (in order) that carries ``number`` and holds a content
        word; elements of function words alone do not count (they often carry a neighbour's
        number: the WEB tags "In" of "In the beginning" as "God")."""
        found = []
        for element in sorted(e for e, numbers in self.numbers.items() if number in numbers):
            tokens = [i for i, owners in enumerate(self.elements) if element in owners]
            if any(self.content[i] for i in tokens):
                found.append(tokens)
        return found


def tag_verse(markup: str, language: str) -> TaggedVerse:
    builder, lemmas = convert(markup)
    pairs = builder.tokens()
    tokens = [token for token, _ in pairs]
    numbers = {e: strong_numbers(lemma) for e, lemma in enumerate(lemmas)}
    return TaggedVerse(
        tokens, [owners for _, owners in pairs], numbers, content_mask(tokens, language)
    )


def link_verse(es: TaggedVerse, en: TaggedVerse) -> tuple[set[Link], set[Link]]:
    """(sure, possible) links between a verse's Spanish and English tokens.

    For each number both sides carry, its elements on each side (those with a content word):
    - as many on both sides: the k-th Spanish element goes with the k-th English one (verse
      order). A content word with a content word is sure when one of the two elements has a
      single content word ("principio" of "EN el principio" with "beginning"); every other
      pair of their tokens is possible ("EN", "el" with "beginning");
    - different counts (the number repeats unevenly): every pair of their tokens is possible.
    """
    sure: set[Link] = set()
    possible: set[Link] = set()
    for number in sorted(es.all_numbers & en.all_numbers):
        left, right = es.occurrences(number), en.occurrences(number)
        if len(left) == len(right):
            for a, b in zip(left, right):  # noqa: B905 - equal lengths; Python 3.9
                single = sum(es.content[i] for i in a) == 1 or sum(en.content[j] for j in b) == 1
                for i in a:
                    for j in b:
                        firm = single and es.content[i] and en.content[j]
                        (sure if firm else possible).add((i, j))
        else:
            possible.update((i, j) for a in left for b in right for i in a for j in b)
    return sure, possible - sure


def shared(es: TaggedVerse, en: TaggedVerse) -> float:
    """Numbers both carry, over those of the side with fewer (0 when one has none)."""
    left, right = es.all_numbers, en.all_numbers
    return len(left & right) / min(len(left), len(right)) if left and right else 0.0


def format_links(sure: set[Link], possible: set[Link]) -> str:
    links = [(i, j, "-") for i, j in sure] + [(i, j, "?") for i, j in possible]
    return " ".join(f"{i}{mark}{j}" for i, j, mark in sorted(links))


@dataclass
class Gold:
    """The reference alignment of one split: a line per verse (empty when dropped)."""

    lines: list[str]
    dropped: Counter[str]
    sure: int = 0
    possible: int = 0


def _verse_tokens(tagged: TaggedVerse, text: str) -> TaggedVerse | None:
    """The tagged tokens of a shipped line: all of them, or the first ones when the line was
    cut (an epistle's subscription); None when they do not spell the line."""
    count = len(text.split())
    if " ".join(tagged.tokens[:count]) != text:
        return None
    return TaggedVerse(
        tagged.tokens[:count], tagged.elements[:count], tagged.numbers, tagged.content[:count]
    )


def gold_for(pairs: Sequence[Pair], es: dict[VerseRef, str], en: dict[VerseRef, str]) -> Gold:
    """The reference alignment of ``pairs`` from the modules' markup (``es``, ``en``).

    A verse is dropped (an empty line) when its tokens do not spell the shipped text, when
    a side carries no number, or when the two share too few numbers or the English verse
    shares more with a neighbouring Spanish verse: where the WEB follows the Hebrew verse
    division, an English verse carries another verse's words.
    """
    gold = Gold([], Counter())
    for ref, src, trg in pairs:
        left = _verse_tokens(tag_verse(es[ref], "es"), src)
        right = _verse_tokens(tag_verse(en[ref], "en"), trg)
        reason = None
        if left is None or right is None:
            reason = "tokens do not spell the shipped text"
        elif not left.all_numbers or not right.all_numbers:
            reason = "a side carries no Strong's number"
        else:
            own = shared(left, right)
            near = [
                shared(tag_verse(es[other], "es"), right)
                for other in (
                    VerseRef(ref.book_index, ref.chapter, ref.verse + step, ref.book)
                    for step in (-1, 1)
                )
                if other in es
            ]
            if own < MIN_SHARED or any(score > own for score in near):
                reason = "numbers of another verse (verse division differs)"
        if reason or left is None or right is None:
            gold.dropped[reason or ""] += 1
            gold.lines.append("")
            continue
        sure, possible = link_verse(left, right)
        gold.sure += len(sure)
        gold.possible += len(possible)
        gold.lines.append(format_links(sure, possible))
    return gold


# ---------------------------------------------------------------------------------------------
# Splitting and writing
# ---------------------------------------------------------------------------------------------


def split_of(ref: str) -> str:
    """Assign a reference (``"Gen 1:1"``) to a split: a verse of a BOOK_SPLIT_BOOKS book to
    books, any other to train, dev or test by sha256(ref) mod 1000.

    Depends on nothing but the reference, so a verse stays in its split whatever else changes.
    """
    if ref.rpartition(" ")[0] in BOOK_SPLIT_BOOKS:
        return "books"
    bucket = int(hashlib.sha256(ref.encode("utf-8")).hexdigest(), 16) % SPLIT_BUCKETS
    if bucket < DEV_BUCKETS:
        return "dev"
    if bucket < DEV_BUCKETS + TEST_BUCKETS:
        return "test"
    return "train"


def split_pairs(pairs: Iterable[Pair]) -> dict[str, list[Pair]]:
    splits: dict[str, list[Pair]] = {name: [] for name in SPLITS}
    for pair in pairs:
        splits[split_of(str(pair[0]))].append(pair)
    return splits


def write_gzip_lines(path: Path, lines: Sequence[str]) -> None:
    """Write UTF-8 lines to a gzip file with mtime 0 and no file name: byte-identical rebuilds."""
    for line in lines:
        if "\n" in line or "\r" in line:
            raise ValueError(f"line break inside a line written to {path}: {line!r}")
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(data)


def write_splits(out_dir: Path, splits: dict[str, list[Pair]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        write_gzip_lines(out_dir / f"{name}.es.gz", [src for _, src, _ in pairs])
        write_gzip_lines(out_dir / f"{name}.en.gz", [trg for _, _, trg in pairs])
        write_gzip_lines(out_dir / f"{name}.ref.gz", [str(ref) for ref, _, _ in pairs])


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def report(
    result: PairingResult, splits: dict[str, list[Pair]], total: int, subscriptions: int
) -> str:
    """A human-readable summary: what was dropped and why, and the size of each split."""
    lines = [f"verses with text in either module: {total}"]
    lines.append(f"RV1909 epistle subscriptions cut: {subscriptions}")
    for reason, count in result.dropped.most_common():
        lines.append(f"  dropped, {reason}: {count}")
    lines.append(f"misaligned chapters ({len(result.misaligned)}):")
    for (book, chapter), why in sorted(
        result.misaligned.items(), key=lambda kv: chapter_order(kv[0])
    ):
        lines.append(f"  {book} {chapter}: {why}")
    moved = ", ".join(str(ref) for ref in result.moved_boundaries)
    lines.append(f"verses with a moved boundary ({len(result.moved_boundaries)}): {moved}")
    lines.append(f"{'split':<6} {'verses':>7} {'es words':>9} {'en words':>9}")
    for name, pairs in splits.items():
        es_words = sum(len(src.split()) for _, src, _ in pairs)
        en_words = sum(len(trg.split()) for _, _, trg in pairs)
        lines.append(f"{name:<6} {len(pairs):>7} {es_words:>9} {en_words:>9}")
    return "\n".join(lines)


def gold_report(golds: dict[str, Gold]) -> str:
    lines = ["reference alignment (Strong's numbers):"]
    for name, gold in golds.items():
        kept = sum(1 for line in gold.lines if line)
        lines.append(
            f"  {name}: {kept} of {len(gold.lines)} verses, {gold.sure} sure and "
            f"{gold.possible} possible links"
        )
        for reason, count in gold.dropped.most_common():
            lines.append(f"    dropped, {reason}: {count}")
    return "\n".join(lines)


def build(es_text: str, en_text: str, out_dir: Path) -> str:
    """Build the corpus and the dev, test and books reference alignments from two imp exports into
    ``out_dir``; return the report."""
    es_markup, en_markup = imp_markup(es_text), imp_markup(en_text)
    es = {ref: osis_to_text(markup) for ref, markup in es_markup.items()}
    en = {ref: osis_to_text(markup) for ref, markup in en_markup.items()}
    subscriptions = strip_subscriptions(es)
    result = pair_verses(es, en)
    splits = split_pairs(result.pairs)
    write_splits(out_dir, splits)
    golds = {name: gold_for(splits[name], es_markup, en_markup) for name in GOLD_SPLITS}
    for name, gold in golds.items():
        write_gzip_lines(out_dir / f"{name}.align.gz", gold.lines)
    total = sum(1 for r in set(es) | set(en) if es.get(r) or en.get(r))
    return report(result, splits, total, subscriptions) + "\n" + gold_report(golds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/bible"), help="output directory")
    parser.add_argument("--es-imp", type=Path, help=f"imp export of {ES_MODULE} (skips mod2imp)")
    parser.add_argument("--en-imp", type=Path, help=f"imp export of {EN_MODULE} (skips mod2imp)")
    parser.add_argument("--es-module", default=ES_MODULE, help="SWORD module for Spanish")
    parser.add_argument("--en-module", default=EN_MODULE, help="SWORD module for English")
    args = parser.parse_args(argv)
    if (args.es_imp is None) != (args.en_imp is None):
        parser.error("give both --es-imp and --en-imp, or neither")

    if args.es_imp is not None:
        es_text = args.es_imp.read_text(encoding="utf-8")
        en_text = args.en_imp.read_text(encoding="utf-8")
    else:
        es_text, en_text = export_module(args.es_module), export_module(args.en_module)
    print(build(es_text, en_text, args.out))
    print(
        f"written to {args.out}/{{{','.join(SPLITS)}}}.{{es,en,ref}}.gz and "
        f"{{{','.join(GOLD_SPLITS)}}}.align.gz"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
