"""scripts/ablate_training.py at the bench's tiny sizes: every path it turns off is one that a
configuration's training reaches, each variant trains, and every path is back on after."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

import pytest
from scripted import load_script

from nmt.fast import FastPaths, compiled, recurrence

ROOT = Path(__file__).resolve().parent.parent.parent
WORDS = "sol luna mar rio casa perro gato libro agua fuego tierra aire".split()


def _script() -> ModuleType:
    return load_script("ablate_training")


def _corpus(root: Path) -> None:
    rng = random.Random(5)
    for split, size in (("train", 200), ("dev", 10), ("test", 10)):
        pairs = [[rng.choice(WORDS) for _ in range(rng.randint(2, 9))] for _ in range(size)]
        for lang, side in (("es", pairs), ("en", [[w.upper() for w in p[::-1]] for p in pairs])):
            text = "".join(" ".join(words) + "\n" for words in side)
            (root / f"{split}.{lang}").write_text(text, encoding="utf-8")


@pytest.mark.skipif(compiled.library() is None, reason="needs the compiled kernels")
def test_every_path_is_reached_and_trains(tmp_path: Path) -> None:
    script = _script()
    _corpus(tmp_path)
    out = tmp_path / "ablate.json"
    argv = ["--tiny", "--configs", "bahdanau,luong-feed", "--rounds", "1", "--steps", "1"]
    argv += ["--data", str(tmp_path), "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    runs_here, dropout = recurrence.runs_here, FastPaths.dropout
    assert script.main(argv) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    reached = set()
    for name in ("bahdanau", "luong-feed"):
        variants = report["configs"][name]["variants"]
        assert list(variants) == ["everything_on", *script.PATHS]
        on = variants["everything_on"]["first_loss"]
        for variant, row in variants.items():
            assert row["median_tokens_per_s"] > 0
            # the plain path computes the same loss but for round-off (dropout: other masks)
            assert abs(row["first_loss"] - on) < (0.05 if variant == "dropout_16bit" else 1e-4)
            if row["calls"] > 0:
                reached.add(variant)
    assert reached == set(script.PATHS)  # each path reached by one configuration at least
    assert recurrence.runs_here is runs_here and FastPaths.dropout is dropout


def test_an_unknown_path_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _script().main(["--paths", "recurrence_kernels,warp_drive"])
    assert stopped.value.code == 2
    assert "warp_drive" in capsys.readouterr().err
