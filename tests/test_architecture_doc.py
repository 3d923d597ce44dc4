"""docs/architecture.md stays true to the code: every signature it quotes exists with the
parameters it names, every module its map names exists and every module is in the map, and
its layer table is the layering pyproject.toml's import contracts state.

A quote is a code span that is a call, `Name.method(params)`, `function(params)` or
`module.function(params)`, or a `Class.method` reference. Identifiers in a call name the
parameters in order, `name=value` names one by keyword, any other expression stands in for
one parameter, and `...` skips any number of them; after the last argument only parameters
with defaults may be left out unless the quote ends with `...`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import nmt

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"

# The document's names for instances: `fast.dropout(p)` is a method of the model's FastPaths.
INSTANCES = {"fast": "nmt.fast.FastPaths", "memory": "nmt.model.attention.Memory"}


def _modules() -> list[str]:
    """nmt and its modules, but ``nmt.__main__`` (importing it runs the CLI)."""
    names = ["nmt"]
    for info in pkgutil.walk_packages(nmt.__path__, "nmt."):
        if info.name != "nmt.__main__":
            names.append(info.name)
    return names


def _defined(kind: Callable[[Any], bool]) -> dict[str, list[Any]]:
    """Every class (or module-level function) defined in nmt, by name."""
    found: dict[str, list[Any]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if kind(obj) and obj.__module__ == name:
                found.setdefault(obj.__name__, []).append(obj)
    return found


CLASSES = _defined(inspect.isclass)
FUNCTIONS = _defined(inspect.isfunction)


def _paragraphs() -> Iterator[list[str]]:
    """The code spans of each paragraph (or list item) of the document, in order, a span
    broken across lines joined by a space."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)  # the module map's block
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:- |\d+\. |\|))", text):
        yield [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", paragraph)]


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ['a', 'b', 'c']; None for anything else."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else [*base, node.attr]
    return None


def _attribute(obj: Any, parts: list[str]) -> Any:
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _resolve(parts: list[str], context: type | None) -> tuple[Any, bool]:
    """The object `a.b.c` names, and whether it is a method looked up on its class (its
    first parameter, self, is not quoted). Raises LookupError saying why it cannot."""
    head, rest = parts[0], parts[1:]
    if head == "nmt":
        return _attribute(nmt, rest), False
    if head in INSTANCES:
        module, _, name = INSTANCES[head].rpartition(".")
        owner = getattr(importlib.import_module(module), name)
        return _attribute(owner, rest), True
    if len(CLASSES.get(head, [])) == 1:
        return _attribute(CLASSES[head][0], rest), bool(rest)
    if head in CLASSES:
        raise LookupError(f"{len(CLASSES[head])} classes are named {head}")
    if not rest and len(FUNCTIONS.get(head, [])) == 1:
        return FUNCTIONS[head][0], False
    modules = [name for name in _modules() if name.rpartition(".")[2] == head]
    if rest and len(modules) == 1:
        return _attribute(importlib.import_module(modules[0]), rest), False
    if not rest and context is not None and hasattr(context, head):
        return getattr(context, head), True
    raise LookupError(
        "no class, function or module of nmt has that name"
        + (f" (nor has {context.__name__}, the class named before it)" if context else "")
    )


def _check_call(call: ast.Call, parameters: list[inspect.Parameter]) -> list[str]:
    """What is wrong with the quote's arguments for these parameters (none: [])."""
    problems: list[str] = []
    names = [p.name for p in parameters]
    open_ended = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    position, skipping = 0, False
    for arg in call.args:
        if isinstance(arg, ast.Constant) and arg.value is Ellipsis:
            skipping = True
            continue
        name = arg.id if isinstance(arg, ast.Name) else None
        if skipping and name is not None:
            later = [p.name for p in positional[position:]]
            if name not in later:
                problems.append(f"no parameter {name!r} after the '...' (has: {names})")
                continue
            position += later.index(name) + 1
            skipping = False
        elif skipping:
            continue  # an expression after '...': its place is unknown
        elif position >= len(positional):
            if not open_ended:
                problems.append(f"more arguments than its {len(positional)} parameters")
            break
        else:
            expected = positional[position].name
            if name is not None and name != expected:
                problems.append(f"parameter {position + 1} is {expected!r}, not {name!r}")
            position += 1
    for keyword in call.keywords:
        if keyword.arg is not None and keyword.arg not in names:
            if not any(p.kind is p.VAR_KEYWORD for p in parameters):
                problems.append(f"no parameter {keyword.arg!r} (has: {names})")
    if not skipping:
        quoted = {k.arg for k in call.keywords}
        missing = [
            p.name for p in positional[position:] if p.default is p.empty and p.name not in quoted
        ]
        if missing:
            problems.append(
                f"leaves out the required {missing} (end the quote with '...' to skip them)"
            )
    return problems


def _signature(obj: Any, method: bool) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(obj).parameters.values())
    if method and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return parameters


def _quotes() -> Iterator[tuple[str, ast.expr, type | None]]:
    """(span, its expression, the class last named before it in its paragraph) for every
    span that quotes a call or a `Class.member`."""
    for spans in _paragraphs():
        context: type | None = None
        for span in spans:
            try:
                tree = ast.parse(span, mode="eval").body
            except SyntaxError:
                continue
            parts = _dotted(tree)
            if parts and len(CLASSES.get(parts[0], [])) == 1:
                if len(parts) == 1:
                    context = CLASSES[parts[0]][0]
                    continue
                yield span, tree, context
            elif any(isinstance(node, ast.Call) for node in ast.walk(tree)):
                yield span, tree, context


