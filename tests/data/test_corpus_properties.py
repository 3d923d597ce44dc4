"""Property-based tests of the corpus readers (text pairs, TSV, JSONL, gzip): valid files read
as written; whatever else they are given, they return pairs or raise DataError for a reason the
input has, never another exception."""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nmt.errors import DataError
from nmt.files import refuse_compressed

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


LINE_PIECES = [
    b"\n",
    b"\r\n",
    b"\r",
    b"\t",
    b" ",
    b"hola",
    b"\xc3\xa1",  # a valid two-byte character
    b"\xc3",  # half of one
    b"\xff",
    b"\xef\xbb\xbf",  # a byte-order mark
    b"\xe2\x80\xa8",  # U+2028, a line separator that is not a line end
    b"\x00",
    b"{",
    b"}",
    b'"es"',
    b'"en"',
    b'"translation"',
    b":",
    b",",
    b'"x"',
    b'"\\ud800"',  # a JSON escape of a lone surrogate
    b"null",
    b"1",
    b"[",
    b"]",
]
CORPUS_BYTES = st.one_of(
    st.binary(max_size=120),
    st.lists(st.sampled_from(LINE_PIECES), max_size=30).map(b"".join),
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=8), st.booleans()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=2),
        st.dictionaries(st.sampled_from(["es", "en", "translation", "x"]), inner, max_size=3),
    ),
    max_leaves=6,
)
JSONL_BYTES = st.one_of(
    CORPUS_BYTES,
    st.lists(JSON_VALUES.map(json.dumps), max_size=5).map(
        lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")
    ),
)


def _read(
    fmt: str, files: dict[str, bytes], errors: str, cached: bool
) -> tuple[list[str], list[str]]:
    """read_pairs over the files; returns the sources and targets, checking the columns agree."""
    from nmt.config import DataConfig
    from nmt.data.corpus import read_pairs

    with workdir() as root:
        for name, data in files.items():
            (root / name).write_bytes(data)
        split = str(root / ("train" if fmt == "text" else f"train.{fmt}"))
        cfg = DataConfig(format=fmt, utf8_errors=errors, train=split)
        rows = read_pairs(cfg, split, root / "cache" if cached else None)
        src, trg = list(rows["src"]), list(rows["trg"])
        assert len(src) == len(trg) == len(rows)
        assert all(isinstance(s, str) and isinstance(t, str) for s, t in zip(src, trg, strict=True))
        # a CRLF line's \r goes; a \r inside a line (before a TSV tab, or escaped in a JSON
        # string) is the text's own
        ends = {"text": src + trg, "tsv": trg, "jsonl": []}[fmt]
        assert not any(line.endswith("\r") for line in ends)
        return src, trg


def _text_lines(data: bytes) -> list[str]:
    """The lines nmt reads from a file, decoded with replacement, without \\n or a final \\r."""
    lines = data.decode("utf-8", "replace").split("\n")
    if data.endswith(b"\n") or not data:
        lines.pop()
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return [line.rstrip("\r") for line in lines]


def _lines(data: bytes) -> int:
    """Lines as nmt counts them: ended by \\n, plus a last one without it."""
    return data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))


def _compressed(data: bytes) -> bool:
    """The bytes start as a compressed file does, which nmt refuses to read as text."""
    try:
        refuse_compressed("input", data)
    except DataError:
        return True
    return False


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@SETTINGS
@given(CORPUS_BYTES, CORPUS_BYTES, st.sampled_from(["strict", "replace"]), st.booleans())
def test_any_text_pair_reads_or_is_a_data_error(
    src: bytes, trg: bytes, errors: str, cached: bool
) -> None:
    try:
        count = len(_read("text", {"train.es": src, "train.en": trg}, errors, cached)[0])
    except DataError:  # only for a reason: unequal line counts, (strict) invalid UTF-8, or
        # a compressed file's header
        strict_failure = errors == "strict" and not (_utf8(src) and _utf8(trg))
        compressed = _compressed(src) or _compressed(trg)
        assert _lines(src) != _lines(trg) or strict_failure or compressed
    else:
        assert count == _lines(src) == _lines(trg)  # a line ends at \\n and nowhere else


@SETTINGS
@given(CORPUS_BYTES, st.booleans())
def test_text_with_replace_never_fails_on_encoding(data: bytes, cached: bool) -> None:
    assume(not _compressed(data))  # (refused: compressed files are no text)
    sources, _ = _read("text", {"train.es": data, "train.en": data}, "replace", cached)
    assert len(sources) == _lines(data)


