"""Property-based tests of the two readers of user input: the config loader and the corpus
reader. Whatever they are given, they return a result or raise their one error type
(ConfigError, DataError), never another exception."""

from __future__ import annotations

import gzip
import json
import math
import re
import tempfile
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from nmt.config import CONTENT_SCORES, SCORES, Config, apply_override, from_dict, load, to_yaml
from nmt.config import ConfigError as _ConfigError  # the same class as nmt.errors.ConfigError
from nmt.errors import ConfigError, DataError

assert _ConfigError is ConfigError

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


# ----------------------------------------------------------------------------- the schema


def _schema(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, typing.Any]:
    """Dotted key -> pydantic FieldInfo for every leaf of the config."""
    out: dict[str, typing.Any] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_schema(annotation, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


SCHEMA = _schema()
SECTIONS = sorted({part for key in SCHEMA for part in key.split(".")[:-1]})
NAMES = sorted({key.split(".")[-1] for key in SCHEMA} | set(SECTIONS))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


def _bounds(field: typing.Any) -> dict[str, typing.Any]:
    bounds: dict[str, typing.Any] = {}
    for rule in field.metadata:
        for attr, key, exclusive in (
            ("ge", "min_value", False),
            ("gt", "min_value", True),
            ("le", "max_value", False),
            ("lt", "max_value", True),
        ):
            if hasattr(rule, attr):
                bounds[key] = getattr(rule, attr)
                if exclusive:
                    bounds["exclude_min" if key == "min_value" else "exclude_max"] = True
    return bounds


def _valid_value(key: str, field: typing.Any) -> st.SearchStrategy:
    """Values the schema accepts for one key (cross-field rules aside)."""
    if key == "model.attention.score":
        return st.sampled_from(SCORES)
    if key == "model.attention.local_score":
        return st.sampled_from(CONTENT_SCORES)
    annotation = field.annotation
    optional = type(None) in typing.get_args(annotation)
    if optional:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    bounds = _bounds(field)
    if typing.get_origin(annotation) is typing.Literal:
        strategy: st.SearchStrategy = st.sampled_from(typing.get_args(annotation))
    elif annotation is bool:
        strategy = st.booleans()
    elif annotation is int:
        strategy = st.integers(
            min_value=bounds.get("min_value", -(2**40)), max_value=bounds.get("max_value", 2**40)
        )
    elif annotation is float:
        strategy = st.floats(allow_nan=False, allow_infinity=False, **bounds)
    else:
        strategy = TEXT
    return st.one_of(st.none(), strategy) if optional else strategy


@st.composite
def valid_raw_configs(draw: st.DrawFn) -> dict:
    """Nested dicts of some keys, each with a value its type and range allow."""
    keys = draw(st.lists(st.sampled_from(sorted(SCHEMA)), max_size=12, unique=True))
    raw: dict = {}
    for key in keys:
        node = raw
        *sections, name = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = draw(_valid_value(key, SCHEMA[key]))
    return raw


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    TEXT,
    st.sampled_from(["luong", "dot", "general", "lstm", "hub", "1e-3", "null", ""]),
)
KEYS = st.one_of(st.sampled_from(NAMES), TEXT, st.integers(), st.none(), st.booleans())
ANY_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
RAW_DICTS = st.one_of(
    st.dictionaries(KEYS, ANY_VALUES, max_size=4),
    st.dictionaries(
        st.sampled_from(SECTIONS), st.dictionaries(st.sampled_from(NAMES), ANY_VALUES), max_size=4
    ),
    valid_raw_configs(),
)

YAML_PIECES = [
    *NAMES[:20],
    "model",
    "training",
    "data",
    ":",
    ": ",
    "\n",
    "\n  ",
    "  ",
    "\t",
    "-",
    "- ",
    "[",
    "]",
    "{",
    "}",
    ",",
    "&a ",
    "*a",
    "<<: *a",
    "!!python/object:os.system",
    "!!binary ",
    "? ",
    "|",
    ">",
    "'",
    '"',
    "#",
    "%YAML 1.1\n",
    "---\n",
    "...\n",
    "1",
    "1e-3",
    ".inf",
    "~",
    "null",
    "yes",
    "2020-01-01",
    "\\x",
    "\x00",
    "\ufeff",
]
YAML_TEXTS = st.one_of(
    TEXT,
    st.lists(st.one_of(st.sampled_from(YAML_PIECES), TEXT), max_size=30).map("".join),
    valid_raw_configs().map(lambda raw: yaml.safe_dump(raw, sort_keys=False)),
    st.integers(1, 3000).map(lambda depth: "a: " + "[" * depth),  # deep nesting
)


@SETTINGS
@given(YAML_TEXTS)
def test_any_yaml_text_loads_or_is_a_config_error(text: str) -> None:
    with workdir() as root:
        path = root / "config.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            config = load(path)
        except ConfigError as exc:
            assert str(exc).startswith(str(path)) and "\n" not in str(exc).strip()
        else:
            assert isinstance(config, Config)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_load_or_are_a_config_error(data: bytes) -> None:
    with workdir() as root:
        path = root / "config.yaml"
        path.write_bytes(data)
        try:
            load(path)
        except ConfigError:
            pass


@SETTINGS
@given(RAW_DICTS)
def test_any_nested_dict_validates_or_is_a_config_error(raw: dict) -> None:
    try:
        config = from_dict(raw)
    except ConfigError as exc:
        assert str(exc).startswith("config: ")
    else:
        assert isinstance(config, Config)