def problems_of(span: str, tree: ast.expr, context: type | None) -> list[str]:
    """What is wrong with one quote, each problem naming it."""
    problems = []
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    references = [(_dotted(call.func), call) for call in calls]
    if not calls:
        references = [(_dotted(tree), None)]
    for parts, call in references:
        if parts is None:
            continue  # a call of a call's result
        try:
            obj, method = _resolve(parts, context)
        except (LookupError, AttributeError) as error:
            problems.append(f"`{span}`: {'.'.join(parts)} does not exist ({error})")
            continue
        if call is None:
            continue
        if not callable(obj):
            problems.append(f"`{span}`: {'.'.join(parts)}: not callable ({type(obj)})")
            continue
        for problem in _check_call(call, _signature(obj, method)):
            problems.append(f"`{span}`: {'.'.join(parts)}: {problem}")
    return problems


QUOTES = list(_quotes())


def test_the_document_quotes_signatures() -> None:
    """The check below has something to check: the quotes a reader relies on are found."""
    calls = [span for span, tree, _ in QUOTES if isinstance(tree, ast.Call)]
    assert len(calls) >= 10, calls


def test_every_quoted_signature_exists() -> None:
    problems = [p for quote in QUOTES for p in problems_of(*quote)]
    assert not problems, "docs/architecture.md:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("span", "wrong"),
    [
        ("Seq2Seq.loss(src, src_lengths, trg_in, trg_out, eps)", "parameter 5"),
        ("Seq2Seq.loss(src, lengths, ...)", "parameter 2 is 'src_lengths', not 'lengths'"),
        ("Seq2Seq.loss(src, src_lengths)", "leaves out the required ['trg_in', 'trg_out']"),
        ("Seq2Seq.loss(src, ..., guide_weights)", "no parameter 'guide_weights' after"),
        ("Seq2Seq.lose(src, ...)", "Seq2Seq.lose does not exist"),
        ("FastPaths(cpu_kernel=True)", "no parameter 'cpu_kernel'"),
        ("build_model(cfg, 1, 2, fast, 3)", "more arguments than its 4 parameters"),
        ("fast.droput(p)", "fast.droput does not exist"),
        ("Encoder.backward", "Encoder.backward does not exist"),
        ("no_such_function(x)", "no_such_function does not exist"),
    ],
)
def test_a_wrong_quote_is_named_with_what_is_wrong(span: str, wrong: str) -> None:
    tree = ast.parse(span, mode="eval").body
    problems = problems_of(span, tree, None)
    assert problems and all(p.startswith(f"`{span}`: ") for p in problems), problems
    assert any(wrong in p for p in problems), problems


def test_a_bare_method_resolves_against_the_class_named_before_it() -> None:
    decoder = CLASSES["Decoder"][0]
    good = ast.parse("step(prev, memory, state)", mode="eval").body
    bad = ast.parse("step(prev, state)", mode="eval").body
    assert problems_of("step(prev, memory, state)", good, decoder) == []
    assert problems_of("step(prev, state)", bad, decoder) == [
        "`step(prev, state)`: step: parameter 2 is 'memory', not 'state'",
        "`step(prev, state)`: step: leaves out the required ['state'] (end the quote with "
        "'...' to skip them)",
    ]


# ---- the module map and the layers ----------------------------------------------------------


def _module_map() -> str:
    return re.search(r"```\nnmt/\n(.*?)```", DOC.read_text(), flags=re.S).group(1)


def test_the_module_map_names_each_part_and_only_modules_that_exist() -> None:
    """An entry of the map starts its line with the names of a top-level module (`name.py`)
    or package (`name/`), the package's modules (`name.py`) following in its description:
    every part of nmt has an entry and every module named exists."""
    entries: set[str] = set()
    named: set[str] = set()
    package = ""
    for line in _module_map().splitlines():
        entry = re.match(r"  ([\w./]+(?:, [\w./]+)*)(?:\s|$)", line)
        if entry:
            heads = entry.group(1).split(", ")
            entries.update(head.removesuffix(".py").rstrip("/") for head in heads)
            package = heads[0] if heads[0].endswith("/") else ""
        for name in re.findall(r"\b[\w/]+\.py\b", line):
            top = bool(entry) and name in entry.group(1).split(", ")
            path = (name if top or "/" in name else package + name).removesuffix(".py")
            named.add("nmt." + path.replace("/", ".").removesuffix(".__init__"))
    modules = set(_modules())
    missing = sorted(named - modules)
    assert not missing, f"docs/architecture.md's module map names what does not exist: {missing}"
    parts = {name.split(".")[1] for name in modules if name.count(".") >= 1}
    unnamed = sorted(parts - entries - {"__init__"})
    assert not unnamed, f"docs/architecture.md's module map has no entry for: {unnamed}"


def _table_layers() -> list[set[str]]:
    rows = re.findall(r"^\| (`[^|]*?)(?: \(side by side\))? \|", DOC.read_text(), flags=re.M)
    return [set(re.findall(r"`(\w+)`", row)) for row in rows]


def test_the_layer_table_is_the_import_contract() -> None:
    """The table's rows are the layers of pyproject.toml's layers contract, in order."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    layers = ast.literal_eval(re.search(r"^layers = (\[.*?\])$", pyproject, re.M | re.S)[1])
    expected = [{name.strip().removeprefix("nmt.") for name in row.split("|")} for row in layers]
    assert _table_layers() == expected, "docs/architecture.md's layer table, top to bottom"
