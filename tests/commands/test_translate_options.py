"""`nmt translate`'s decoding options: ensembles (--model twice), --prefix, --constraints,
--unbuffered in a pipe, `nmt eval` of an ensemble, and one-line errors for bad option files."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from clirun import nmt, tiny_config, unchanged, write_config

SOURCES = ["sol luna", "mar rio casa", "", "agua fuego", "perro gato"]
# Whole target words of the corpus; an empty prefix on a non-empty line (line 4).
PREFIXES = ["LUNA", "CASA RIO", "", "", "GATO"]
CONSTRAINTS = [["SOL"], ["MAR", "CASA"], [], [], ["PERRO GATO"]]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def source(corpus: Path) -> Path:
    return _write(corpus / "steer.src", SOURCES)


@pytest.fixture(scope="module")
def plain(run: Path, source: Path) -> list[str]:
    """The run's output for SOURCES without options."""
    result = nmt("translate", "-m", str(run), "-i", str(source))
    assert result.code == 0, result.err
    lines = result.out.split("\n")[:-1]
    assert len(lines) == len(SOURCES) and lines[2] == ""
    return lines


@pytest.fixture(scope="module")
def other(corpus: Path, run: Path) -> Path:
    """A tiny run with another tokenizer (tokenizer.vocab_size 45 instead of 40)."""
    config = tiny_config(corpus)
    config["tokenizer"]["vocab_size"] = 45
    config["run"] = {"dir": str(corpus / "other"), "device": "cpu", "tensorboard": False}
    result = nmt("train", str(write_config(corpus / "other.yaml", config)), "--quiet")
    assert result.code == 0, result.err
    return corpus / "other"


# ----------------------------------------------------------------------------- ensembles


@pytest.mark.parametrize("average", [None, "linear", "log_linear"])
def test_ensemble_of_a_run_with_itself_translates_as_the_run(
    run: Path, source: Path, plain: list[str], average: str | None
) -> None:
    """-m RUN -m RUN writes RUN's output lines (default, linear and log-linear average)."""
    options = [] if average is None else ["--ensemble-average", average]
    result = nmt("translate", "-m", str(run), "-m", str(run), "-i", str(source), *options)
    assert result.code == 0, result.err
    assert result.out.split("\n")[:-1] == plain


def test_ensemble_of_runs_with_different_tokenizers(
    run: Path, other: Path, source: Path, previous: Path
) -> None:
    """Two runs whose tokenizers differ: one line naming both models, output untouched."""
    result = nmt(
        "translate", "-m", str(run), "-m", str(other), "-i", str(source), "-o", str(previous)
    )
    assert str(run) in result.error and str(other) in result.error
    assert "tokenizer" in result.error
    assert unchanged(previous)


def test_eval_of_an_ensemble_of_a_run_with_itself(run: Path) -> None:
    """nmt eval -m RUN -m RUN --split test: the BLEU (and chrF, TER) of RUN alone."""
    alone = nmt("eval", "--model", str(run), "--split", "test", "--json")
    both = nmt("eval", "--model", str(run), "--model", str(run), "--split", "test", "--json")
    assert alone.code == 0 and both.code == 0, (alone.err, both.err)
    (one,) = json.loads(alone.out)["systems"]
    (two,) = json.loads(both.out)["systems"]
    for metric in ("bleu", "bleu_detail", "chrf", "ter"):
        assert two[metric] == one[metric], metric


def test_eval_of_runs_with_different_tokenizers(run: Path, other: Path) -> None:
    """nmt eval of two runs with different tokenizers: one line naming both."""
    result = nmt("eval", "--model", str(run), "--model", str(other), "--split", "test")
    assert str(run) in result.error and str(other) in result.error


# ----------------------------------------------------------------------------- prefixes


