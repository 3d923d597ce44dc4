"""Write docs/config.md, the reference of every config key, from the schema in nmt/config/.

.venv/bin/python scripts/config_reference.py            # rewrite docs/config.md
.venv/bin/python scripts/config_reference.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from nmt.config import Config

OUT = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """# Config reference

Every key of an `nmt` config, its type, its default and what it does. This file is generated
from the schema in `nmt/config/` by `scripts/config_reference.py`; a test keeps the two in
step. Set any key from the command line with `--override section.key=value`.
"""


def _type_name(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Union:  # with a Literal: int | Literal["auto"]
        return " \\| ".join(_type_name(member) for member in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            continue
        default = field.default
        shown = (
            "null"
            if default is None
            else str(default).lower()
            if isinstance(default, bool)
            else default
        )
        rows.append(
            f"| `{prefix}{name}` | {_type_name(annotation)} | `{shown}` | {field.description or ''} |"
        )
    return rows


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    out: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append((f"{prefix}{name}", annotation))
            out.extend(_sections(annotation, f"{prefix}{name}."))
    return out


def render() -> str:
    parts = [HEADER]
    for section, model in _sections(Config):
        rows = _rows(model, f"{section}.")
        if not rows:
            continue
        parts.append(f"\n## `{section}`\n\n{(model.__doc__ or '').strip()}\n")
        parts.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        parts.extend(rows)
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/config.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
