"""`nmt align`, `nmt translate --alignments` and `nmt eval --align` through the CLI: Pharaoh
lines over the whitespace words, the scores of a file against a reference, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import nmt, unchanged

PAIRS = [("sol luna agua", "AGUA LUNA SOL"), ("fuego", "FUEGO"), ("", ""), ("mar sol", "")]


def _links(line: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in token.split("-")) for token in line.split()]  # type: ignore[misc]


@pytest.mark.parametrize("extract", ["argmax", "next", "threshold", "intersect", "gdfa"])
def test_align_writes_one_pharaoh_line_per_pair(run: Path, tmp_path: Path, extract: str) -> None:
    """Indices within each side's word count; argmax links every target word exactly once,
    intersect each word at most once, gdfa holds the intersection; an empty side gives an
    empty line."""
    tsv = "".join(f"{s}\t{t}\n" for s, t in PAIRS).encode()
    mass = ["--threshold", "0.2"] if extract == "threshold" else []
    result = nmt("align", "-m", str(run), "--extract", extract, *mass, stdin=tsv)
    assert result.code == 0, result.err
    lines = result.out.split("\n")[:-1]
    assert len(lines) == len(PAIRS)
    core = lines
    if extract == "gdfa":  # grows from the intersection
        core = nmt("align", "-m", str(run), "--extract", "intersect", stdin=tsv).out.split("\n")
    for (src, trg), line, kept in zip(PAIRS, lines, core[: len(lines)], strict=True):
        links = _links(line)
        if not src or not trg:
            assert links == []
            continue
        assert all(0 <= i < len(src.split()) and 0 <= j < len(trg.split()) for i, j in links)
        targets = sorted(j for _, j in links)
        if extract in ("argmax", "next"):
            assert targets == list(range(len(trg.split())))
        if extract == "intersect":  # at most one link per word on either side
            assert len(set(targets)) == len(targets) and len({i for i, _ in links}) == len(links)
        if extract == "gdfa":
            assert links and set(_links(kept)) <= set(links)


def test_align_reads_files_like_score(run: Path, tmp_path: Path) -> None:
    """-i/-t and --tsv give the same lines."""
    src, trg, tsv = tmp_path / "s", tmp_path / "t", tmp_path / "p.tsv"
    src.write_text("".join(s + "\n" for s, _ in PAIRS), encoding="utf-8")
    trg.write_text("".join(t + "\n" for _, t in PAIRS), encoding="utf-8")
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    a = nmt("align", "-m", str(run), "-i", str(src), "-t", str(trg))
    b = nmt("align", "-m", str(run), "--tsv", str(tsv))
    assert a.code == b.code == 0 and a.out == b.out


def test_translate_writes_the_alignment_of_each_output(run: Path, tmp_path: Path) -> None:
    """--alignments: one line per input line, over the output's words."""
    out, links = tmp_path / "out.txt", tmp_path / "links.txt"
    result = nmt(
        "translate",
        "-m",
        str(run),
        "--beam",
        "2",
        "-o",
        str(out),
        "--alignments",
        str(links),
        stdin=b"sol luna\n\nagua\n",
    )
    assert result.code == 0, result.err
    outputs = out.read_text(encoding="utf-8").split("\n")[:-1]
    rows = links.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(rows) == len(outputs) == 3 and rows[1] == ""
    for source, output, row in zip(["sol luna", "", "agua"], outputs, rows, strict=True):
        if output:
            words = len(output.split())
            assert sorted(j for _, j in _links(row)) == list(range(words))
            assert all(i < len(source.split()) for i, _ in _links(row))


def test_eval_align_scores_a_file_against_a_reference(tmp_path: Path) -> None:
    """Och & Ney's figures for a small case counted by hand, as a table and JSON."""
    hyp, gold = tmp_path / "hyp.al", tmp_path / "gold.al"
    hyp.write_text("0-0 2-1 2-2\n0-1 1-0\n", encoding="utf-8")
    gold.write_text("0-0 1-1 2?1\n0-1 1?0\n", encoding="utf-8")
    table = nmt("eval", "--align", str(hyp), "--align-ref", str(gold))
    assert table.code == 0 and "AER" in table.out
    figures = json.loads(nmt("eval", "--align", str(hyp), "--align-ref", str(gold), "--json").out)
    assert figures["precision"] == pytest.approx(0.8)
    assert figures["recall"] == pytest.approx(2 / 3)
    assert figures["aer"] == pytest.approx(0.25)


