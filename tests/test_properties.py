"""Property-based tests of the config loader: valid configs and overrides load with their
values and round-trip through YAML; whatever else it is given, it raises ConfigError (one line,
naming the problem), never another exception. The corpus readers have their own, in
tests/data/test_corpus_properties.py."""

from __future__ import annotations

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
from schemakeys import leaf_keys

from nmt.config import (
    Config,
    apply_override,
    from_dict,
    load,
    to_yaml,
)
from nmt.config import ConfigError as _ConfigError  # the same class as nmt.errors.ConfigError
from nmt.errors import ConfigError
from nmt.model import registry

SCORES = tuple(registry.SCORES)  # the shipped names, aliases included
CONTENT_SCORES = tuple(registry.content_scores())
DECODER_STYLES = tuple(registry.DECODERS)

assert _ConfigError is ConfigError

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


# ----------------------------------------------------------------------------- the schema


SCHEMA = leaf_keys()
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


# Strings that YAML would read as something else unless quoted.
TRICKY = st.sampled_from(["1e3", "-2E-5", "1_000", "0x1F", "null", "~", "yes", "2020-01-01", ""])
SPLIT_NAMES = st.from_regex(r"[A-Za-z0-9_-]{1,8}", fullmatch=True).filter(
    lambda name: name not in ("train", "dev", "test")
)
# The keys that rules between keys read (Config's checks); a draw of the others always loads.
CROSS_KEYS = {
    *(f"model.attention.{k}" for k in ("score", "local_score", "heads", "scale", "coverage")),
    *(f"model.encoder.{k}" for k in ("hidden_size", "bidirectional", "layers")),
    *(f"model.decoder.{k}" for k in ("hidden_size", "layers", "init", "style", "output_size")),
    *(f"model.{k}" for k in ("embedding_size", "tie_embeddings", "alignment_head")),
    *(f"model.{k}" for k in ("alignment_head_joint", "alignment_head_context")),
    *(f"tokenizer.{k}" for k in ("type", "sampling_alpha", "sampling_nbest", "model")),
    *(f"training.{k}" for k in ("freeze", "guided_alignment", "decay_hold", "schedule")),
    "training.init_from",
    "data.format",
    "data.hub_name",
}


def _valid_value(
    key: str, field: typing.Any, text: st.SearchStrategy[str] = TEXT
) -> st.SearchStrategy:
    """Values the schema accepts for one key (cross-field rules aside)."""
    names = {
        "model.attention.score": SCORES,
        "model.attention.local_score": CONTENT_SCORES,
        "model.decoder.style": DECODER_STYLES,
    }
    if key in names:
        return st.sampled_from(names[key])
    if key == "decoding.workers":  # a number of threads, or auto (checked by the section)
        return st.one_of(st.just("auto"), st.integers(min_value=1, max_value=2**40))
    annotation = field.annotation
    optional = type(None) in typing.get_args(annotation)
    if optional:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    bounds = _bounds(field)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        strategy: st.SearchStrategy = st.sampled_from(typing.get_args(annotation))
    elif origin is list:
        (item,) = typing.get_args(annotation)
        strategy = st.lists(st.sampled_from(typing.get_args(item)), max_size=4)
    elif origin is dict:
        strategy = st.dictionaries(SPLIT_NAMES, st.one_of(text, TRICKY), max_size=3)
    elif annotation is bool:
        strategy = st.booleans()
    elif annotation is int:
        strategy = st.integers(
            min_value=bounds.get("min_value", -(2**40)), max_value=bounds.get("max_value", 2**40)
        )
    elif annotation is float:
        strategy = st.floats(allow_nan=False, allow_infinity=False, **bounds)
    else:
        assert annotation is str, key
        strategy = st.one_of(text, TRICKY)
    return st.one_of(st.none(), strategy) if optional else strategy


def _nested(key: str, value: object) -> dict:
    *sections, name = key.split(".")
    raw: dict = {name: value}
    for section in reversed(sections):
        raw = {section: raw}
    return raw


def _value_at(config: Config, key: str) -> object:
    value: typing.Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


@st.composite
def valid_raw_configs(draw: st.DrawFn, keys: typing.Sequence[str] = sorted(SCHEMA)) -> dict:
    """Nested dicts of some keys, each with a value its type and range allow."""
    chosen = draw(st.lists(st.sampled_from(keys), max_size=12, unique=True))
    raw: dict = {}
    for key in chosen:
        node = raw
        *sections, name = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = draw(_valid_value(key, SCHEMA[key]))
    return raw


FREE_KEYS = sorted(set(SCHEMA) - CROSS_KEYS)


def loadable_configs() -> st.SearchStrategy[dict]:
    """Nested dicts that every rule accepts: valid values of keys no rule between keys reads."""
    return valid_raw_configs(FREE_KEYS)


