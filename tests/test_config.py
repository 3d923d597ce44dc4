"""The config schema: defaults, shipped configs, strict and complete error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from nmt.config import (
    Config,
    apply_override,
    changed_keys,
    from_dict,
    load,
    saved_config,
    to_yaml,
)
from nmt.errors import ConfigError
from nmt.model import build_model, registry

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    return str(info.value)


def test_defaults_load_and_are_frozen() -> None:
    cfg = from_dict({})
    assert cfg == Config()
    assert cfg.model.decoder.style == "bahdanau" and cfg.training.epochs >= 1
    with pytest.raises(ValidationError):
        cfg.training.epochs = 3  # type: ignore[misc]


def test_an_empty_file_is_refused_but_overrides_alone_make_a_config(tmp_path: Path) -> None:
    path = _write(tmp_path / "empty.yaml", "")
    with pytest.raises(ConfigError, match="the config is empty"):
        load(path)
    assert load(path, ["training.epochs=2"]) == Config(training={"epochs": 2})


def test_configs_directory_is_not_empty() -> None:
    if CONFIG_DIR.is_dir():
        assert SHIPPED, f"no *.yaml in {CONFIG_DIR}"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_and_builds(path: Path) -> None:
    cfg = load(path)
    assert isinstance(cfg, Config)
    build_model(cfg.model, 32, 32)  # a score or size the model cannot build fails here


def test_unknown_top_level_key_suggests_closest() -> None:
    message = _error({"trainig": {"epochs": 2}})
    assert "trainig" in message and "did you mean 'training'" in message


def test_unknown_nested_key_gives_dotted_path_and_suggestion() -> None:
    message = _error({"model": {"decoder": {"stlye": "luong"}}})
    assert "model.decoder.stlye" in message and "did you mean 'style'" in message


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    message = _error({"model": {"encoder": {"zzzqqq": 1}}})
    assert "model.encoder.zzzqqq" in message
    for key in ("rnn", "hidden_size", "bidirectional"):
        assert key in message


def test_a_long_list_of_valid_keys_is_cut_and_points_at_the_reference() -> None:
    message = _error({"training": {"zzzqqq": 1}})  # training has some 30 keys
    assert message.startswith("config: training.zzzqqq: unknown key; valid keys: ")
    assert "... and " in message and "docs/config.md" in message and len(message) < 300


@pytest.mark.parametrize(
    ("written_by", "newer"),
    [("0.10.0", True), ("1.0", True), ("0.9.1rc1", True), ("0.9.0", False), ("0.8.9", False)],
)
def test_unknown_keys_of_a_config_saved_by_a_newer_nmt_say_to_upgrade(
    monkeypatch: pytest.MonkeyPatch, written_by: str, newer: bool
) -> None:
    from nmt.config import loading

    monkeypatch.setattr(loading, "__version__", "0.9.0")
    raw = {"training": {"zq_new": 1}}
    with pytest.raises(ConfigError) as info:
        saved_config(raw, Path("runs/x/best.pt"), written_by)
    expected = (
        f"runs/x/best.pt: written by nmt {written_by}, newer than this nmt 0.9.0 (unknown "
        f"keys: training.zq_new); upgrade nmt to read it"
        if newer
        else "runs/x/best.pt (saved config): training.zq_new: unknown key; valid keys: "
    )
    assert str(info.value).startswith(expected)


def test_many_unknown_keys_are_one_short_problem_among_the_others() -> None:
    """A config for a newer nmt: 14 unknown keys in 3 sections used to repeat each section's
    valid keys after each of them (4,000 characters)."""
    raw = {
        "training": {f"zq_option_{i}": 1 for i in range(5)} | {"epochs": 0, "epohcs": 3},
        "model": {f"zq_fancy_{i}": True for i in range(5)},
        "decoding": {f"zq_extra_{i}": 0.5 for i in range(3)},
    }
    message = _error(raw)
    assert "\n" not in message and len(message) < 400, message
    assert "unknown keys model.zq_fancy_0, model.zq_fancy_1" in message
    assert "... and 10 more" in message  # 14 unknown keys, 4 named
    assert "did you mean training.epochs for training.epohcs?" in message
    assert "training.epochs: got 0" in message  # the other problems are all still there


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("training", "epochs", 0),
        ("training", "learning_rate", "abc"),
        ("training", "label_smoothing", 1.5),
        ("decoding", "beam_size", 0),
        ("model", "tie_embeddings", "maybe"),
        ("tokenizer", "character_coverage", 0.97),  # sentencepiece takes 0.98 to 1
    ],
)
def test_bad_type_or_range_names_the_key(section: str, key: str, value: object) -> None:
    message = _error({section: {key: value}})
    assert f"{section}.{key}" in message and repr(value) in message


def test_bad_score_lists_valid_names() -> None:
    message = _error({"model": {"attention": {"score": "dott"}}})
    assert "model.attention.score" in message and "'dott'" in message
    for name in registry.SCORES:
        assert name in message


def test_several_problems_in_one_message() -> None:
    message = _error(
        {
            "training": {"epochs": 0, "learning_rate": "abc"},
            "model": {"decoder": {"stlye": "luong"}, "attention": {"score": "dott"}},
        }
    )
    for where in (
        "training.epochs",
        "training.learning_rate",
        "model.decoder.stlye",
        "model.attention.score",
    ):
        assert where in message


def test_several_cross_field_problems_in_one_message() -> None:
    message = _error(
        {
            "model": {
                "embedding_size": 8,
                "tie_embeddings": True,
                "encoder": {"hidden_size": 4, "bidirectional": True},
                "decoder": {"style": "luong", "hidden_size": 16},
                "attention": {"score": "dot"},
            }
        }
    )
    assert "model.attention.score" in message and "model.tie_embeddings" in message


@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
def test_dot_with_unequal_sizes_says_what_works(score: str) -> None:
    model = {
        "encoder": {"hidden_size": 4, "bidirectional": True},  # keys of size 8
        "decoder": {"hidden_size": 6},
        "attention": {"score": score},
    }
    message = _error({"model": model})
    assert "model.attention.score" in message
    assert "8" in message and "6" in message
    assert "general" in message or "additive" in message
    model["decoder"] = {"hidden_size": 8}
    assert from_dict({"model": model}).model.attention.score == score


@pytest.mark.parametrize(
    ("decoder", "embedding_size"),
    [({"style": "luong", "hidden_size": 16}, 8), ({"style": "bahdanau", "output_size": 6}, 8)],
)
def test_tie_embeddings_with_mismatched_sizes(decoder: dict, embedding_size: int) -> None:
    model = {"embedding_size": embedding_size, "tie_embeddings": True, "decoder": decoder}
    message = _error({"model": model})
    assert "model.tie_embeddings" in message and "model.embedding_size" in message


def test_tie_embeddings_with_matching_sizes_is_accepted() -> None:
    model = {
        "embedding_size": 16,
        "tie_embeddings": True,
        "decoder": {"style": "luong", "hidden_size": 16},
    }
    assert from_dict({"model": model}).model.tie_embeddings


def test_overrides_are_typed_and_create_sections(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "training:\n  epochs: 3\n")
    cfg = load(
        path,
        [
            "training.epochs=7",
            "training.learning_rate=2e-4",
            "model.decoder.style=luong",
            "model.encoder.bidirectional=false",
            "training.max_steps=null",
            "data.test=",
        ],
    )
    assert cfg.training.epochs == 7
    assert cfg.training.learning_rate == pytest.approx(2e-4)
    assert cfg.model.decoder.style == "luong"
    assert cfg.model.encoder.bidirectional is False
    assert cfg.training.max_steps is None and cfg.data.test is None


def test_apply_override_nested_creation() -> None:
    raw: dict = {}
    apply_override(raw, "a.b.c=[1, 2]")
    assert raw == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize("override", ["training.epochs", "=3", " =3", "training.epochs.x=1"])
def test_bad_override_form(tmp_path: Path, override: str) -> None:
    path = _write(tmp_path / "c.yaml", "training:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match="override"):
        load(path, [override])


def test_override_with_unknown_key_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "")
    with pytest.raises(ConfigError, match="did you mean 'epochs'"):
        load(path, ["training.epoch=3"])


def test_not_yaml_gives_path_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", "training:\n  epochs: 3\nmodel: [unclosed\n  x: 1\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}:")
    line = int(message[len(str(path)) + 1 :].split(":")[0])
    assert 3 <= line <= 5


def test_non_mapping_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping") as info:
        load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such"):
        load(tmp_path / "absent.yaml")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "training:\n  epochs: 0\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(path) in str(info.value) and "training.epochs" in str(info.value)


def test_to_yaml_round_trips() -> None:
    cfg = from_dict(
        {
            "model": {"decoder": {"style": "luong", "input_feeding": False}},
            "training": {"epochs": 4, "max_steps": 100, "learning_rate": 3e-4},
            "data": {"test": None},
        }
    )
    text = to_yaml(cfg)
    assert from_dict(yaml.safe_load(text)) == cfg
    assert from_dict(yaml.safe_load(to_yaml(Config()))) == Config()


def test_changed_keys() -> None:
    old = Config()
    new = from_dict({"training": {"epochs": 4}, "model": {"decoder": {"style": "luong"}}})
    assert sorted(changed_keys(old, new)) == ["model.decoder.style", "training.epochs"]
    assert changed_keys(old, Config()) == []


def test_eval_splits_names_are_checked() -> None:
    cfg = from_dict({"data": {"eval_splits": {"books": "data/bible/books", "wmt-15": "x"}}})
    assert cfg.data.eval_splits == {"books": "data/bible/books", "wmt-15": "x"}
    assert from_dict({}).data.eval_splits == {}
    assert _error({"data": {"eval_splits": {"test": "x", "a b": "y"}}}) == (
        "config: data.eval_splits.test: test is data.test; rename the split; "
        "data.eval_splits.a b: a split name is letters, digits, _ and -; rename it"
    )
    assert "data.eval_splits.books" in _error({"data": {"eval_splits": {"books": 3}}})
    assert "data.eval_splits" in _error({"data": {"eval_splits": ["books"]}})
