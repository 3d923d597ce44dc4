"""`nmt eval`'s options that belong to another mode are refused, not ignored."""

from __future__ import annotations

from pathlib import Path

from clirun import nmt


def _pair(tmp_path: Path) -> list[str]:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat\n", encoding="utf-8")
    ref.write_text("the cat sat down\n", encoding="utf-8")
    return [str(hyp), "--ref", str(ref)]


def test_translation_options_without_a_model_are_refused(tmp_path: Path) -> None:
    """--save-hypotheses and the decoding flags apply to --model's translation: given with
    hypothesis files they are an error naming them, and nothing is written."""
    saved = tmp_path / "out.txt"
    error = nmt("eval", *_pair(tmp_path), "--save-hypotheses", str(saved), "--beam", "3").error
    assert error == (
        "error: --beam, --save-hypotheses: for the translation of --model RUN; give --model, "
        "or drop them"
    )
    assert not saved.exists()
    error = nmt("eval", *_pair(tmp_path), "--length-penalty", "0.6").error
    assert error.endswith(
        "--length-penalty: for the translation of --model RUN; give --model, or drop it"
    )
    assert nmt("eval", *_pair(tmp_path)).code == 0


def test_an_unknown_significance_test_lists_every_choice(tmp_path: Path) -> None:
    error = nmt("eval", *_pair(tmp_path), "--significance", "bogus").error
    assert error == "error: --significance 'bogus': expected one of bootstrap, ar, none"
    assert nmt("eval", *_pair(tmp_path), "--significance", "none").code == 0
