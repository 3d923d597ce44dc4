"""What bad input gets (issue 7), driven through the command line as a user types it.

Every user error is one stderr line ``error: ...`` naming the file and line or the config key,
exit status 2, and nothing already written is changed. Most cases call ``nmt.cli.main`` in
this process (the same code path as the ``nmt`` script, without a fresh interpreter per
case); the ones about the interpreter itself (usage errors, ``--debug``, Ctrl-C) run
``python -m nmt`` in a subprocess.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import (
    WORDS,
    Result,
    nmt,
    nmt_process,
    reversal,
    tiny_config,
    unchanged,
    write_config,
    write_pair,
)

from nmt.config import DataConfig
from nmt.data.corpus import read_pairs

# ----------------------------------------------------------------------------- config


def test_config_not_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  epochs: 3\nmodel: [unclosed\n  x: 1\n", encoding="utf-8")
    assert nmt("train", str(path)).error.startswith(f"error: {path}:4: not valid YAML")


def test_config_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n", encoding="utf-8")
    assert nmt("train", str(path)).error == (
        f"error: {path}: expected a mapping of sections, got list"
    )


def test_config_unknown_key_did_you_mean(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml", {"training": {"epohcs": 3}})
    assert nmt("train", str(path)).error == (
        f"error: {path}: training.epohcs: unknown key; did you mean 'epochs'?"
    )


def test_config_wrong_type_and_range_all_at_once(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml", {"training": {"epochs": 0, "learning_rate": "x"}})
    error = nmt("train", str(path)).error
    assert error.startswith(f"error: {path}: ")
    assert "training.epochs: got 0" in error and "training.learning_rate: got 'x'" in error


def test_config_incompatible_choices(tmp_path: Path) -> None:
    model = {"encoder": {"hidden_size": 4}, "decoder": {"hidden_size": 6}}
    path = write_config(tmp_path / "c.yaml", {"model": {**model, "attention": {"score": "dot"}}})
    error = nmt("train", str(path)).error
    assert "model.attention.score: 'dot' needs equal query and key sizes" in error
    assert "'general'" in error  # what would work


def test_config_bad_override(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml", {})
    assert "--override 'training.epochs'" in nmt("train", str(path), "-O", "training.epochs").error
    error = nmt("train", str(path), "-O", "training.epoch=2").error
    assert "training.epoch: unknown key; did you mean 'epochs'?" in error


def test_config_missing_data_files_checked_before_anything_is_written(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    config["data"]["train"] = str(tmp_path / "absent" / "train")
    path = write_config(tmp_path / "c.yaml", config)
    error = nmt("train", str(path)).error
    assert f"data.train: {tmp_path / 'absent' / 'train.src'}: no such file" in error
    assert f"data.dev: {tmp_path / 'dev.src'}: no such file" in error  # every problem at once
    assert not (tmp_path / "run").exists()


def test_config_run_dir_that_is_a_file(tmp_path: Path, corpus: Path) -> None:
    path = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    (tmp_path / "file").write_text("keep\n", encoding="utf-8")
    error = nmt("train", str(path), "--run-dir", str(tmp_path / "file")).error
    assert error.startswith("error: run.dir: ") and "is a file" in error
    error = nmt("train", str(path), "--run-dir", str(tmp_path / "file" / "sub")).error
    assert error.startswith("error: run.dir: cannot create")
    assert (tmp_path / "file").read_text(encoding="utf-8") == "keep\n"


def test_config_path_that_does_not_exist(tmp_path: Path) -> None:
    error = nmt("train", str(tmp_path / "absent.yaml")).error
    assert error.startswith(f"error: {tmp_path / 'absent.yaml'}: no such config file")
    assert "is a directory" in nmt("train", str(tmp_path)).error


# ----------------------------------------------------------------------------- data


def train_result(tmp_path: Path, corpus: Path, **data: object) -> tuple[Result, Path]:
    """Train on tmp_path/train.{src,trg} with the module's dev set; returns (result, log)."""
    config = tiny_config(corpus, **data)
    config["data"]["train"] = str(tmp_path / "train")
    run_dir = tmp_path / "run"
    path = write_config(tmp_path / "c.yaml", config)
    result = nmt("train", str(path), "--quiet", "--run-dir", str(run_dir))
    log = run_dir / "train.log"
    return result, log