def test_bad_alignment_input_is_one_line(run: Path, tmp_path: Path, previous: Path) -> None:
    """Line counts that differ, a token that is not a link, an unknown extraction, writing
    onto an input: one line naming the file and line, nothing written."""
    hyp, gold = tmp_path / "hyp.al", tmp_path / "gold.al"
    hyp.write_text("0-0\n0-1\n", encoding="utf-8")
    gold.write_text("0-0\n", encoding="utf-8")
    assert "has 2 lines" in nmt("eval", "--align", str(hyp), "--align-ref", str(gold)).error
    gold.write_text("0-0\n1-b\n", encoding="utf-8")
    error = nmt("eval", "--align", str(hyp), "--align-ref", str(gold)).error
    assert f"{gold} line 2" in error and "'1-b'" in error
    gold.write_text("\n\n", encoding="utf-8")  # no reference links: nothing to score
    error = nmt("eval", "--align", str(hyp), "--align-ref", str(gold)).error
    assert f"--align-ref {gold}: no reference links" in error and "all 2 of its lines" in error
    hyp.write_text("", encoding="utf-8")
    gold.write_text("", encoding="utf-8")
    error = nmt("eval", "--align", str(hyp), "--align-ref", str(gold)).error
    assert "no reference links" in error and "it is empty" in error
    assert "--extract" in nmt("align", "-m", str(run), "--extract", "max", stdin=b"a\tb\n").error
    ignored = nmt("align", "-m", str(run), "--threshold", "0.3", stdin=b"a\tb\n").error
    assert ignored == (
        "error: --threshold 0.3: only --extract threshold reads it (not argmax); give both, "
        "or neither"
    )
    result = nmt("align", "-m", str(run), "--tsv", str(previous), "-o", str(previous))
    assert "--output" in result.error and unchanged(previous)


def test_content_word_figures_by_hand(tmp_path: Path) -> None:
    """Links restricted to pairs of content words (nmt.function_words), counted by hand;
    a pair with an empty reference line is left out of both figures.

    Pair 1: es "el perro come" (content: perro1 come2), en "the dog eats" (dog1 eats2).
      hypothesis 0-0 1-1 2-1; reference 0?0 1-1 2-2.
      all words: A=3, S=2, P=3; A&S = {1-1} = 1, A&P = {0-0, 1-1} = 2:
        precision 2/3, recall 1/2, AER 1 - (1+2)/(3+2) = 0.4.
      content: A = {1-1, 2-1}, S = P = {1-1, 2-2}; A&S = A&P = 1:
        precision 1/2, recall 1/2, AER 1 - 2/4 = 0.5.
    Pair 2: reference empty: skipped, whatever the hypothesis says.
    """
    hyp, gold = tmp_path / "hyp.al", tmp_path / "gold.al"
    hyp.write_text("0-0 1-1 2-1\n0-0 5-5\n", encoding="utf-8")
    gold.write_text("0?0 1-1 2-2\n\n", encoding="utf-8")
    src, trg = tmp_path / "t.es", tmp_path / "t.en"
    src.write_text("el perro come\nx\n", encoding="utf-8")
    trg.write_text("the dog eats\ny\n", encoding="utf-8")
    args = ["eval", "--align", str(hyp), "--align-ref", str(gold)]
    result = nmt(*args, "--align-src", str(src), "--align-trg", str(trg), "--json")
    figures = json.loads(result.out)
    assert figures["sentences"] == 1 and figures["skipped"] == 1
    assert figures["precision"] == pytest.approx(2 / 3)
    assert figures["recall"] == pytest.approx(0.5)
    assert figures["aer"] == pytest.approx(0.4)
    content = figures["content_words"]
    assert (content["precision"], content["recall"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert content["aer"] == pytest.approx(0.5)
    table = nmt(*args, "--align-src", str(src), "--align-trg", str(trg)).out
    assert "content words" in table and "1 without reference links left out" in table


def test_content_word_input_errors_name_the_file(tmp_path: Path) -> None:
    hyp, gold = tmp_path / "hyp.al", tmp_path / "gold.al"
    hyp.write_text("0-0 0-7\n", encoding="utf-8")
    gold.write_text("0-0\n", encoding="utf-8")
    src, trg, other = tmp_path / "t.es", tmp_path / "t.en", tmp_path / "t.de"
    for path in (src, trg, other):
        path.write_text("uno dos\n", encoding="utf-8")
    args = ["eval", "--align", str(hyp), "--align-ref", str(gold), "--align-src", str(src)]
    result = nmt(*args, "--align-trg", str(trg))
    assert result.code == 2 and f"--align {hyp} line 1: link 0-7 is outside" in result.error
    assert "found de" in nmt(*args, "--align-trg", str(other)).error
    src.write_text("uno\ndos\n", encoding="utf-8")
    assert f"--align-src {src} has 2 lines" in nmt(*args, "--align-trg", str(trg)).error
    assert "need both" in nmt(*args).error
