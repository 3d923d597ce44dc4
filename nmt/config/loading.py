"""YAML text and ``--override`` values -> a validated ``Config``, and back to YAML.

Configs are read as YAML 1.2 reads them, a key twice in one mapping is an error, and every
problem pydantic finds becomes one line of one ``ConfigError``, as
``model.attention.score: got 'dott', expected one of ...``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from nmt import __version__
from nmt.config.schema import Config
from nmt.errors import ConfigError, listed

# More unknown keys than this are one problem that names a few (most likely a config for
# another nmt version), not a did-you-mean or a list of valid keys after each.
FEW_UNKNOWN = 3
VALID_SHOWN = 8  # valid keys named after an unknown key that has no close match


def load(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config file, apply ``--override`` values and validate."""
    raw = read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    if not raw:
        raise ConfigError(
            f"{path}: the config is empty; a config names at least its data (data.train, "
            f"data.dev) and its run directory (run.dir): start from configs/demo.yaml"
        )
    return from_dict(raw, str(path))


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with file and line in the error."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give the YAML config file inside it")
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; see configs/ for examples")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"{path}{line}: not valid YAML: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--override {override!r}: expected dotted.key=value")
    parts = key.strip().split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(
            f"--override {override!r}: {key.strip()!r} has an empty part; expected "
            f"dotted.key=value, e.g. training.epochs=3"
        )
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--override {override!r}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = parse_yaml(value) if value.strip() else None
    except (yaml.YAMLError, RecursionError):  # not YAML: the text itself
        node[parts[-1]] = value


def from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a nested dict; all problems reported in one ConfigError."""
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise _format_errors(exc, source) from None


def saved_config(raw: Any, path: Path, written_by: object) -> Config:
    """The config a checkpoint (or an export) at ``path`` holds, validated as ``from_dict``
    does. Keys this nmt does not know, in one written by a newer nmt (``written_by``: the
    version it records), are one short ConfigError that says so and to upgrade."""
    try:
        return from_dict(raw, f"{path} (saved config)")
    except ConfigError:
        unknown = unknown_keys(raw)
        if not unknown or not _newer(str(written_by), __version__):
            raise
        raise ConfigError(
            f"{path}: written by nmt {written_by}, newer than this nmt {__version__} "
            f"(unknown keys: {listed(unknown, 2)}); upgrade nmt to read it"
        ) from None


def unknown_keys(raw: Any, model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """The dotted keys of a nested dict that the schema does not have."""
    if not isinstance(raw, dict):
        return []
    out = []
    for key, value in raw.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            out.append(f"{prefix}{key}")
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += unknown_keys(value, field.annotation, f"{prefix}{key}.")
    return out


def _newer(version: str, than: str) -> bool:
    """Whether the release ``version`` comes after ``than`` (numbers compared, so 0.10 is
    after 0.9; anything after the numbers, such as a pre-release tag, is ignored)."""

    def numbers(text: str) -> tuple[int, ...] | None:
        match = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
        return tuple(int(part) for part in match.group(1).split(".")) if match else None

    mine, theirs = numbers(than), numbers(version)
    return mine is not None and theirs is not None and theirs > mine


def to_yaml(config: Config) -> str:
    """The resolved config, every key included, as YAML."""
    return yaml.dump(config.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False)


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    out: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in a:
                walk(a[key], b.get(key), f"{prefix}{key}.")
        elif a != b:
            out.append(prefix.rstrip("."))

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return out


class _Loader(yaml.SafeLoader):
    """YAML for configs: a key twice in one mapping is an error (PyYAML keeps the last), and
    numbers read as YAML 1.2 reads them (PyYAML's YAML 1.1 takes 1e-3 for a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} appears twice in one mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[no-untyped-call,no-any-return]


class _Dumper(yaml.SafeDumper):
    """YAML that _Loader reads back as written: a string such as 1e-3 is quoted."""


# YAML 1.2's floats without a dot (1e-3), read as numbers and so written in quotes as strings
_FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789"))
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_WITHOUT_DOT, list("-+0123456789"))


def parse_yaml(text: str) -> Any:
    """YAML text -> Python values, as configs and --override values are read."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def _format_errors(exc: ValidationError, source: str) -> ConfigError:
    """All of pydantic's errors as one line: the unknown keys first, then the other problems."""
    errors = exc.errors()
    unknown = [_loc(e) for e in errors if e["type"] == "extra_forbidden"]
    lines = _many_unknown(unknown) if len(unknown) > FEW_UNKNOWN else _few_unknown(unknown)
    lines += [_describe(e) for e in errors if e["type"] != "extra_forbidden"]
    return ConfigError(f"{source}: " + "; ".join(lines))


def _loc(error: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(part) for part in error["loc"])


def _dotted(loc: tuple[str, ...]) -> str:
    """A dotted key for a message; a part that is not plain text (a newline) is quoted."""
    return ".".join(p if p.isprintable() and p.strip() == p and p else repr(p) for p in loc)


def _few_unknown(keys: list[tuple[str, ...]]) -> list[str]:
    """Each unknown key with its closest match; those without one, a section's together,
    with that section's valid keys (once)."""
    lines: list[str] = []
    unmatched: dict[tuple[str, ...], list[str]] = {}
    for loc in keys:
        close = difflib.get_close_matches(loc[-1], _section_fields(loc[:-1]), n=1)
        if close:
            lines.append(f"{_dotted(loc)}: unknown key; did you mean '{close[0]}'?")
        else:
            unmatched.setdefault(loc[:-1], []).append(_dotted(loc))
    for section, names in unmatched.items():
        known = _section_fields(section)
        more = "; docs/config.md lists them all" if len(known) > VALID_SHOWN else ""
        plural = "s" if len(names) > 1 else ""
        lines.append(
            f"{', '.join(names)}: unknown key{plural}; valid keys: "
            f"{listed(known, VALID_SHOWN)}{more}"
        )
    return lines


def _many_unknown(keys: list[tuple[str, ...]]) -> list[str]:
    """Many unknown keys as one problem: the first few, and the closest match of some."""
    guesses = []
    for loc in keys:
        close = difflib.get_close_matches(loc[-1], _section_fields(loc[:-1]), n=1)
        if close:
            guesses.append(f"{_dotted((*loc[:-1], close[0]))} for {_dotted(loc)}")
    hint = f"; did you mean {listed(guesses, 2)}?" if guesses else ""
    names = listed(map(_dotted, keys), 4)
    return [
        f"unknown keys {names}{hint} (docs/config.md lists the valid keys; a config written "
        f"for a newer nmt needs that nmt)"
    ]


def _describe(error: Mapping[str, Any]) -> str:
    """One pydantic error (not an unknown key) as one line: the dotted key, the value and
    what is wrong."""
    where = _dotted(_loc(error))
    message = error["msg"]
    if error["type"] == "value_error":
        message = message.removeprefix("Value error, ")
        return message if not where else f"{where}.{message}"
    got = error.get("input")
    if isinstance(got, dict):
        return f"{where}: expected a mapping of keys; {message.lower()}"
    return f"{where}: got {got!r}; {message[0].lower()}{message[1:]}"


def _section_fields(path: tuple[str, ...]) -> list[str]:
    """Field names valid at a dotted location, for did-you-mean suggestions."""
    model: Any = Config
    for part in path:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
        if not issubclass(model, BaseModel):
            return []
    return list(model.model_fields)