def test_data_line_counts_differ(tmp_path: Path, corpus: Path) -> None:
    src, trg = reversal(30, seed=5)
    write_pair(tmp_path / "train", src, trg[:29])
    result, _ = train_result(tmp_path, corpus)
    assert result.error == (
        f"error: {tmp_path / 'train.src'}:30: no partner line: {tmp_path / 'train.trg'} ends "
        f"after line 29 but {tmp_path / 'train.src'} has 30 lines; parallel files must have one "
        "sentence per line on both sides"
    )


def test_data_invalid_utf8_names_file_and_line(tmp_path: Path, corpus: Path) -> None:
    write_pair(tmp_path / "train", *reversal(30, seed=5))
    src = tmp_path / "train.src"
    lines = src.read_bytes().split(b"\n")
    lines[6] = b"casa de \xe1rbol"  # Latin-1 on line 7
    src.write_bytes(b"\n".join(lines))
    result, _ = train_result(tmp_path, corpus)
    assert result.error.startswith(f"error: {src}:7: not valid UTF-8")
    assert "data.utf8_errors: replace" in result.error  # what to do


def test_data_invalid_utf8_replaced_with_a_counted_warning(tmp_path: Path, corpus: Path) -> None:
    write_pair(tmp_path / "train", *reversal(30, seed=5))
    src = tmp_path / "train.src"
    lines = src.read_bytes().split(b"\n")
    lines[6], lines[9] = b"casa de \xe1rbol", b"\xff\xfe"
    src.write_bytes(b"\n".join(lines))
    result, log = train_result(tmp_path, corpus, utf8_errors="replace")
    assert result.code == 0, result.err
    assert f"{src}: 2 lines with invalid UTF-8 (the first is line 7)" in log.read_text()


def test_data_crlf_endings_never_reach_the_tokenizer(tmp_path: Path, corpus: Path) -> None:
    src, trg = reversal(30, seed=5)
    src[3] = "sol\rluna"  # a stray carriage return inside a line does not split it
    write_pair(tmp_path / "train", src, trg, newline="\r\n")
    cfg = DataConfig(src_lang="src", trg_lang="trg")
    rows = read_pairs(cfg, str(tmp_path / "train"), tmp_path / "cache")
    assert len(rows) == 30
    assert not any(line.endswith("\r") for line in [*rows["src"], *rows["trg"]])
    assert list(rows["trg"]) == trg
    result, _ = train_result(tmp_path, corpus)
    assert result.code == 0, result.err
    sentencepiece = pytest.importorskip("sentencepiece")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "run/spm.model"))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    assert not any("\r" in piece for piece in pieces)


def test_data_empty_lines_dropped_with_a_count_in_the_log(tmp_path: Path, corpus: Path) -> None:
    src, trg = reversal(30, seed=5)
    src[2], trg[5], src[8], trg[8] = "", "   ", "\t", ""
    write_pair(tmp_path / "train", src, trg)
    result, log = train_result(tmp_path, corpus)
    assert result.code == 0, result.err
    assert "train: dropped 3 pairs with an empty side" in log.read_text()


def test_data_long_pairs_filtered_with_a_count_in_the_log(tmp_path: Path, corpus: Path) -> None:
    src, trg = reversal(30, seed=5)
    src[4] = " ".join(WORDS * 10)
    trg[7] = " ".join(w.upper() for w in WORDS * 10)
    write_pair(tmp_path / "train", src, trg)
    result, log = train_result(tmp_path, corpus, max_length=40)
    assert result.code == 0, result.err
    assert "train: dropped 2 pairs longer than data.max_length=40" in log.read_text()


def test_data_nothing_left_after_filtering_names_the_key(tmp_path: Path, corpus: Path) -> None:
    write_pair(tmp_path / "train", ["", " "], ["a", ""])
    result, _ = train_result(tmp_path, corpus)
    assert result.error.startswith(f"error: data.train: {tmp_path / 'train'}")
    write_pair(tmp_path / "train", *reversal(30, seed=5))
    result, _ = train_result(tmp_path, corpus, max_length=1)
    assert result.error.startswith("error: data.max_length: ")


def test_data_empty_files_are_an_empty_training_set(tmp_path: Path, corpus: Path) -> None:
    write_pair(tmp_path / "train", [], [])
    result, _ = train_result(tmp_path, corpus)
    assert result.error.startswith(f"error: data.train: {tmp_path / 'train'}")