def test_every_output_starts_with_its_prefix(
    run: Path, source: Path, plain: list[str], tmp_path: Path
) -> None:
    """--prefix: each output starts with its line's prefix; empty prefix lines: plain output."""
    prefix = _write(tmp_path / "prefix.txt", PREFIXES)
    result = nmt("translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix))
    assert result.code == 0, result.err
    lines = result.out.split("\n")[:-1]
    assert len(lines) == len(SOURCES)
    for line, text, before in zip(lines, PREFIXES, plain, strict=True):
        if text:
            assert line.startswith(text), (line, text)
        else:
            assert line == before


def test_outputs_at_their_length_limit_are_counted(run: Path, source: Path, tmp_path: Path) -> None:
    """A limit of ceil(0.001 x pieces) + 0 = 1 leaves room for EOS alone: every line's
    output is empty, and one warning counts them; with prefixes the limit adds their
    tokens, and the outputs are the prefixes, at their limit too."""
    tiny = ["--max-len-ratio", "0.001", "--max-len-offset", "0"]
    result = nmt("translate", "-m", str(run), "-i", str(source), *tiny)
    assert result.code == 0, result.err
    assert result.out == "\n" * len(SOURCES)
    want = "warning: 4 of 4 outputs stopped at their length limit (ceil(0.001 x source pieces) + 0)"
    assert want in result.err
    prefix = _write(tmp_path / "prefix.txt", PREFIXES)
    steered = nmt("translate", "-m", str(run), "-i", str(source), *tiny, "--prefix", str(prefix))
    assert steered.code == 0, steered.err
    assert steered.out.split("\n")[:-1] == PREFIXES
    assert "4 of 4 outputs stopped" in steered.err and "+ 0 + forced tokens)" in steered.err


def test_prefix_with_greedy_search(run: Path, source: Path, tmp_path: Path) -> None:
    """--prefix with --beam 1 (greedy) and with --n-best: every hypothesis starts with it."""
    prefix = _write(tmp_path / "prefix.txt", PREFIXES)
    greedy = nmt(
        "translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix), "--beam", "1"
    )
    assert greedy.code == 0, greedy.err
    for line, text in zip(greedy.out.split("\n")[:-1], PREFIXES, strict=True):
        assert line.startswith(text)
    nbest = nmt(
        "translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix),
        "--n-best", "3", "--beam", "3",
    )  # fmt: skip
    assert nbest.code == 0, nbest.err
    for row in nbest.out.splitlines():
        index, _, _, text = row.split("\t")
        assert text.startswith(PREFIXES[int(index)])


# ----------------------------------------------------------------------------- constraints


def test_every_output_contains_every_phrase(
    run: Path, source: Path, plain: list[str], tmp_path: Path
) -> None:
    """--constraints: each output contains each of its phrases; [] and empty lines: plain."""
    rows = [json.dumps(c) if c else "" for c in CONSTRAINTS]
    rows[2] = "[]"  # the empty input line: [] is none too
    constraints = _write(tmp_path / "c.jsonl", rows)
    result = nmt("translate", "-m", str(run), "-i", str(source), "--constraints", str(constraints))
    assert result.code == 0, result.err
    assert "no output meets all its constraints" not in result.err
    lines = result.out.split("\n")[:-1]
    assert len(lines) == len(SOURCES)
    for line, phrases, before in zip(lines, CONSTRAINTS, plain, strict=True):
        if phrases:
            assert all(p in line for p in phrases), (line, phrases)
        else:
            assert line == before


def test_every_n_best_hypothesis_contains_every_phrase(
    run: Path, source: Path, tmp_path: Path
) -> None:
    """--constraints with --n-best 3: every row of a constrained line has its phrases."""
    constraints = _write(tmp_path / "c.jsonl", [json.dumps(c) for c in CONSTRAINTS])
    result = nmt(
        "translate", "-m", str(run), "-i", str(source), "--constraints", str(constraints),
        "--n-best", "3", "--beam", "5",
    )  # fmt: skip
    assert result.code == 0, result.err
    rows = [row.split("\t") for row in result.out.splitlines()]
    assert {int(r[0]) for r in rows} == set(range(len(SOURCES)))
    for index, _, _, text in rows:
        assert all(p in text for p in CONSTRAINTS[int(index)]), (text, index)


def test_prefix_and_constraints_together(run: Path, source: Path, tmp_path: Path) -> None:
    """Both files: each output starts with its prefix and contains its phrases."""
    prefix = _write(tmp_path / "prefix.txt", PREFIXES)
    constraints = _write(tmp_path / "c.jsonl", [json.dumps(c) for c in CONSTRAINTS])
    result = nmt(
        "translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix),
        "--constraints", str(constraints),
    )  # fmt: skip
    assert result.code == 0, result.err
    for i, line in enumerate(result.out.split("\n")[:-1]):
        if SOURCES[i]:
            assert line.startswith(PREFIXES[i]) and all(p in line for p in CONSTRAINTS[i])


# ----------------------------------------------------------------------------- bad option files


def _refused(run: Path, source: Path, previous: Path, *options: str) -> str:
    """The one error line of translate with ``options``; the output file stays as it was."""
    result = nmt("translate", "-m", str(run), "-i", str(source), "-o", str(previous), *options)
    error = result.error
    assert unchanged(previous)
    return error


@pytest.mark.parametrize("option", ["--prefix", "--constraints"])
@pytest.mark.parametrize("count", [4, 6])
def test_option_file_with_the_wrong_line_count(
    run: Path, source: Path, previous: Path, tmp_path: Path, option: str, count: int
) -> None:
    """A --prefix or --constraints file with fewer or more lines than the input."""
    path = _write(tmp_path / "steer.txt", [""] * count)
    error = _refused(run, source, previous, option, str(path))
    assert f"{option} {path} has {count} lines but the input has {len(SOURCES)}" in error


@pytest.mark.parametrize(
    ("line2", "says"),
    [
        ('["MAR"', "line 2: not JSON"),
        ("MAR", "line 2: not JSON"),
        ('{"phrases": ["MAR"]}', "line 2: expected a JSON list"),
        ('"MAR"', "line 2: expected a JSON list"),
        ("[1, 2]", "line 2: expected a JSON list"),
        ('[["MAR"]]', "line 2: expected a JSON list"),
        ('["SOL", ""]', "line 2: an empty constraint phrase"),
        ('["   "]', "line 2: an empty constraint phrase"),
        ('["\u4e2d\u6587"]', "line 2: '\u4e2d\u6587' has pieces"),
        ('["SOL \U0001f600"]', "line 2: 'SOL \U0001f600' has pieces"),
    ],
)
def test_bad_constraint_lines(
    run: Path, source: Path, previous: Path, tmp_path: Path, line2: str, says: str
) -> None:
    """Line 2 of --constraints not JSON, not a list of strings, with an empty phrase or with
    characters the target vocabulary lacks: the file and line 2 named."""
    path = _write(tmp_path / "c.jsonl", ['["SOL"]', line2, "", "[]", ""])
    error = _refused(run, source, previous, "--constraints", str(path))
    assert f"{path} {says}" in error


def test_a_prefix_or_phrase_that_no_repeat_ngram_forbids(
    run: Path, source: Path, previous: Path, tmp_path: Path
) -> None:
    """A prefix or constraint phrase that repeats what --no-repeat-ngram forbids can be in no
    output: an error naming its line, not an empty output line."""
    prefix = _write(tmp_path / "p.txt", ["", "LUNA LUNA", "", "", ""])
    error = _refused(run, source, previous, "--prefix", str(prefix), "--no-repeat-ngram", "1")
    assert error == (
        f"error: {prefix} line 2: 'LUNA LUNA' repeats a piece, which --no-repeat-ngram 1 "
        f"forbids in every output; give a larger --no-repeat-ngram (0: none)"
    )
    phrases = _write(tmp_path / "c.jsonl", ["", "", "", '["SOL", "MAR MAR"]', ""])
    refused = ["--constraints", str(phrases), "--no-repeat-ngram", "1"]
    assert f"{phrases} line 4: 'MAR MAR' repeats a piece" in _refused(
        run, source, previous, *refused
    )
    allowed = nmt("translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix),
                  "--no-repeat-ngram", "9")  # fmt: skip
    assert allowed.code == 0, allowed.err
    assert allowed.out.split("\n")[1].startswith("LUNA LUNA")


def test_a_line_no_output_can_meet_scores_minus_infinity(
    run: Path, source: Path, tmp_path: Path
) -> None:
    """Two phrases that no_repeat_ngram 1 forbids together: line 1 has no hypothesis, so its
    score is -inf (not 0, the best there is), with a warning naming it; the empty line 3
    scores 0, as ever; n-best rows alike."""
    phrases = _write(tmp_path / "c.jsonl", ['["SOL", "SOL"]', "", "", "", ""])
    steer = ["--constraints", str(phrases), "--no-repeat-ngram", "1", "--beam", "3"]
    result = nmt("translate", "-m", str(run), "-i", str(source), *steer, "--scores")
    assert result.code == 0, result.err
    lines = result.out.split("\n")[:-1]
    assert lines[0] == "-inf\t" and lines[2] == "0.0000\t"
    assert "input line 1: no output meets all its constraints" in result.err
    rows = nmt("translate", "-m", str(run), "-i", str(source), *steer, "--n-best", "2")
    assert rows.out.split("\n")[0] == "0\t1\t-inf\t"


@pytest.mark.parametrize("text", ["\u4e2d\u6587", "LUNA \U0001f600"])
def test_prefix_with_characters_the_vocabulary_lacks(
    run: Path, source: Path, previous: Path, tmp_path: Path, text: str
) -> None:
    """A prefix on line 2 the target vocabulary cannot spell: file, line 2 and the text."""
    path = _write(tmp_path / "prefix.txt", ["LUNA", text, "", "", ""])
    error = _refused(run, source, previous, "--prefix", str(path))
    assert f"{path} line 2: {text!r}" in error and "vocabulary lacks" in error


def test_a_missing_prefix_or_constraints_file(
    run: Path, source: Path, previous: Path, tmp_path: Path
) -> None:
    """--prefix or --constraints naming no file: the option and the path named."""
    missing = tmp_path / "nope.txt"
    for option in ("--prefix", "--constraints"):
        error = _refused(run, source, previous, option, str(missing), "--beam", "2")
        assert f"{option} {missing}: no such file" in error


def test_constraints_with_greedy_search(
    run: Path, source: Path, previous: Path, tmp_path: Path
) -> None:
    """--constraints with --beam 1 is refused, naming --constraints and the beam."""
    path = _write(tmp_path / "c.jsonl", [json.dumps(c) for c in CONSTRAINTS])
    error = _refused(run, source, previous, "--constraints", str(path), "--beam", "1")
    assert "--constraints" in error and "--beam 1" in error


def test_unbuffered_with_output_file(run: Path, source: Path, previous: Path) -> None:
    """--unbuffered writes to stdout: with --output it is refused, naming both."""
    error = _refused(run, source, previous, "--unbuffered")
    assert "--unbuffered" in error and "--output" in error


@pytest.mark.parametrize("option", ["--prefix", "--constraints"])
def test_output_onto_an_option_file(run: Path, source: Path, tmp_path: Path, option: str) -> None:
    """-o naming the --prefix or --constraints file: refused and the file intact."""
    path = _write(tmp_path / "steer.txt", [""] * len(SOURCES))
    before = path.read_bytes()
    result = nmt("translate", "-m", str(run), "-i", str(source), option, str(path), "-o", str(path))
    assert f"--output {path}" in result.error and option in result.error
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- --unbuffered


def test_unbuffered_in_process_equals_the_batch(
    run: Path, source: Path, plain: list[str], tmp_path: Path
) -> None:
    """--unbuffered on piped stdin: the same lines as the batch, empty line included, and with
    --prefix the batch's prefixed lines."""
    stdin = source.read_bytes()
    result = nmt("translate", "-m", str(run), "--unbuffered", stdin=stdin)
    assert result.code == 0, result.err
    assert result.out.split("\n")[:-1] == plain
    prefix = _write(tmp_path / "prefix.txt", PREFIXES)
    batch = nmt("translate", "-m", str(run), "-i", str(source), "--prefix", str(prefix))
    streamed = nmt(
        "translate", "-m", str(run), "--unbuffered", "--prefix", str(prefix), stdin=stdin
    )
    assert streamed.code == 0, streamed.err
    assert streamed.out == batch.out


def test_unbuffered_answers_each_line_before_stdin_closes(
    run: Path, plain: list[str], tmp_path: Path
) -> None:
    """In a pipe, --unbuffered writes each line's translation while stdin is still open."""
    stderr = (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "translate", "-m", str(run), "--unbuffered"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        encoding="utf-8",
    )
    assert process.stdin is not None and process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout],  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()

    def answer() -> str:
        try:
            return lines.get(timeout=60)
        except queue.Empty:
            process.kill()
            raise AssertionError(
                "no output line within 60 s while stdin is open: "
                + (tmp_path / "stderr.txt").read_text(encoding="utf-8")
            ) from None

    try:
        process.stdin.write(SOURCES[0] + "\n")
        process.stdin.flush()
        first = answer()
        assert process.poll() is None  # still running: stdin is open
        process.stdin.write(SOURCES[1] + "\n")
        process.stdin.flush()
        second = answer()
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        stderr.close()
    reader.join(timeout=10)
    assert [first, second] == [plain[0] + "\n", plain[1] + "\n"]
    assert lines.empty()


