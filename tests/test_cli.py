"""End to end through the command line, as a user types it: train -> translate -> eval.

The run is trained, and stdin piped to translate, by ``python -m nmt`` in a fresh process; the
other commands go through the same entry point in this process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import clirun
import pytest
import yaml
from synthetic import write_corpus

from nmt.fast import compiled as native
from nmt.runtime import cpu_name


def nmt(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``nmt ARGS`` through the console entry point, in this process (``clirun.nmt``)."""
    result = clirun.nmt(*args, stdin=(stdin or "").encode("utf-8"))
    return subprocess.CompletedProcess(args, result.code, result.out, result.err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    write_corpus(root, {"train": 1500, "dev": 60, "test": 40, "held": 25})
    config = {
        "data": {
            "src_lang": "src",
            "trg_lang": "trg",
            "train": str(root / "train"),
            "dev": str(root / "dev"),
            "test": str(root / "test"),
            "eval_splits": {"held": str(root / "held")},
        },
        "tokenizer": {"vocab_size": 60, "type": "bpe"},
        "model": {
            "embedding_size": 32,
            "embedding_dropout": 0.0,
            "encoder": {"hidden_size": 32, "dropout": 0.0},
            "decoder": {
                "style": "luong",
                "hidden_size": 32,
                "input_feeding": False,
                "dropout": 0.0,
            },
            "attention": {"score": "general"},
        },
        "training": {
            "epochs": 12,
            "batch_tokens": 600,
            "learning_rate": 0.005,
            "validate_every": 200,
            "log_every": 50,
        },
        "run": {"dir": str(root / "run")},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = clirun.nmt_process("train", str(root / "config.yaml"), "--override", "training.seed=3")
    assert result.returncode == 0, result.stderr
    return root


def test_train_writes_a_complete_run_dir(trained: Path) -> None:
    run = trained / "run"
    for name in ("best.pt", "last.pt", "config.yaml", "spm.model", "train.log", "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["training"]["seed"] == 3  # the override is in the resolved config
    info = json.loads((run / "environment.json").read_text())
    assert info["torch_version"] and info["device"] == "cpu"
    assert info["native_kernels"] == native.status()  # whether the compiled RNN steps ran
    assert info["device_name"] == cpu_name() != ""


def test_translate_and_eval_from_files(trained: Path) -> None:
    hyp = trained / "hyp.txt"
    result = nmt(
        "translate",
        "--model",
        str(trained / "run"),
        "-i",
        str(trained / "test.src"),
        "-o",
        str(hyp),
    )
    assert result.returncode == 0, result.stderr
    lines = hyp.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 40
    result = nmt("eval", str(hyp), "--ref", str(trained / "test.trg"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["systems"][0]["bleu"] > 80, report  # the task is learnable to near-perfect
    assert report["signatures"]["bleu"].startswith("nrefs:1")


def test_translate_stdin_keeps_one_line_per_line(trained: Path) -> None:
    run = str(trained / "run")
    result = clirun.nmt_process("translate", "--model", run, input="sol luna\n\nmar\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["LUNA SOL", "", "MAR"]
    assert result.stdout.count("\n") == 3


def test_eval_split_of_the_run(trained: Path) -> None:
    """--model translates the split with the given beam, and its table row is the score of
    those translations: what `nmt eval` prints for them as a file."""
    saved = trained / "split.hyp"
    result = nmt(
        "eval", "--model", str(trained / "run"), "--split", "test", "--beam", "3",
        "--save-hypotheses", str(saved),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["System", "BLEU", "chrF", "TER"]
    name, *scores = lines[2].rsplit(maxsplit=3)
    assert name == "run:test (beam 3)"
    beam = nmt("translate", "-m", str(trained / "run"), "-i", str(trained / "test.src"), "-b", "3")
    assert saved.read_text(encoding="utf-8") == beam.stdout
    by_file = nmt("eval", str(saved), "--ref", str(trained / "test.trg"))
    assert by_file.stdout.splitlines()[2].split() == ["split.hyp", *scores]
    assert lines[4] == "Segments: 40" and lines[5].startswith("Decoding plan: ")
    assert lines[6:] == by_file.stdout.splitlines()[5:]  # the same signatures
    # --precision auto, decided for the model (too small for bf16, or a CPU without it); a
    # CPU's loop on the host over the shortlist nmt train built for the run, in torch
    kernels = "compiled kernels" if native.library() is not None else "torch ops"
    plan = re.fullmatch(
        rf"Decoding plan: fp32 \(auto: .+\), {kernels}, host loop, ([12]) workers?, "
        r"shortlist on, torch",
        lines[5],
    )
    assert plan is not None, lines[5]
    forced = nmt("eval", "--model", str(trained / "run"), "--split", "test", "--precision", "fp32")
    assert "Decoding plan: fp32 (--precision: fp32), " in forced.stdout, forced.stderr
    # translate says the same on stderr, after its output, for the same batches
    planned = [line for line in beam.stderr.splitlines() if line.startswith("Decoding plan: ")]
    assert planned == [lines[5]]
    fp32 = nmt("translate", "-m", str(trained / "run"), "-i", str(trained / "test.src"), "-b", "3",
               "--precision", "fp32", "--workers", "2", "--batch-size", "8")  # fmt: skip
    assert fp32.stdout == beam.stdout  # 5 batches of 8, 2 at a time: the same outputs
    assert (
        f"Decoding plan: fp32 (--precision: fp32), {kernels}, host loop, 2 workers" in fp32.stderr
    )


def test_score_and_align_say_their_forced_pass(trained: Path) -> None:
    """nmt score and nmt align print the plan they ran by on stderr: a forced pass over the
    whole output layer, one batch at a time."""
    kernels = "compiled kernels" if native.library() is not None else "torch ops"
    want = (
        f"Decoding plan: fp32 (--precision: fp32), {kernels}, forced pass, 1 worker, "
        f"shortlist off, torch"
    )
    pair = ["-m", str(trained / "run"), "-i", str(trained / "test.src")]
    pair += ["-t", str(trained / "test.trg"), "--precision", "fp32"]
    for command in ("score", "align"):
        result = nmt(command, *pair)
        assert result.returncode == 0, result.stderr
        assert len(result.stdout.splitlines()) == 40
        assert result.stderr.splitlines()[-1] == want, command


def test_eval_split_named_in_eval_splits_scores_its_files(trained: Path) -> None:
    result = nmt("eval", "--model", str(trained / "run"), "--split", "held", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    plan = report["decoding_plan"]
    assert plan["precision"] == "fp32" and plan["reason"].startswith("auto: ")
    assert plan["loop"] == "host" and plan["backend"] == "torch" and plan["shortlist"] is True
    assert plan["line"].startswith("Decoding plan: fp32 (auto: ")
    by_name = report["systems"][0]
    hyp = trained / "held.hyp"
    translated = nmt(
        "translate",
        "--model",
        str(trained / "run"),
        "-i",
        str(trained / "held.src"),
        "-o",
        str(hyp),
    )
    assert translated.returncode == 0, translated.stderr
    by_files = nmt("eval", str(hyp), "--ref", str(trained / "held.trg"), "--json")
    assert by_files.returncode == 0, by_files.stderr
    assert json.loads(by_files.stdout)["systems"][0]["bleu"] == by_name["bleu"]
    assert ":held (beam" in by_name["name"]


def test_eval_unknown_split_names_the_splits_there_are(trained: Path) -> None:
    result = nmt("eval", "--model", str(trained / "run"), "--split", "books")
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "error: --split 'books': the run's config has dev, test, held and train"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_existing_run_dir_is_refused_without_resume(trained: Path) -> None:
    result = nmt("train", str(trained / "config.yaml"))
    assert result.returncode == 2
    assert "--resume" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  decoder:\n    stlye: luong\n", encoding="utf-8")
    result = nmt("train", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {bad}: model.decoder.stlye: unknown key; did you mean 'style'?"
    )


def test_eval_prints_the_scores_of_a_pair_counted_by_hand(tmp_path: Path) -> None:
    """The table's row for two sentences whose BLEU is counted by hand: n-gram precisions
    8/9, 4/7, 2/5 and 1/3, and 9 hypothesis words for 10 reference words (brevity penalty
    e^(1 - 10/9)); TER: 2 edits for 10 reference words."""
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat\nhello world there\n", encoding="utf-8")
    ref.write_text("the cat sat on a mat\nhello big world there\n", encoding="utf-8")
    bleu = 100 * math.exp(1 - 10 / 9) * (8 / 9 * 4 / 7 * 2 / 5 * 1 / 3) ** 0.25
    result = nmt("eval", str(hyp), "--ref", str(ref))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "System    BLEU   chrF    TER",
        "-------  -----  -----  -----",
        f"hyp.txt  {bleu:.2f}  68.44  20.00",
    ]
    assert lines[3:5] == ["", "Segments: 2"]
    assert lines[5].startswith("BLEU signature: nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    report = json.loads(nmt("eval", str(hyp), "--ref", str(ref), "--json").stdout)
    assert round(report["systems"][0]["bleu"], 2) == round(bleu, 2)


COMMANDS = [
    "train", "translate", "score", "align", "average", "export", "shortlist", "eval", "serve",
]  # fmt: skip
DECODING = ["--length-penalty", "--coverage-penalty", "--ensemble-average"]
MODELS = ["--device", "--precision", "--help"]
FLAGS = {
    "": ["--debug", "--version", "--help"],
    "train": ["--override", "--resume", "--run-dir", "--quiet", "--help"],
    "translate": [
        "--model", "--input", "--output", "--beam", "--n-best", "--scores", "--batch-size",
        "--batch-tokens", "--max-len-ratio", "--max-len-offset", "--length-penalty",
        "--coverage-penalty", "--no-repeat-ngram", "--ensemble-average", "--shortlist",
        "--workers", "--prefix", "--constraints", "--attention-dir", "--alignments",
        "--unbuffered", "--device", "--precision", "--backend", "--help",
    ],
    "score": [
        "--model", "--input", "--target", "--tsv", "--n-best", "--output", "--tokens", *DECODING,
        "--batch-size", "--attention-dir", "--align-ref", *MODELS,
    ],
    "align": [
        "--model", "--input", "--target", "--tsv", "--output", "--extract", "--threshold",
        "--attention", *MODELS,
    ],
    "average": ["--output", "--run", "--last", "--help"],
    "export": ["--output", "--format", "--quantize", "--help"],
    "shortlist": ["--help"],
    "eval": [
        "--ref", "--model", "--split", "--beam", "--save-hypotheses", *DECODING, "--shortlist",
        "--workers", "--significance", "--json", "--align", "--align-ref", "--align-src",
        "--align-trg", *MODELS,
    ],
    "serve": [
        "--model", "--host", "--port", "--max-sentences", "--max-chars", "--max-body",
        "--max-beam", "--batch-window-ms", "--max-batch", "--no-batching", *MODELS,
    ],
}  # fmt: skip


def _help(*command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "nmt", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},  # one row per option, none wrapped
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:4] == ["Usage:", "python", "-m", "nmt"]
    return result.stdout


def _rows(text: str, panel: str) -> list[str]:
    """The first word of each row of a help panel (Options, Commands)."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("╭─"):
            inside = line.startswith(f"╭─ {panel} ")
        elif inside and (match := re.match(r"│ [ *]? {0,3}(\S+)", line)):
            rows.append(match.group(1))
    return rows


def test_help_lists_the_commands() -> None:
    assert _rows(_help(), "Commands") == COMMANDS


STARTS_WITHOUT_TORCH = """
import sys
from nmt import cli

for arguments in sys.argv[1:]:
    sys.argv = ["nmt", *arguments.split("|")]
    try:
        cli.main()
    except SystemExit as exit:
        print(exit.code)
print("torch" in sys.modules)
"""


def test_help_a_config_error_and_scoring_files_start_without_torch(tmp_path: Path) -> None:
    """What answers at once does not wait seconds for torch's import: help, a config that is
    not there, and `nmt eval` of files (sacrebleu alone)."""
    (tmp_path / "hyp.txt").write_text("the cat sat on the mat\n", encoding="utf-8")
    hyp, missing = tmp_path / "hyp.txt", tmp_path / "missing.yaml"
    calls = ["--help", "translate|--help", f"train|{missing}", f"eval|{hyp}|--ref|{hyp}|--json"]
    done = subprocess.run(
        [sys.executable, "-c", STARTS_WITHOUT_TORCH, *calls], capture_output=True, text=True
    )
    assert done.stdout.splitlines()[-1] == "False", done.stdout + done.stderr
    assert f"error: {missing}: no such config file" in done.stderr
    assert [line for line in done.stdout.splitlines() if line in ("0", "2")] == ["0", "0", "2", "0"]
    assert '"bleu": 100.0' in done.stdout


@pytest.mark.parametrize("command", list(FLAGS))
def test_help_lists_every_flag(command: str) -> None:
    """Each command's help lists its flags, in their order, each once (in this process: the
    entry point's own help is ``test_help_lists_the_commands``')."""
    from typer.testing import CliRunner

    from nmt.cli import app

    arguments = [*command.split(), "--help"]
    result = CliRunner().invoke(app, arguments, prog_name="nmt", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert _rows(result.stdout, "Options") == FLAGS[command]


def test_one_batch_equals_line_by_line(trained: Path) -> None:
    """Batching never changes a translation: the whole file at once equals one line at a time."""
    source = (trained / "test.src").read_text(encoding="utf-8").splitlines()[:12]
    from nmt.decoding.translator import Translator

    translator = Translator.from_checkpoint(trained / "run", "cpu")
    decoding = translator.config.decoding.model_copy(update={"beam_size": 4, "batch_size": 64})
    together = [
        translator.detokenize(t.hypotheses[0]) for t in translator.translate(source, decoding)
    ]
    alone = [
        translator.detokenize(translator.translate([line], decoding)[0].hypotheses[0])
        for line in source
    ]
    assert together == alone
    assert len(set(together)) > 3  # the outputs are real, varied translations


def test_run_dir_in_use_is_refused(trained: Path, tmp_path: Path) -> None:
    from nmt.training.rundir import RunLock

    run_dir = tmp_path / "busy"
    with RunLock(run_dir):
        result = nmt("train", str(trained / "config.yaml"), "--run-dir", str(run_dir))
    assert result.returncode == 2
    assert "in use by pid" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (run_dir / "config.yaml").exists()  # nothing was written by the refused run


def test_eval_two_systems_reports_paired_significance(trained: Path) -> None:
    greedy, beam = trained / "greedy.txt", trained / "beam.txt"
    for path, width in ((greedy, "1"), (beam, "4")):
        result = nmt(
            "translate", "-m", str(trained / "run"), "-i", str(trained / "test.src"),
            "-o", str(path), "--beam", width,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    result = nmt("eval", str(greedy), str(beam), "--ref", str(trained / "test.trg"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["significance"] == "bootstrap"
    baseline, other = report["systems"]
    assert baseline["p_bleu"] is None and 0.0 <= other["p_bleu"] <= 1.0
    table = nmt("eval", str(greedy), str(beam), "--ref", str(trained / "test.trg"))
    assert "greedy.txt" in table.stdout and "beam.txt" in table.stdout


def test_translate_in_bf16(trained: Path) -> None:
    result = nmt(
        "translate",
        "--model",
        str(trained / "run"),
        "--precision",
        "bf16",
        stdin="sol luna\n\nmar\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["LUNA SOL", "", "MAR"]
    bad = nmt("translate", "--model", str(trained / "run"), "--precision", "fp8", stdin="sol\n")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: Invalid value for '--precision'") and "'fp8'" in bad.stderr
