"""The eflomal baseline's own part: the tokens it gives eflomal (the aligner itself is an
optional extra, run by the script; its symmetrisation is nmt's, tested with the extractions)."""

from __future__ import annotations

from scripted import load_script

baseline = load_script("eflomal_baseline")


def test_eflomal_sees_as_many_tokens_as_the_reference_indexes() -> None:
    line = "Y dijo Dios: «Sea la luz» ; y fué la luz."
    seen = baseline.normalise(line)
    assert len(seen.split()) == len(line.split())
    assert seen == "y dijo dios sea la luz ; y fué la luz"


def test_links_round_trip_through_pharaoh() -> None:
    links = baseline.read_links("0-0 3-1 1-2")
    assert links == {(0, 0), (3, 1), (1, 2)}
    assert baseline.pharaoh(links) == "0-0 1-2 3-1"


def test_each_direction_and_their_symmetrisation_by_hand() -> None:
    """Pair 1: the directions agree on 0-0; growing adds 0-1 (next to 0-0, target 1 still
    unaligned), then 1-1 (diagonal, source 1 unaligned). Pair 2: no common link, nothing to
    grow from; final-and adds the forward 1-0 (both words unaligned), then not the reverse
    0-0 (target 0 is aligned by then)."""
    out = baseline.directions(["1-1 0-0", "1-0"], ["0-1 0-0", "0-0"])
    assert out == {
        "fwd": ["0-0 1-1", "1-0"],
        "rev": ["0-0 0-1", "0-0"],
        "gdfa": ["0-0 0-1 1-1", "1-0"],
    }