# ----------------------------------------------------------------------------- shortlist


def _checkpoint_with(run: Path, tmp_path: Path, shortlist: object) -> Path:
    """A copy of the run's checkpoint whose shortlist is ``shortlist`` (None: none)."""
    from nmt import checkpoint

    state = checkpoint.load(run / "best.pt")
    for key in ("format", "version"):
        del state[key]
    state["shortlist"] = shortlist
    path = tmp_path / "best.pt"
    checkpoint.save(path, state)
    return path


def test_a_run_carries_its_shortlist_and_translate_uses_it(run: Path, source: Path) -> None:
    """nmt train saves a shortlist of the training pairs with the run; auto and on decode
    with it, off without it, each line for line."""
    from nmt.decoding.translator import Translator

    translator = Translator.from_checkpoint(run, "cpu")
    assert translator.shortlists is not None
    (shortlist,) = translator.shortlists
    assert shortlist.table.size(0) == translator.tokenizer.src_vocab_size
    assert shortlist.frequent.numel() > 0
    outputs = {}
    for mode in ("auto", "on", "off"):
        result = nmt("translate", "-m", str(run), "-i", str(source), "--shortlist", mode)
        assert result.code == 0, result.err
        assert len(result.out.split("\n")[:-1]) == len(SOURCES)
        outputs[mode] = result.out
    assert outputs["auto"] == outputs["on"]


