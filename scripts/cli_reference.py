"""Write docs/cli.md, the reference of every `nmt` command and option, from the Typer app.

.venv/bin/python scripts/cli_reference.py            # rewrite docs/cli.md
.venv/bin/python scripts/cli_reference.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import typer.main

from nmt.cli import app

try:  # typer >= 0.20 carries its own click
    from typer._click.core import Context
except ImportError:  # pragma: no cover - older typer on click
    from click.core import Context  # type: ignore[no-redef,assignment]

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

HEADER = """# CLI reference

Every `nmt` command and option, with its help text. This file is generated from the command
line's own definitions in `nmt/cli.py` by `scripts/cli_reference.py`; a test keeps the two in
step. `nmt COMMAND --help` prints the same text. Errors are one line on stderr with exit status
2; `nmt --debug COMMAND ...` shows the traceback.
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _rows(command: Any, ctx: Any) -> list[str]:
    rows = ["| option | description |", "| --- | --- |"]
    for param in command.params:
        record = param.get_help_record(ctx)
        if record is None:  # a hidden option
            continue
        name, help_text = record
        rows.append(f"| `{_cell(name)}` | {_cell(help_text)} |")
    return rows


def _usage(command: Any, ctx: Any, name: str) -> str:
    pieces = " ".join(command.collect_usage_pieces(ctx))
    return f"nmt {name} {pieces}".rstrip()


def render() -> str:
    """docs/cli.md as the app defines it today."""
    group = typer.main.get_command(app)
    root = Context(group, info_name="nmt")
    lines = [
        HEADER,
        "## nmt",
        "",
        _cell(group.help or ""),
        "",
        "```",
        "nmt [OPTIONS] COMMAND",
        "```",
        "",
    ]
    lines += _rows(group, root)
    lines += ["", "| command | what it does |", "| --- | --- |"]
    commands = group.commands  # type: ignore[attr-defined]
    for name, command in commands.items():
        summary = _cell((command.help or "").split("\n\n")[0])
        lines.append(f"| [`nmt {name}`](#nmt-{name}) | {summary} |")
    for name, command in commands.items():
        ctx = Context(command, info_name=name, parent=root)
        lines += ["", f"## nmt {name}", "", _cell(command.help or ""), "", "```"]
        lines += [_usage(command, ctx, name), "```", ""]
        lines += _rows(command, ctx)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run scripts/cli_reference.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
