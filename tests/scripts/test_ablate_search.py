"""scripts/ablate_search.py on the tiny trained run: each path it turns off is one the model's
search reaches, and turning it off leaves every translation as it was."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from scripted import load_script

from nmt.fast import compiled

ROOT = Path(__file__).resolve().parent.parent.parent


def _script() -> ModuleType:
    return load_script("ablate_search")


@pytest.mark.skipif(compiled.library() is None, reason="needs the compiled kernels")
def test_every_path_is_reached_and_changes_no_translation(
    trained_run: Path, tmp_path: Path
) -> None:
    script = _script()
    out = tmp_path / "ablate.json"
    # a Luong general model: every path but the top-k kernel (a vocabulary of 40 pieces is
    # under its threshold) and the shortlist's (a model has one only where it was trained
    # with one) is reached
    paths = [p for p in script.PATHS if p not in ("top_k_kernel", "shortlist")]
    argv = ["--model", str(trained_run), "--beams", "1,2", "--rounds", "1", "--json", str(out)]
    assert script.main([*argv, "--paths", ",".join(paths)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["sentences"] == 10  # the run's test split
    for beam in ("1", "2"):
        figures = report["beams"][beam]["paths"]
        assert list(figures) == ["everything_on", *paths]
        for name in paths:
            row = figures[name]
            assert row["same_translations"], (beam, name)
            assert row["calls"] > 0, (beam, name)
            assert len(row["seconds"]) == 1 and row["median_s"] > 0
    # each path is back on after its runs
    assert compiled.rnn_cell.__name__ == "rnn_cell"


def test_an_unknown_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _script().main(["--model", "nowhere", "--paths", "packed,warp_drive"])
    assert stopped.value.code == 2
    assert "warp_drive" in capsys.readouterr().err
