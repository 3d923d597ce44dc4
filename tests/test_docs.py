"""The documentation stays true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from schemakeys import leaf_keys
from scripted import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_up_to_date() -> None:
    reference = load_script("config_reference")
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == reference.render(), (
        "docs/config.md is stale: run .venv/bin/python scripts/config_reference.py"
    )


def test_every_key_of_the_schema_is_in_the_reference() -> None:
    from nmt.config import Config

    keys = leaf_keys(Config)
    assert {key.split(".")[0] for key in keys} == set(Config.model_fields)
    assert {"model.attention.score", "model.encoder.hidden_size", "run.fast_kernels"} <= set(keys)
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    documented = re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(keys), "docs/config.md lists other keys than the schema"
    for key, field in keys.items():
        description = field.description or ""
        assert description.strip(), f"{key} has no description"
        assert f"| `{key}` |" in text and description in text, key


def test_readme_opens_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = readme.split("```")[1]
    assert "make setup" in first_block and "make test" in first_block
    assert ".venv/bin/nmt train configs/demo.yaml" in readme


def test_cli_reference_is_up_to_date() -> None:
    reference = load_script("cli_reference")
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == reference.render(), (
        "docs/cli.md is stale: run .venv/bin/python scripts/cli_reference.py"
    )


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    import typer.main

    from nmt.cli import app

    group = typer.main.get_command(app)
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    by_command = {section.split("\n", 1)[0].strip(): section for section in sections[1:]}
    commands = {"nmt": group} | {f"nmt {name}": cmd for name, cmd in group.commands.items()}  # type: ignore[attr-defined]
    missing = []
    for title, command in commands.items():
        section = by_command.get(title)
        if section is None:
            missing.append(title)
            continue
        # each row: | `-m, --model <list[Path]>` | help |, the names in its first cell
        rows = {
            row.split("` |")[0][3:]: row for row in section.splitlines() if row.startswith("| `")
        }
        for param in command.params:
            names = param.opts + param.secondary_opts if param.param_type_name == "option" else []
            for name in names or [param.name]:
                row = next(
                    (r for cell, r in rows.items() if name in re.split(r"[ ,<>.]+", cell)), None
                )
                if row is None or (getattr(param, "help", None) or "").split(".")[0] not in row:
                    missing.append(f"{title} {name}")
    assert not missing, f"docs/cli.md lacks: {missing}; run scripts/cli_reference.py"
