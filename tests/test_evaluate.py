"""nmt.evaluate against the sacrebleu command line on small files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nmt.errors import ConfigError, DataError
from nmt.evaluate import Report, read_lines, score, score_files

REF = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today?",
    "It is raining in Paris this morning.",
    "We will meet again next week.",
]
REF2 = [
    "A cat was sitting on the mat.",
    "A fast brown fox leaps over the lazy dog.",
    "Hello world, how are you doing today?",
    "It rains in Paris this morning.",
    "We shall meet again next week.",
]
HYP = [
    "The cat is on the mat.",
    "A fast brown fox jumped over a lazy dog.",
    "Hello world how are you",
    "It rains in Paris this morning.",
    "We meet next week again.",
]
HYP2 = [
    "The cat sat on a mat.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "Today it is raining in Paris.",
    "We will see each other next week.",
]

SACREBLEU = Path(sys.executable).parent / "sacrebleu"


def _write(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes("".join(line + newline for line in lines).encode("utf-8"))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "ref": _write(tmp_path / "ref.txt", REF),
        "ref2": _write(tmp_path / "ref2.txt", REF2),
        "hyp": _write(tmp_path / "hyp.txt", HYP),
        "hyp2": _write(tmp_path / "hyp2.txt", HYP2),
    }


def _cli(*args: str) -> str:
    result = subprocess.run(
        [str(SACREBLEU), *args, "-q", "-nc"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SACREBLEU_SEED": "12345"},
    )
    return result.stdout


def _cli_json(refs: list[Path], hyp: Path) -> dict[str, dict]:
    out = _cli(*map(str, refs), "-i", str(hyp), "-m", "bleu", "chrf", "ter", "-w", "4")
    return {entry["name"]: entry for entry in json.loads(out)}


@pytest.mark.parametrize("ref_keys", [["ref"], ["ref", "ref2"]])
def test_scores_and_signatures_match_command_line(
    files: dict[str, Path], ref_keys: list[str]
) -> None:
    refs = [files[k] for k in ref_keys]
    expected = _cli_json(refs, files["hyp"])
    report = score_files([files["hyp"]], refs)
    (system,) = report.systems
    assert system.name == "hyp.txt"
    assert system.bleu == pytest.approx(expected["BLEU"]["score"], abs=0.01)
    assert system.chrf == pytest.approx(expected["chrF2"]["score"], abs=0.01)
    assert system.ter == pytest.approx(expected["TER"]["score"], abs=0.01)
    assert report.signatures == {
        "bleu": expected["BLEU"]["signature"],
        "chrf": expected["chrF2"]["signature"],
        "ter": expected["TER"]["signature"],
    }
    assert f"nrefs:{len(refs)}" in report.signatures["bleu"]
    assert "tok:13a" in report.signatures["bleu"]
    assert expected["BLEU"]["verbose_score"] in system.bleu_detail
    assert report.n_segments == len(REF)


def test_multiple_references_change_the_score(files: dict[str, Path]) -> None:
    one = score_files([files["hyp"]], [files["ref"]]).systems[0]
    two = score_files([files["hyp"]], [files["ref"], files["ref2"]]).systems[0]
    assert two.bleu is not None and one.bleu is not None
    assert two.bleu > one.bleu


def test_paired_bootstrap_p_values(files: dict[str, Path]) -> None:
    report = score_files([files["hyp"], files["hyp2"]], [files["ref"]], significance="bootstrap")
    baseline, other = report.systems
    assert (baseline.p_bleu, baseline.p_chrf, baseline.p_ter) == (None, None, None)
    for p in (other.p_bleu, other.p_chrf, other.p_ter):
        assert p is not None and 0.0 <= p <= 1.0
    assert report.significance == "bootstrap"
    assert "bs:1000" in report.signatures["bleu"] and "seed:12345" in report.signatures["bleu"]

    out = _cli(
        str(files["ref"]),
        "-i",
        str(files["hyp"]),
        str(files["hyp2"]),
        *("-m", "bleu", "chrf", "ter", "--paired-bs", "-f", "text", "-w", "4"),
    )
    cli_p = [float(p) for p in re.findall(r"\(p = ([0-9.]+)\)\*?", out)]
    assert cli_p == pytest.approx([other.p_bleu, other.p_chrf, other.p_ter], abs=1e-4)
    assert report.signatures["bleu"] in out


def test_significance_is_skipped_for_one_system() -> None:
    report = score({"a": HYP}, [REF], significance="bootstrap")
    assert report.systems[0].p_bleu is None
    assert report.significance is None


def test_seed_environment_is_restored() -> None:
    before = os.environ.get("SACREBLEU_SEED")
    score({"a": HYP, "b": HYP2}, [REF], metrics=("bleu",), significance="bootstrap", seed=7)
    assert os.environ.get("SACREBLEU_SEED") == before


def test_metric_subset() -> None:
    report = score({"a": HYP}, [REF], metrics=("bleu",))
    assert report.systems[0].chrf is None and report.systems[0].ter is None
    assert list(report.signatures) == ["bleu"]
    assert "chrF" not in report.to_table()


def test_length_mismatch_names_files_and_counts(files: dict[str, Path], tmp_path: Path) -> None:
    short = _write(tmp_path / "short.txt", HYP[:3])
    with pytest.raises(DataError, match=r"short\.txt has 3 lines but .*ref\.txt has 5"):
        score_files([short], [files["ref"]])
    with pytest.raises(DataError, match=r"short\.txt has 3 lines but .*ref\.txt has 5"):
        score_files([files["hyp"]], [files["ref"], short])
    with pytest.raises(DataError, match="system 'a' has 3 lines but reference 1 has 5"):
        score({"a": HYP[:3]}, [REF], names={"a": "system 'a'"})


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\ncaf\xe9\nok\n")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: not valid UTF-8")):
        read_lines(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_lines(tmp_path / "nope.txt")


def test_read_lines_handles_crlf_and_final_newline(tmp_path: Path) -> None:
    crlf = _write(tmp_path / "crlf.txt", ["a b", "", "c"], newline="\r\n")
    assert read_lines(crlf) == ["a b", "", "c"]
    (tmp_path / "open.txt").write_bytes(b"x\ny")
    assert read_lines(tmp_path / "open.txt") == ["x", "y"]


def test_bad_options_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown metric"):
        score({"a": HYP}, [REF], metrics=("meteor",))
    with pytest.raises(ConfigError, match="significance"):
        score({"a": HYP}, [REF], significance="t-test")


def test_json_and_table(files: dict[str, Path]) -> None:
    report = score_files([files["hyp"], files["hyp2"]], [files["ref"]], significance="bootstrap")
    assert isinstance(report, Report)
    data = json.loads(report.to_json())
    assert data["n_segments"] == len(REF)
    assert [s["name"] for s in data["systems"]] == ["hyp.txt", "hyp2.txt"]
    assert data["systems"][0]["bleu"] == pytest.approx(report.systems[0].bleu)
    assert data["signatures"] == report.signatures
    table = report.to_table()
    for name in ("hyp.txt", "hyp2.txt", "BLEU", "chrF", "TER"):
        assert name in table
    for signature in report.signatures.values():
        assert signature in table