def _leaves(raw: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value of a nested dict of sections."""
    out: dict[str, object] = {}
    for name, value in raw.items():
        if f"{prefix}{name}" in SCHEMA:
            out[f"{prefix}{name}"] = value
        else:
            out.update(_leaves(value, f"{prefix}{name}."))
    return out


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
    st.integers(1, 1000).map(lambda depth: "a: " + "[" * depth),  # past the recursion limit
)


def _one_line_error(exc: ConfigError, source: str) -> None:
    assert str(exc).startswith(f"{source}:") and "\n" not in str(exc).strip()


def _loads_or_says_why(path: Path) -> None:
    """The file loads to a Config, or fails with one ConfigError line naming it."""
    try:
        config = load(path)
    except ConfigError as exc:
        _one_line_error(exc, str(path))
    else:
        assert isinstance(config, Config)


@SETTINGS
@given(YAML_TEXTS)
def test_any_yaml_text_loads_or_is_a_config_error(text: str) -> None:
    with workdir() as root:
        path = root / "config.yaml"
        path.write_text(text, encoding="utf-8")
        _loads_or_says_why(path)


@SETTINGS
@given(st.one_of(st.binary(max_size=200), st.text(" \n#", max_size=5).map(str.encode)))
def test_any_bytes_load_or_are_a_config_error(data: bytes) -> None:
    with workdir() as root:
        path = root / "config.yaml"
        path.write_bytes(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as bad:
            expected = (
                f"{path}: not UTF-8 text ({bad.reason} at byte {bad.start}); save it as UTF-8"
            )
            with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
                load(path)
            return
        if re.fullmatch(r"[ \n#]*", text):  # blank lines and comments
            with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: the config is empty"):
                load(path)
            return
        _loads_or_says_why(path)


@SETTINGS
@given(loadable_configs())
def test_valid_configs_load_with_their_values(raw: dict) -> None:
    config = from_dict(raw)
    for key, value in _leaves(raw).items():
        assert _value_at(config, key) == value, key


@SETTINGS
@given(RAW_DICTS)
def test_any_nested_dict_validates_or_is_a_config_error(raw: dict) -> None:
    unknown = [key for key in raw if isinstance(key, str) and key not in Config.model_fields]
    try:
        config = from_dict(raw)
    except ConfigError as exc:
        _one_line_error(exc, "config")
        message = str(exc)
        cut = re.search(r"(^config: |; )unknown keys .*, \.\.\. and \d+ more", message)
        for key in unknown:  # each named (quoted if not plain text), unless a long list was cut
            shown = key if key.isprintable() and key.strip() == key and key else repr(key)
            assert cut or re.search(
                rf"(^config: |; |, |keys ){re.escape(shown)}(:|,|;| \()", message
            )
    else:
        assert isinstance(config, Config) and not unknown


OVERRIDE_KEYS = st.one_of(
    st.sampled_from(sorted(SCHEMA)),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=4).map(".".join),
    TEXT,
)
OVERRIDE_VALUES = st.one_of(
    TEXT,
    st.sampled_from(["3", "-1", "1e-4", "null", "[1, 2]", "{a: 1}", "luong", "[", "'", ""]),
    # nesting on both sides of the depth where the YAML parser runs out of recursion (a few
    # hundred); deeper adds nothing but seconds (about 1.7 s at 3,000)
    st.integers(1, 1000).map(lambda depth: "[" * depth + "]" * depth),
)
OVERRIDES = st.one_of(
    st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES).map("=".join),
    TEXT,
)
# What a command line carries: no control characters, which YAML refuses in a stream.
PRINTABLE = st.text(st.characters(categories=("L", "M", "N", "P", "S", "Zs")), max_size=12)


@SETTINGS
@given(RAW_DICTS, st.lists(OVERRIDES, max_size=4))
def test_any_overrides_apply_or_are_a_config_error(raw: dict, overrides: list[str]) -> None:
    try:
        for override in overrides:
            apply_override(raw, override)
        config = from_dict(raw)
    except ConfigError as exc:
        assert str(exc).startswith(("--override ", "config: ")), str(exc)
    else:
        assert isinstance(config, Config)


@SETTINGS
@given(loadable_configs(), st.data())
def test_valid_overrides_set_their_keys(raw: dict, data: st.DataObject) -> None:
    keys = data.draw(st.lists(st.sampled_from(FREE_KEYS), min_size=1, max_size=4, unique=True))
    values = {key: data.draw(_valid_value(key, SCHEMA[key], PRINTABLE)) for key in keys}
    for key, value in values.items():  # JSON is YAML 1.2, as overrides are read
        apply_override(raw, f"{key}={json.dumps(value, ensure_ascii=False)}")
    config = from_dict(raw)
    for key, value in values.items():
        assert _value_at(config, key) == value, key


@SETTINGS
@given(st.one_of(TEXT.filter(lambda text: "=" not in text), TEXT.map(lambda text: f" ={text}")))
def test_an_override_without_a_key_is_an_error(override: str) -> None:
    expected = f"--override {override!r}: expected dotted.key=value"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        apply_override({}, override)


@SETTINGS
@given(st.lists(st.sampled_from([*NAMES[:5], "", " "]), min_size=2, max_size=4), TEXT)
def test_an_override_with_an_empty_part_is_an_error(parts: list[str], value: str) -> None:
    key = ".".join(parts)
    if all(part.strip() for part in parts):
        return
    with pytest.raises(ConfigError, match="has an empty part; expected dotted.key=value"):
        apply_override({}, f"{key}={value}")


@SETTINGS
@given(loadable_configs())
def test_resolved_config_round_trips_through_yaml(raw: dict) -> None:
    config = from_dict(raw)
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
