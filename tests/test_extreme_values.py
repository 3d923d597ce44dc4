"""Extreme numbers: 0, negative, huge (1e20, 1e308, 2^64), inf and nan, tried on every numeric
config key (the schema), every numeric option of every command (the Typer app) and every
numeric field of the server's requests (their schemas). Each is refused in one line that names
the key, option or field (the CLI: exit status 2), unless the tables below list it as
honoured, with the reason: never a silent wrong output (`--max-len-ratio 1e20` once wrote an
empty line for every sentence).

And errors name an option as whoever asked names it: `nmt translate --n-best`, the request's
``n_best`` field, the Python API's ``n_best`` keyword.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
from clirun import Result, nmt, tiny_config, write_config
from pydantic import BaseModel

from nmt.cli import app
from nmt.config import Config, from_dict
from nmt.errors import ConfigError

BAD = (0, -1, 1e20, 1e308, math.inf, math.nan, 2**64)
BAD_TEXT = ("0", "-1", "1e20", "1e308", "inf", "nan", str(2**64))

# --- the config schema ----------------------------------------------------------------------


def _numeric_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted config key whose type holds int or float (decoding.workers: int or auto)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _numeric_keys(annotation, f"{prefix}{name}.")
        elif {int, float} & (set(typing.get_args(annotation)) or {annotation}):
            keys.append(f"{prefix}{name}")
    return keys


NUMERIC_KEYS = _numeric_keys()

# The bad values a key takes, each because it means what it says: 0 turns a weight, a penalty,
# a warmup or an offset off (or is a valid seed); -1 is sampling among all segmentations; a huge
# workers is at most one thread per batch, and a huge clip_grad_norm is no clipping (null is
# the same as +inf there).
HONOURED_KEYS: dict[str, tuple[object, ...]] = {
    "tokenizer.sampling_nbest": (-1,),
    "model.embedding_dropout": (0,),
    "model.encoder.dropout": (0,),
    "model.decoder.dropout": (0,),
    "training.weight_decay": (0,),
    "training.clip_grad_norm": (1e20, 1e308, 2**64),
    "training.label_smoothing": (0,),
    "training.guided_alignment_weight": (0,),
    "training.decay_hold": (0,),
    "training.warmup_steps": (0,),
    "training.seed": (0,),
    "decoding.length_penalty": (0,),
    "decoding.max_len_offset": (0,),
    "decoding.no_repeat_ngram": (0,),
    "decoding.coverage_penalty": (0,),
    "decoding.shortlist_frequent": (0,),
    "decoding.workers": (2**64,),
}


def _nested(key: str, value: object) -> dict:
    *sections, name = key.split(".")
    raw: dict = {name: value}
    for section in reversed(sections):
        raw = {section: raw}
    return raw


def test_the_schema_has_the_numeric_keys_the_tables_name() -> None:
    assert len(NUMERIC_KEYS) > 50 and set(HONOURED_KEYS) <= set(NUMERIC_KEYS)


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("key", NUMERIC_KEYS)
def test_each_config_key_refuses_what_it_cannot_honour(key: str, value: object) -> None:
    """Each numeric key (in a config file, or a `train --override`) refuses each extreme value
    it cannot honour with an error naming it."""
    honoured = any(value is v or value == v for v in HONOURED_KEYS.get(key, ()))
    if honoured:
        from_dict(_nested(key, value))
        return
    with pytest.raises(ConfigError) as caught:
        from_dict(_nested(key, value), "c.yaml")
    assert f"{key}: got " in str(caught.value) or f"{key}: " in str(caught.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("decoding.max_len_ratio=1e20", "decoding.max_len_ratio"),
        ("decoding.max_len_ratio=1e308", "decoding.max_len_ratio"),
        ("decoding.beam_size=100000000000000000000", "decoding.beam_size"),
        ("tokenizer.sampling_nbest=1000", "tokenizer.sampling_nbest"),
        ("training.learning_rate=.nan", "training.learning_rate"),
        ("training.epochs=100000000000000000000", "training.epochs"),
        ("run.threads=100000000000000000000", "run.threads"),
    ],
)
def test_train_overrides_are_bounded(tmp_path: Path, corpus: Path, override: str, key: str) -> None:
    """`nmt train --override` reaches the same bounds: one line naming the key, status 2,
    nothing written."""
    path = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    result = nmt("train", str(path), "--run-dir", str(tmp_path / "run"), "--override", override)
    assert f"{key}: got " in result.error
    assert not (tmp_path / "run").exists()


# --- the command line -----------------------------------------------------------------------


def _numeric_options() -> list[tuple[str, str]]:
    """(command, --flag) of every option of every command whose type holds int or float, or
    that parses its own text (--workers: a number or auto)."""
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    found = []
    for info in app.registered_commands:
        assert info.callback is not None
        name = info.name or info.callback.__name__.rstrip("_")
        flags = {param.name: max(param.opts, key=len) for param in commands[name].params}
        hints = typing.get_type_hints(info.callback, include_extras=True)
        for parameter, hint in hints.items():
            if typing.get_origin(hint) is not typing.Annotated:
                continue
            base, *extras = typing.get_args(hint)
            option = next((e for e in extras if isinstance(e, typer.models.OptionInfo)), None)
            numeric = {int, float} & (set(typing.get_args(base)) or {base})
            if option is not None and (numeric or option.parser is not None):
                found.append((name, flags[parameter]))
    return found


NUMERIC_OPTIONS = _numeric_options()
HUGE = str(2**64)

# The extreme values an option takes, each because it means what it says: 0 turns a penalty,
# an offset or n-gram blocking off, or (--port) picks any free port, or (--batch-window-ms)
# does not wait; a huge cap (--batch-tokens, the server's --max-*) caps nothing, a huge
# --workers is one thread per batch.
HONOURED_OPTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("translate", "--max-len-offset"): ("0",),
    ("translate", "--length-penalty"): ("0",),
    ("translate", "--coverage-penalty"): ("0",),
    ("translate", "--no-repeat-ngram"): ("0",),
    ("translate", "--batch-tokens"): (HUGE,),
    ("translate", "--workers"): (HUGE,),
    ("score", "--length-penalty"): ("0",),
    ("score", "--coverage-penalty"): ("0",),
    ("eval", "--length-penalty"): ("0",),
    ("eval", "--coverage-penalty"): ("0",),
    ("eval", "--workers"): (HUGE,),
    ("serve", "--port"): ("0",),
    ("serve", "--max-sentences"): (HUGE,),
    ("serve", "--max-chars"): (HUGE,),
    ("serve", "--max-body"): (HUGE,),
    ("serve", "--max-beam"): (HUGE,),
    ("serve", "--max-batch"): (HUGE,),
    ("serve", "--batch-window-ms"): ("0",),
}


def test_the_app_has_the_numeric_options_the_tables_name() -> None:
    commands = {command for command, _ in NUMERIC_OPTIONS}
    assert {"translate", "score", "align", "average", "eval", "serve"} <= commands
    assert set(HONOURED_OPTIONS) <= set(NUMERIC_OPTIONS)


@pytest.fixture(scope="module")
def pair(corpus: Path) -> tuple[Path, Path]:
    source, target = corpus / "one.src", corpus / "one.trg"
    source.write_text("sol luna mar\n", encoding="utf-8")
    target.write_text("MAR LUNA SOL\n", encoding="utf-8")
    return source, target


def _run(
    command: str, option: str, value: str, run: Path, pair: tuple[Path, Path], tmp_path: Path
) -> Result:
    """``nmt COMMAND`` on the tiny run with ``option value``, the rest as a user types it."""
    source, target = (str(path) for path in pair)
    model = ["-m", str(run), "--device", "cpu"]
    rest = {
        "translate": [*model, "-i", source],
        "score": [*model, "-i", source, "-t", target],
        "align": [*model, "-i", source, "-t", target],
        "eval": [*model, "--json"],
        "average": ["--run", str(run), "-o", str(tmp_path / "averaged.pt")],
        "serve": model,
    }[command]
    return nmt(command, *rest, option, value)


@pytest.fixture()
def no_serving(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`nmt serve` builds its request and returns, instead of serving: the requests made."""
    from nmt.commands.serve import command as serve_command

    made: list[Any] = []
    monkeypatch.setattr(serve_command, "serve_command", lambda request, ready: made.append(request))
    return made