def test_shortlist_on_without_one(run: Path, source: Path, previous: Path, tmp_path: Path) -> None:
    """A checkpoint without a shortlist (older runs): --shortlist on is one line and exit 2,
    nothing written; auto decodes the whole vocabulary."""
    old = _checkpoint_with(run, tmp_path, None)
    refused = nmt("translate", "-m", str(old), "-i", str(source), "-o", str(previous),
                  "--shortlist", "on")  # fmt: skip
    assert refused.code == 2
    assert refused.err.strip().count("\n") == 0
    assert "--shortlist on: a model's checkpoint has no shortlist" in refused.err
    assert unchanged(previous)
    auto = nmt("translate", "-m", str(old), "-i", str(source))
    whole = nmt("translate", "-m", str(run), "-i", str(source), "--shortlist", "off")
    assert auto.code == 0, auto.err
    assert auto.out == whole.out


def test_a_damaged_shortlist_is_one_line(run: Path, source: Path, tmp_path: Path) -> None:
    import torch

    damaged = _checkpoint_with(
        run,
        tmp_path,
        {"frequent": torch.tensor([10**6]), "table": torch.zeros(3, 2, dtype=torch.int32)},
    )
    result = nmt("translate", "-m", str(damaged), "-i", str(source))
    assert result.code == 2
    assert "best.pt: its shortlist has shapes" in result.err
    assert result.err.strip().count("\n") == 0