def test_data_empty_files_with_a_tokenizer_given(tmp_path: Path, corpus: Path, run: Path) -> None:
    """tokenizer.model: no tokenizer trains on the corpus first, and preparing it used to be a
    KeyError traceback."""
    write_pair(tmp_path / "train", [], [])
    config = tiny_config(corpus)
    config["data"]["train"] = str(tmp_path / "train")
    config["tokenizer"]["model"] = str(run / "spm.model")
    path = write_config(tmp_path / "c.yaml", config)
    result = nmt("train", str(path), "--quiet", "--run-dir", str(tmp_path / "run"))
    assert result.error == (
        f"error: data.train: {tmp_path / 'train'}: none of its 0 pairs has text on both sides; "
        f"point data.train at the training corpus"
    )


# ----------------------------------------------------------------------------- translate, eval


def test_translate_missing_checkpoint(tmp_path: Path, corpus: Path, previous: Path) -> None:
    missing = tmp_path / "absent.pt"
    result = nmt(
        "translate", "-m", str(missing), "-i", str(corpus / "test.src"), "-o", str(previous)
    )
    assert result.error.startswith(f"error: {missing}: no such checkpoint file or run directory")
    assert unchanged(previous)


def test_translate_truncated_checkpoint(
    tmp_path: Path, corpus: Path, run: Path, previous: Path
) -> None:
    data = (run / "best.pt").read_bytes()
    half = tmp_path / "half.pt"
    half.write_bytes(data[: len(data) // 2])
    result = nmt("translate", "-m", str(half), "-i", str(corpus / "test.src"), "-o", str(previous))
    assert result.error.startswith(f"error: {half}: cannot read checkpoint")
    assert "truncated" in result.error
    assert unchanged(previous)


def test_translate_incompatible_format(
    tmp_path: Path, corpus: Path, run: Path, previous: Path
) -> None:
    state = torch.load(run / "best.pt", weights_only=False)
    state["format"] = 99
    future = tmp_path / "future.pt"
    torch.save(state, future)
    result = nmt(
        "translate", "-m", str(future), "-i", str(corpus / "test.src"), "-o", str(previous)
    )
    assert result.error.startswith(f"error: {future}: checkpoint format 99")
    assert unchanged(previous)


def test_translate_tokenizer_that_does_not_match_the_vocabulary(
    tmp_path: Path, corpus: Path, run: Path, previous: Path
) -> None:
    from nmt.data.tokenizer import train_sentencepiece

    state = torch.load(run / "best.pt", weights_only=False)
    text = [" ".join(random.Random(i).sample(WORDS, 5)) for i in range(200)]
    other = train_sentencepiece(text, 60, "bpe", 1.0, 1000, seed=1)
    state["tokenizer"] = {"src": other, "trg": other}
    swapped = tmp_path / "swapped.pt"
    torch.save(state, swapped)
    result = nmt(
        "translate", "-m", str(swapped), "-i", str(corpus / "test.src"), "-o", str(previous)
    )
    assert result.error.startswith(f"error: {swapped}: its tokenizer has")
    assert "encoder.embed.weight has 40 rows" in result.error
    assert unchanged(previous)


def test_translate_empty_input_gives_empty_output(
    tmp_path: Path, run: Path, previous: Path
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    result = nmt("translate", "-m", str(run), "-i", str(empty), "-o", str(previous))
    assert result.code == 0, result.err
    assert previous.read_bytes() == b""
    result = nmt("translate", "-m", str(run))
    assert (result.code, result.out) == (0, "")


def test_translate_a_line_far_longer_than_training(tmp_path: Path, run: Path) -> None:
    from nmt.decoding.translator import Translator

    line = " ".join(random.Random(0).choice(WORDS) for _ in range(150))  # training: 2-6 words
    source = tmp_path / "long.txt"
    source.write_text(f"sol luna\n{line}\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    args = ["-m", str(run), "-i", str(source), "-o", str(out), "--beam", "2"]
    result = nmt("translate", *args, "--max-len-ratio", "0.5", "--max-len-offset", "3")
    assert result.code == 0, result.err
    assert len(out.read_text(encoding="utf-8").split("\n")) == 3  # two lines and the final \n
    translator = Translator.from_checkpoint(run, "cpu")
    decoding = translator.config.decoding.model_copy(
        update={"beam_size": 2, "max_len_ratio": 0.5, "max_len_offset": 3}
    )
    (item,) = translator.translate([line], decoding)
    limit = -(-len(item.src_ids) // 2) + 3  # ceil(0.5 * |x|) + offset, EOS included
    assert len(item.src_ids) > 150
    assert 1 <= len(item.hypotheses[0].tokens) + 1 <= limit


def test_eval_files_of_different_lengths(tmp_path: Path, corpus: Path) -> None:
    hyp = corpus / "dev.trg"  # 12 lines
    ref = corpus / "test.trg"  # 10 lines
    assert nmt("eval", str(hyp), "--ref", str(ref)).error == (
        f"error: {hyp} has 12 lines but {ref} has 10; "
        "hypotheses and references must align line by line"
    )


def test_translate_n_best_larger_than_beam(corpus: Path, run: Path, previous: Path) -> None:
    args = ["-m", str(run), "-i", str(corpus / "test.src"), "-o", str(previous)]
    error = nmt("translate", *args, "--beam", "2", "--n-best", "3").error
    assert error.startswith("error: --n-best 3 is larger than --beam 2")
    assert "raise --beam or lower --n-best" in error
    assert unchanged(previous)


def test_output_in_a_missing_directory(tmp_path: Path, corpus: Path, run: Path) -> None:
    out = tmp_path / "no" / "such" / "out.txt"
    error = nmt("translate", "-m", str(run), "-i", str(corpus / "test.src"), "-o", str(out)).error
    assert error.startswith(f"error: --output {out}: the folder {out.parent} does not exist")
    error = nmt("eval", "-m", str(run), "--save-hypotheses", str(out)).error
    assert error.startswith(f"error: --save-hypotheses {out}: the folder")
    assert not (tmp_path / "no").exists()


def test_translate_invalid_utf8_on_stdin(run: Path) -> None:
    result = nmt("translate", "-m", str(run), stdin=b"sol luna\nmar \xe1rbol\n")
    assert result.error.startswith("error: <stdin>:2: not valid UTF-8")
    assert result.out == ""


def test_translate_missing_input_file(tmp_path: Path, run: Path, previous: Path) -> None:
    missing = tmp_path / "absent.txt"
    error = nmt("translate", "-m", str(run), "-i", str(missing), "-o", str(previous)).error
    assert error == f"error: {missing}: no such file"
    assert unchanged(previous)


def test_every_output_is_written_whole_with_no_temporary_files(
    tmp_path: Path, corpus: Path, run: Path
) -> None:
    out, hyps, attention = tmp_path / "out.txt", tmp_path / "hyps.txt", tmp_path / "attention"
    args = ["-i", str(corpus / "test.src"), "-o", str(out), "--attention-dir", str(attention)]
    assert nmt("translate", "-m", str(run), *args).code == 0
    assert nmt("eval", "-m", str(run), "--save-hypotheses", str(hyps)).code == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 10
    assert len(hyps.read_text(encoding="utf-8").splitlines()) == 10
    assert len(list(attention.glob("*.npy"))) == 10 == len(list(attention.glob("*.png")))
    leftovers = [p for p in [*tmp_path.iterdir(), *attention.iterdir()] if p.suffix == ".tmp"]
    assert not leftovers
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~_umask()  # not mkstemp's private 0600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- the interpreter


def test_usage_errors_keep_clicks_message_and_exit_2(run: Path) -> None:
    result = nmt_process("translate", "-m", str(run), "--no-such-option")
    assert result.returncode == 2
    assert "No such option: --no-such-option" in result.stderr
    result = nmt_process("translate")
    assert result.returncode == 2
    assert "Missing option '--model'" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    plain = nmt_process("train", str(missing))
    assert (plain.returncode, plain.stderr.count("\n")) == (2, 1)
    debug = nmt_process("--debug", "train", str(missing))
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().endswith(
        f"ConfigError: {missing}: no such config file; see configs/ for examples"
    )


def test_ctrl_c_during_training_exits_130_with_a_checkpoint(tmp_path: Path, corpus: Path) -> None:
    config = tiny_config(corpus)
    config["training"] = {"epochs": 1000, "batch_tokens": 100, "validate_every": 10_000}
    path = write_config(tmp_path / "c.yaml", config)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "train", str(path), "--run-dir", str(run_dir)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    log = run_dir / "train.log"
    while not (log.is_file() and "epoch 2:" in log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"interrupted: {run_dir / 'last.pt'} is saved; continue with --resume"
    )
    state = torch.load(run_dir / "last.pt", weights_only=False)
    assert state["progress"]["step"] > 0
