"""The documentation stays true to the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_up_to_date() -> None:
    reference = _load_script("config_reference")
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == reference.render(), (
        "docs/config.md is stale: run .venv/bin/python scripts/config_reference.py"
    )


def test_every_key_of_the_schema_is_in_the_reference() -> None:
    from nmt.config import Config

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for key in Config().model_dump(mode="json")["training"]:
        assert f"`training.{key}`" in text


def test_readme_opens_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = readme.split("```")[1]
    assert "make setup" in first_block and "make test" in first_block
    assert ".venv/bin/nmt train configs/demo.yaml" in readme