OVERRIDE_KEYS = st.one_of(
    st.sampled_from(sorted(SCHEMA)),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=4).map(".".join),
    TEXT,
)
OVERRIDE_VALUES = st.one_of(
    TEXT,
    st.sampled_from(["3", "-1", "1e-4", "null", "[1, 2]", "{a: 1}", "luong", "[", "'", ""]),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
)
OVERRIDES = st.one_of(
    st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES).map("=".join),
    TEXT,
)


@SETTINGS
@given(RAW_DICTS, st.lists(OVERRIDES, max_size=4))
def test_any_overrides_apply_or_are_a_config_error(raw: dict, overrides: list[str]) -> None:
    try:
        for override in overrides:
            apply_override(raw, override)
        config = from_dict(raw)
    except ConfigError:
        pass
    else:
        assert isinstance(config, Config)


@SETTINGS
@given(valid_raw_configs())
def test_resolved_config_round_trips_through_yaml(raw: dict) -> None:
    try:
        config = from_dict(raw)
    except ConfigError:  # a cross-field rule (sizes, scores) the draw did not respect
        return
    text = to_yaml(config)
    assert from_dict(yaml.safe_load(text)) == config
    with workdir() as root:
        path = root / "resolved.yaml"
        path.write_text(text, encoding="utf-8")
        assert load(path) == config


NUMERIC_KEYS = sorted(
    key
    for key, field in SCHEMA.items()
    if {int, float} & {field.annotation, *typing.get_args(field.annotation)}
)
FLOAT_KEYS = [
    key
    for key in NUMERIC_KEYS
    if float in {SCHEMA[key].annotation, *typing.get_args(SCHEMA[key].annotation)}
]


def _nested(key: str, value: object) -> dict:
    *sections, name = key.split(".")
    raw: dict = {name: value}
    for section in reversed(sections):
        raw = {section: raw}
    return raw


@SETTINGS
@given(
    st.sampled_from(NUMERIC_KEYS),
    st.one_of(st.booleans(), st.integers(-5, 5).map(str), st.sampled_from(["1e-3", "0.5", ""])),
)
def test_numbers_are_never_coerced_from_booleans_or_strings(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        from_dict(_nested(key, value))


@SETTINGS
@given(st.sampled_from(FLOAT_KEYS), st.sampled_from([math.inf, -math.inf, math.nan]))
def test_no_float_key_takes_an_infinity_or_nan(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        from_dict(_nested(key, value))


@SETTINGS
@given(valid_raw_configs(), st.data())
def test_a_key_twice_in_a_mapping_is_an_error_naming_its_line(
    raw: dict, data: st.DataObject
) -> None:
    text = yaml.safe_dump(raw or {"training": {"epochs": 2}}, sort_keys=False)
    lines = text.splitlines()
    top = [n for n, line in enumerate(lines) if line and not line.startswith(" ")]
    first = data.draw(st.sampled_from(top))
    end = first + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    doubled = lines + lines[first:end]  # the section (or top-level key) again, at the end
    with workdir() as root:
        path = root / "config.yaml"
        path.write_text("\n".join(doubled) + "\n", encoding="utf-8")
        with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}:{len(lines) + 1}:"):
            load(path)


# ----------------------------------------------------------------------------- corpora

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


def _read(fmt: str, files: dict[str, bytes], errors: str, cached: bool) -> int:
    """read_pairs over the files; returns the pair count, checking the columns agree."""
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
        return len(rows)


def _lines(data: bytes) -> int:
    """Lines as nmt counts them: ended by \\n, plus a last one without it."""
    return data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))


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
        count = _read("text", {"train.es": src, "train.en": trg}, errors, cached)
    except DataError:  # only for a reason: unequal line counts or (strict) invalid UTF-8
        strict_failure = errors == "strict" and not (_utf8(src) and _utf8(trg))
        assert _lines(src) != _lines(trg) or strict_failure
    else:
        assert count == _lines(src) == _lines(trg)  # a line ends at \\n and nowhere else


@SETTINGS
@given(CORPUS_BYTES, st.booleans())
def test_text_with_replace_never_fails_on_encoding(data: bytes, cached: bool) -> None:
    assert _read("text", {"train.es": data, "train.en": data}, "replace", cached) == _lines(data)


@SETTINGS
@given(CORPUS_BYTES, st.sampled_from(["strict", "replace"]), st.booleans())
def test_any_tsv_reads_or_is_a_data_error(data: bytes, errors: str, cached: bool) -> None:
    try:
        _read("tsv", {"train.tsv": data}, errors, cached)
    except DataError:
        pass


@SETTINGS
@given(JSONL_BYTES, st.sampled_from(["strict", "replace"]), st.booleans())
def test_any_jsonl_reads_or_is_a_data_error(data: bytes, errors: str, cached: bool) -> None:
    try:
        _read("jsonl", {"train.jsonl": data}, errors, cached)
    except DataError:
        pass


@SETTINGS
@given(st.binary(max_size=80), st.booleans())
def test_any_gzip_member_reads_or_is_a_data_error(data: bytes, compress: bool) -> None:
    payload = gzip.compress(data) if compress else data
    try:
        _read("text", {"train.es.gz": payload, "train.en": data}, "replace", False)
    except DataError:
        assert not compress  # a real gzip file of any bytes reads (errors: replace)