@SETTINGS
@given(CORPUS_BYTES, st.sampled_from(["strict", "replace"]), st.booleans())
def test_any_tsv_reads_or_is_a_data_error(data: bytes, errors: str, cached: bool) -> None:
    lines = _text_lines(data)
    fields = [line.split("\t") for line in lines]
    try:
        src, trg = _read("tsv", {"train.tsv": data}, errors, cached)
    except DataError as exc:
        if "not valid UTF-8" in str(exc):
            assert errors == "strict" and not _utf8(data)
        elif "-compressed" in str(exc):
            assert _compressed(data)
        else:  # a line that is not blank has no tab or several
            assert "expected 2 tab-separated fields" in str(exc)
            assert any(len(f) != 2 and line.strip() for f, line in zip(fields, lines, strict=True))
    else:
        assert errors == "replace" or _utf8(data)
        assert all(len(f) == 2 or not line.strip() for f, line in zip(fields, lines, strict=True))
        assert src == [f[0] for f in fields]
        assert trg == [f[1] if len(f) == 2 else "" for f in fields]


TEXTS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
BLANK = st.sampled_from(["", " ", "\t", " \r"])  # lines that hold no pair
FIELDS = TEXTS.map(lambda text: re.sub("[\t\n\r\ufeff]", "", text))


@SETTINGS
@given(st.lists(st.one_of(st.tuples(FIELDS, FIELDS), BLANK), max_size=5), st.booleans())
def test_valid_tsv_reads_as_written(lines: list, cached: bool) -> None:
    """A blank line is a source of its own whitespace and an empty target."""
    lines = [line.replace("\t", "") if isinstance(line, str) else line for line in lines]
    data = "".join((line if isinstance(line, str) else "\t".join(line)) + "\n" for line in lines)
    pairs = [(line.rstrip("\r"), "") if isinstance(line, str) else line for line in lines]
    src, trg = _read("tsv", {"train.tsv": data.encode("utf-8")}, "strict", cached)
    assert list(zip(src, trg, strict=True)) == pairs


def _jsonl_record(pair: tuple[str, str, bool]) -> dict:
    source, target, nested = pair
    return {"translation": {"es": source, "en": target}} if nested else {"es": source, "en": target}


@SETTINGS
@given(
    st.lists(st.one_of(st.tuples(TEXTS, TEXTS, st.booleans()).map(_jsonl_record), BLANK)),
    st.sampled_from(["strict", "replace"]),
    st.booleans(),
)
def test_valid_jsonl_reads_as_written(lines: list, errors: str, cached: bool) -> None:
    data = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    pairs = [line.get("translation", line) for line in lines if isinstance(line, dict)]
    src, trg = _read("jsonl", {"train.jsonl": data.encode("utf-8")}, errors, cached)
    assert src == [pair["es"] for pair in pairs] and trg == [pair["en"] for pair in pairs]


JSONL_ERRORS = (
    "not valid UTF-8",
    "not valid JSON",
    "expected a JSON object",
    "no fields 'es' and 'en'",
    "expected a string",
    "unpaired surrogate escape",
)


@SETTINGS
@given(JSONL_BYTES, st.sampled_from(["strict", "replace"]), st.booleans())
def test_any_jsonl_reads_or_is_a_data_error(data: bytes, errors: str, cached: bool) -> None:
    try:
        src, _ = _read("jsonl", {"train.jsonl": data}, errors, cached)
    except DataError as exc:  # names the line and what is wrong with it (or the header)
        if _compressed(data):
            assert "-compressed" in str(exc)
            return
        assert re.match(r".*train\.jsonl:[0-9]+: ", str(exc)), str(exc)
        assert any(reason in str(exc) for reason in JSONL_ERRORS), str(exc)
    else:  # a pair from each line that is not blank
        assert len(src) == sum(1 for line in _text_lines(data) if line.strip())


@SETTINGS
@given(st.binary(max_size=80), st.booleans())
def test_any_gzip_member_reads_or_is_a_data_error(data: bytes, compress: bool) -> None:
    payload = gzip.compress(data) if compress else data
    try:
        _read("text", {"train.es.gz": payload, "train.en": data}, "replace", False)
    except DataError:
        # a real gzip file of any bytes reads (errors: replace), unless they are compressed
        assert not compress or _compressed(data)