@pytest.mark.parametrize("value", BAD_TEXT)
@pytest.mark.parametrize(("command", "option"), NUMERIC_OPTIONS)
def test_each_option_refuses_what_it_cannot_honour(
    command: str,
    option: str,
    value: str,
    run: Path,
    pair: tuple[Path, Path],
    tmp_path: Path,
    no_serving: list[Any],
) -> None:
    """Every numeric option of every command refuses each extreme value it cannot honour:
    one line naming the option, status 2, no traceback; those it honours run (and write a
    translation, where they translate)."""
    result = _run(command, option, value, run, pair, tmp_path)
    if value in HONOURED_OPTIONS.get((command, option), ()):
        assert result.code == 0, result.err
        if command == "translate":
            assert result.out.strip(), "an empty translation"
        return
    assert option in result.error, result.err
    assert "Traceback" not in result.err


def test_max_len_ratio_bounds_the_output_length(run: Path, pair: tuple[Path, Path]) -> None:
    """The largest ratio translates (its output capped at 100,000 pieces): not the empty
    line that a ratio past an int64's range gave."""
    result = nmt("translate", "-m", str(run), "-i", str(pair[0]), "--max-len-ratio", "1000")
    assert result.code == 0 and result.out.strip(), result.err


# --- the server -------------------------------------------------------------------------------


