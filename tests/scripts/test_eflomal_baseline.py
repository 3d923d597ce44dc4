"""The eflomal baseline's own parts: the symmetrisation, worked by hand, and the tokens it
gives eflomal (the aligner itself is an optional extra, run by the script)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    path = ROOT / "scripts/eflomal_baseline.py"
    spec = importlib.util.spec_from_file_location("eflomal_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


baseline = _load()
gdfa = baseline.grow_diag_final_and


def test_growing_adds_neighbours_that_align_a_new_word() -> None:
    """Intersection {0-0, 1-1}; 2-1 and 1-2 touch 1-1 and each aligns a word not yet
    aligned (source 2, target 2), so both are added."""
    forward, reverse = {(0, 0), (1, 1), (2, 1)}, {(0, 0), (1, 1), (1, 2)}
    assert gdfa(forward, reverse) == {(0, 0), (1, 1), (2, 1), (1, 2)}


def test_final_and_adds_links_between_two_unaligned_words() -> None:
    """2-2 and 1-3 touch nothing in the intersection {0-0}; both of their words are still
    unaligned after growing, so final-and adds them."""
    assert gdfa({(0, 0), (2, 2)}, {(0, 0), (1, 3)}) == {(0, 0), (2, 2), (1, 3)}


def test_a_link_between_aligned_words_is_not_added() -> None:
    """0-1 touches both intersection links, but source 0 and target 1 are aligned already."""
    assert gdfa({(0, 0), (1, 1), (0, 1)}, {(0, 0), (1, 1)}) == {(0, 0), (1, 1)}


def test_eflomal_sees_as_many_tokens_as_the_reference_indexes() -> None:
    line = "Y dijo Dios: «Sea la luz» ; y fué la luz."
    seen = baseline.normalise(line)
    assert len(seen.split()) == len(line.split())
    assert seen == "y dijo dios sea la luz ; y fué la luz"


def test_links_round_trip_through_pharaoh() -> None:
    links = baseline.read_links("0-0 3-1 1-2")
    assert links == {(0, 0), (3, 1), (1, 2)}
    assert baseline.pharaoh(links) == "0-0 1-2 3-1"
