"""The layering of docs/architecture.md holds: import-linter's contracts in pyproject.toml are
kept, and they do catch an import against the layering."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_are_kept() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 broken" in done.stdout


def test_a_model_module_importing_training_breaks_them(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "nmt", tmp_path / "nmt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    scores = tmp_path / "nmt" / "model" / "scores.py"
    scores.write_text(scores.read_text() + "\nfrom nmt.training import step  # noqa\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "nmt.model.scores -> nmt.training.step" in done.stdout


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by basename (the tests folders are not packages): two files
    of one name in different folders stop the whole run at collection."""
    names: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, clashes


def decoding_cycles(package: str = "nmt.decoding") -> list[list[str]]:
    """Import cycles among the modules of ``package`` (imports inside functions count; those
    under TYPE_CHECKING do not), each as the modules around it."""
    graph = grimp.build_graph("nmt", exclude_type_checking_imports=True)
    inside = {m for m in graph.modules if m.startswith(package + ".")}
    edges = {m: graph.find_modules_directly_imported_by(m) & inside for m in inside}
    cycles: list[list[str]] = []
    for start in sorted(inside):
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for imported in sorted(edges[module]):
                if imported == start:
                    cycles.append(path)
                elif imported not in path and imported > start:  # each cycle once
                    stack.append((imported, [*path, imported]))
    return cycles


def test_decoding_has_no_import_cycle() -> None:
    """One search: its loops share code by importing it from below, never each other."""
    assert decoding_cycles() == []


def test_the_cycle_check_finds_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module importing another that imports it back, even inside a function, is found."""
    real = grimp.build_graph

    def with_a_cycle(*args: object, **kwargs: object) -> object:
        graph = real(*args, **kwargs)
        graph.add_import(importer="nmt.decoding.beams", imported="nmt.decoding.search")
        return graph

    monkeypatch.setattr(grimp, "build_graph", with_a_cycle)
    assert ["nmt.decoding.beams", "nmt.decoding.search"] in decoding_cycles()