def _strip_shortlists(run: Path, into: Path) -> list[Path]:
    """A copy of the run directory whose checkpoints have no shortlist (as runs trained
    before nmt built one): their paths."""
    from nmt import checkpoint

    shutil.copytree(run, into)
    paths = sorted(into.glob("*.pt"))
    for path in paths:
        state = checkpoint.load(path)
        for key in ("format", "version", "shortlist"):
            state.pop(key, None)
        checkpoint.save(path, state)
    return paths


def test_nmt_shortlist_adds_the_runs_shortlist(run: Path, tmp_path: Path) -> None:
    """nmt shortlist RUN gives each checkpoint of a run without one the shortlist nmt train
    builds (the same, from the same data); a second call keeps them as they are."""
    from nmt import checkpoint

    want = checkpoint.load(run / "best.pt")["shortlist"]
    paths = _strip_shortlists(run, tmp_path / "old")
    assert len(paths) >= 2
    result = nmt("shortlist", str(tmp_path / "old"))
    assert result.code == 0, result.err
    for path in paths:
        assert f"{path}: shortlist added" in result.err
        got = checkpoint.load(path)["shortlist"]
        assert all(torch.equal(got[key], want[key]) for key in ("frequent", "table"))
    again = nmt("shortlist", str(paths[0]))
    assert again.code == 0 and f"{paths[0]}: has a shortlist already, kept" in again.err


