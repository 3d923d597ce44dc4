"""scripts/attention_table.py on a tiny aligned corpus: a row trains the base config with its
decoder and score, scores translation and alignment, is skipped once done, and joins the
table."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from clirun import write_config
from scripted import load_script
from synthetic import aligned_config, write_aligned_corpus

ROOT = Path(__file__).resolve().parent.parent.parent


def _script() -> ModuleType:
    return load_script("attention_table")


def test_every_decoder_meets_every_score() -> None:
    table = _script()
    assert len(table.ROWS) == len(table.DECODERS) * len(table.SCORES) == 18
    assert table.row_overrides("luong:general", 256) == [
        "model.decoder.style=luong",
        "model.attention.score=general",
    ]
    assert table.row_overrides("bahdanau:dot", 256)[-1] == "model.encoder.hidden_size=128"


@pytest.mark.slow
def test_a_row_is_trained_scored_skipped_and_tabled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bahdanau:dot: the run has the row's decoder, score, a 8-unit encoder (its keys as
    wide as the 16-unit decoder state) and the budget of --steps; its figures are those of
    its own files."""
    table = _script()
    root = write_aligned_corpus(tmp_path, {"train": 300, "dev": 10, "test": 12})
    config = write_config(tmp_path / "base.yaml", aligned_config(root))
    out = tmp_path / "table"
    args = ["--config", str(config), "--out", str(out), "--rows", "bahdanau:dot"]
    assert table.main([*args, "--steps", "10"]) == 0
    row = out / "bahdanau-dot"
    saved = yaml.safe_load((row / "run" / "config.yaml").read_text())
    assert saved["model"]["decoder"]["style"] == "bahdanau"
    assert saved["model"]["attention"]["score"] == "dot"
    assert saved["model"]["encoder"]["hidden_size"] == 8
    assert saved["training"]["max_steps"] == 10 and saved["training"]["max_minutes"] is None
    result = json.loads((row / "result.json").read_text())
    assert result["updates"] == 10 and result["machine"]
    assert 0 <= result["test_bleu"] <= 100 and 0 <= result["content_aer"] <= 100
    assert 0 <= result["content_aer_intersect"] <= 100
    assert len((row / "test.intersect.align").read_text().splitlines()) == 12
    assert 0 <= result["content_aer_gdfa"] <= 100
    assert len((row / "test.gdfa.align").read_text().splitlines()) == 12
    links = (row / "test.align").read_text().splitlines()
    assert len(links) == 12 and all(links)  # argmax links every target word
    printed = capsys.readouterr().out
    assert "| bahdanau | dot (encoder 2x8) | 10 |" in printed

    before = (row / "result.json").stat().st_mtime_ns
    assert table.main(args) == 0
    assert (row / "result.json").stat().st_mtime_ns == before
    assert "bahdanau:dot: done earlier" in capsys.readouterr().err


def test_an_unknown_row_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _script().main(["--rows", "luong:nope", "--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert "--rows: unknown luong:nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_budget_is_updates_or_the_configs_clock() -> None:
    table = _script()
    assert table.budget_overrides(2000) == ["training.max_steps=2000", "training.max_minutes=null"]
    assert table.budget_overrides(0) == []


def test_a_row_names_the_gpu_it_trained_on_and_the_cpu_otherwise(tmp_path: Path) -> None:
    """The machine comes from the run's environment.json, as nmt train wrote it."""
    table = _script()
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    for run, device, name in ((gpu, "cuda:0", "NVIDIA H200"), (cpu, "cpu", "Intel(R) Xeon(R)")):
        run.mkdir()
        environment = {"device": device, "device_name": name, "torch_version": "2.11.0+cu130"}
        (run / "environment.json").write_text(json.dumps(environment))
    assert table.machine(gpu) == "NVIDIA H200, torch 2.11.0+cu130"
    assert table.machine(cpu) == f"Intel(R) Xeon(R), {len(table._cores())} cores"
    assert table._short("Intel(R) Xeon(R) Processor, 2 cores") == "Intel Xeon, 2 cores"
    assert table._short("NVIDIA H200, torch 2.11.0+cu130") == "NVIDIA H200"


def test_the_documented_table_is_the_shipped_rows() -> None:
    """docs/alignment.md's table is what --table makes of docs/attention_table/, each row
    a real run: the demo config with the row's decoder and score for 2,000 updates."""
    table = _script()
    shipped = ROOT / "docs" / "attention_table"
    results = sorted(shipped.glob("*/result.json"))
    assert results
    for path in results:
        result = json.loads(path.read_text())
        assert path.parent.name == result["row"].replace(":", "-")
        assert result["updates"] == 2000 and result["config"] == "configs/demo.yaml"
        assert result["overrides"][:2] == table.row_overrides(result["row"], 256)[:2]
    text = (ROOT / "docs" / "alignment.md").read_text()
    documented = text.split("<!-- attention-table -->\n")[1].split("\n<!-- /attention-table -->")[0]
    assert documented == table.table(shipped)