def _numeric_fields(body: type[BaseModel]) -> list[str]:
    return [
        name
        for name, field in body.model_fields.items()
        if {int, float} & (set(typing.get_args(field.annotation)) or {field.annotation})
    ]


def _endpoint_fields() -> list[tuple[str, str]]:
    from nmt.commands.serve.schemas import AlignBody, ScoreBody, TranslateBody

    bodies = {"translate": TranslateBody, "score": ScoreBody, "align": AlignBody}
    found = [
        (endpoint, name) for endpoint, body in bodies.items() for name in _numeric_fields(body)
    ]
    return [*found, ("vocabulary", "offset"), ("vocabulary", "limit")]


# The extreme values a field takes, as the CLI's options do; a huge vocabulary offset is a
# slice past the end: no pieces.
HONOURED_FIELDS: dict[tuple[str, str], tuple[object, ...]] = {
    ("translate", "length_penalty"): (0,),
    ("translate", "coverage_penalty"): (0,),
    ("translate", "no_repeat_ngram"): (0,),
    ("score", "length_penalty"): (0,),
    ("score", "coverage_penalty"): (0,),
    ("vocabulary", "offset"): (0, 2**64),
}

PAIRS = {"sources": ["sol luna"], "targets": ["LUNA SOL"]}


@pytest.fixture(scope="module")
def client(run: Path) -> Any:
    pytest.importorskip("fastapi", reason="nmt serve's extra is not installed")
    from fastapi.testclient import TestClient

    from nmt.commands.serve.app import ServedModel, create_app

    app = create_app([ServedModel.load(run, device="cpu")])
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize(("endpoint", "field"), _endpoint_fields())
def test_each_request_field_refuses_what_it_cannot_honour(
    client: Any, endpoint: str, field: str, value: object
) -> None:
    """Every numeric field of every request refuses each extreme value it cannot honour: 400
    or 422, or 413 past one of the server's limits (beam_size), one line naming the field
    (JSON's Infinity and NaN included) and never a CLI flag but the server's own limit."""
    if endpoint == "vocabulary":
        response = client.get(f"/api/models/run/vocabulary?{field}={value}")
    else:
        given = {"sentences": ["sol luna"]} if endpoint == "translate" else PAIRS
        body = json.dumps({**given, field: value})  # inf and nan as JSON's Infinity and NaN
        headers = {"content-type": "application/json"}
        response = client.post(f"/api/{endpoint}", content=body, headers=headers)
    honoured = any(value is v or value == v for v in HONOURED_FIELDS.get((endpoint, field), ()))
    if honoured:
        assert response.status_code == 200, response.text
        return
    assert response.status_code in (400, 413, 422), response.text
    error = response.json()["error"]
    assert error.startswith(field) or f"; {field}" in error or f" {field}" in error, error
    assert "--" not in error.replace("(nmt serve --max-beam)", ""), error


# --- who asked names the options ----------------------------------------------------------------


def test_the_cli_names_its_flags(run: Path, pair: tuple[Path, Path]) -> None:
    result = nmt("translate", "-m", str(run), "-i", str(pair[0]), "--beam", "2", "--n-best", "5")
    assert result.error.startswith("error: --n-best 5 is larger than --beam 2;")
    assert "raise --beam or lower --n-best" in result.error
    result = nmt(
        "align", "-m", str(run), "-i", str(pair[0]), "-t", str(pair[1]),
        "--extract", "threshold", "--threshold", "2",
    )  # fmt: skip
    assert result.error.startswith("error: --threshold 2.0: expected a value in (0, 1]")


def test_a_request_names_its_fields(client: Any) -> None:
    """The n-best, constraints and alignment errors of a request name its JSON fields."""
    body = {"sentences": ["sol"], "beam_size": 2, "n_best": 5}
    error = client.post("/api/translate", json=body).json()["error"]
    assert error.startswith("n_best 5 is larger than beam_size 2;"), error
    assert "raise beam_size or lower n_best" in error and "--" not in error
    body = {"sentences": ["sol"], "beam_size": 1, "constraints": [["SOL"]]}
    error = client.post("/api/translate", json=body).json()["error"]
    assert error.startswith("constraints needs a beam of 2 or more, got beam_size 1"), error
    assert "--" not in error
    error = client.post("/api/align", json={**PAIRS, "extract": "max"}).json()["error"]
    assert error.startswith("extract 'max': expected one of"), error
    error = client.post("/api/translate", json={"sentences": ["sol"], "max_len_ratio": 1e20})
    assert error.json()["error"].startswith("max_len_ratio: got 1e+20; input should be less")


def test_the_python_api_names_its_keywords(run: Path) -> None:
    import nmt as library

    model = library.load(run, device="cpu")
    with pytest.raises(ConfigError, match=r"^n_best 4 is larger than beam_size 3;"):
        model.translate("sol", n_best=4, beam_size=3)
    with pytest.raises(ConfigError, match=r"^max_len_ratio: got 1e\+20;"):
        model.translate("sol", max_len_ratio=1e20)
