"""data.dev_alignment: every validation scores the attention against a reference alignment of
the dev pairs (the figures `nmt align` and `nmt eval --align` give for the same weights) and
draws the reference links on a tensorboard heatmap; bad files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import nmt, write_config
from synthetic import aligned_config, write_aligned_corpus


def _corpus(root: Path) -> Path:
    return write_aligned_corpus(root, {"train": 300, "dev": 14})


def _config(root: Path, **data: object) -> Path:
    config = aligned_config(root)
    config["data"].update({"test": None, "dev_alignment": str(root / "dev.align"), **data})
    config["run"]["tensorboard"] = True
    return write_config(root / "config.yaml", config)


def _image_tags(run: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    return list(events.Tags()["images"])


def test_validation_scores_the_attention_like_nmt_align(tmp_path: Path) -> None:
    """The dev AER that training logs at its last validation equals what `nmt align` and
    `nmt eval --align` give for the checkpoint saved there; the content-word figure leaves out
    the links of "el" and "y"; tensorboard holds the heatmap with the reference links."""
    root = _corpus(tmp_path)
    result = nmt("train", str(_config(root)), "--quiet")
    assert result.code == 0, result.err
    run = root / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in records if r["split"] == "dev"]
    assert [r["step"] for r in dev] == [10, 20]
    last = dev[-1]

    hyp = tmp_path / "hyp.align"
    aligned = nmt(
        "align", "-m", str(run / "last.pt"), "-i", str(root / "dev.es"), "-t",
        str(root / "dev.en"), "-o", str(hyp), "--device", "cpu",
    )  # fmt: skip
    assert aligned.code == 0, aligned.err
    scored = nmt(
        "eval", "--align", str(hyp), "--align-ref", str(root / "dev.align"),
        "--align-src", str(root / "dev.es"), "--align-trg", str(root / "dev.en"), "--json",
    )  # fmt: skip
    assert scored.code == 0, scored.err
    report = json.loads(scored.out)
    assert report["skipped"] == 1 and report["sentences"] == 13
    assert last["aer"] == pytest.approx(100 * report["aer"], abs=1e-9)
    assert last["aer_content"] == pytest.approx(100 * report["content_words"]["aer"], abs=1e-9)
    assert report["content_words"]["sure"] < report["sure"]  # "el"/"y" links are left out
    assert {"dev/attention_reference", "dev/attention"} <= set(_image_tags(run))
    assert "AER (content words)" in (run / "train.log").read_text(encoding="utf-8")


def test_without_the_key_validation_is_as_before(tmp_path: Path) -> None:
    """No dev_alignment: no AER in the metrics and no reference heatmap."""
    root = _corpus(tmp_path)
    result = nmt("train", str(_config(root, dev_alignment=None)), "--quiet")
    assert result.code == 0, result.err
    run = root / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in records if r["split"] == "dev"]
    assert dev and all("aer" not in r and "aer_content" not in r for r in dev)
    assert "dev/attention_reference" not in _image_tags(run)


def _rewrite(path: Path, line: int, text: str | None) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    if text is None:
        del lines[line]
    else:
        lines[line] = text
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")


@pytest.mark.parametrize(
    ("line", "text", "expected"),
    [
        (None, None, "data.dev_alignment: {root}/no.align: no such file"),
        (13, None, "data.dev_alignment: {root}/dev.align has 13 lines but data.dev"),
        (5, "0-0 1-x", "data.dev_alignment {root}/dev.align line 6: '1-x' is not a link"),
        (2, "0-0 0-40", "data.dev_alignment {root}/dev.align line 3: link 0-40 is outside"),
    ],
)
def test_a_bad_dev_alignment_is_one_line_before_training(
    tmp_path: Path, line: int | None, text: str | None, expected: str
) -> None:
    root = _corpus(tmp_path)
    if line is None:
        config = _config(root, dev_alignment=str(root / "no.align"))
    else:
        _rewrite(root / "dev.align", line, text)
        config = _config(root)
    result = nmt("train", str(config), "--quiet")
    assert expected.format(root=root) in result.error
    assert not (root / "run" / "last.pt").exists() and not (root / "run" / "metrics.jsonl").exists()