def test_nmt_shortlist_without_the_training_data(run: Path, tmp_path: Path) -> None:
    """The saved config's training data missing: one line naming it, exit 2, the checkpoint
    as it was."""
    from nmt import checkpoint

    (path,) = [p for p in _strip_shortlists(run, tmp_path / "old") if p.name == "best.pt"]
    state = checkpoint.load(path)
    del state["format"], state["version"]
    state["config"]["data"]["train"] = str(tmp_path / "gone" / "train")
    checkpoint.save(path, state)
    before = path.read_bytes()
    result = nmt("shortlist", str(path))
    assert result.code == 2
    assert result.err.strip().count("\n") == 0 and "gone" in result.err
    assert path.read_bytes() == before


def test_nmt_shortlist_with_an_empty_training_corpus(run: Path, tmp_path: Path) -> None:
    """Training data of no pairs: the line nmt train gives for it, exit 2, the checkpoint as
    it was and no prepared entry left (it used to be a KeyError traceback)."""
    from nmt import checkpoint

    (path,) = [p for p in _strip_shortlists(run, tmp_path / "old") if p.name == "best.pt"]
    state = checkpoint.load(path)
    del state["format"], state["version"]
    state["config"]["data"]["train"] = str(tmp_path / "empty")
    checkpoint.save(path, state)
    for side in ("src", "trg"):
        (tmp_path / f"empty.{side}").write_text("", encoding="utf-8")
    before, prepared = path.read_bytes(), tmp_path / "old" / "cache" / "prepared"
    entries = sorted(prepared.iterdir())
    result = nmt("shortlist", str(path))
    assert result.error == (
        f"error: data.train: {tmp_path / 'empty'}: none of its 0 pairs has text on both sides; "
        f"point data.train at the training corpus"
    )
    assert path.read_bytes() == before
    assert sorted(prepared.iterdir()) == entries
