"""Bad input that used to slip through, each fixed where it got in (the loader, the schema, the
output check), driven through the command line as a user types it: exit status 2, one line
naming the file, key or option, and no file changed."""

from __future__ import annotations

import gzip
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from clirun import nmt, nmt_process, tiny_config, write_config, write_corpus

from nmt import __version__, checkpoint

# ----------------------------------------------------------------------------- checkpoints


class _WritesAFile:
    """A pickled object whose loading would write ``path``: what a crafted checkpoint does."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({str(self.path)!r}, 'w').write('pwned')",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path, run: Path) -> None:
    state = checkpoint.load(run / "last.pt")
    state["extra"] = _WritesAFile(tmp_path / "written-by-the-checkpoint")
    crafted = tmp_path / "crafted.pt"
    torch.save(state, crafted)
    result = nmt("translate", "-m", str(crafted), stdin=b"sol luna\n")
    assert f"{crafted}: refused" in result.error and "(exec)" in result.error
    assert not (tmp_path / "written-by-the-checkpoint").exists()


def test_checkpoints_nmt_wrote_load_without_unpickling_code(run: Path) -> None:
    """Weights only: tensors, the numpy random state, config and tokenizer, nothing else."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(run / "last.pt")
    assert set(unsafe) <= {"numpy.dtype", "numpy.ndarray", "numpy._core.multiarray._reconstruct"}
    assert checkpoint.load(run / "last.pt")["progress"]["step"] > 0


def _newer_checkpoint(run: Path, path: Path) -> str:
    """A checkpoint as a later nmt would write it: 14 config keys this nmt does not know, in
    three sections, and a higher version; returns that version."""
    state = checkpoint.load(run / "last.pt")
    newer = f"{int(__version__.split('.')[0]) + 1}.0.0"
    extra = {"training": "new_option_{}", "model": "fancy_{}", "decoding": "extra_{}"}
    for (section, name), count in zip(extra.items(), (5, 5, 4), strict=True):
        state["config"][section] |= {name.format(i): 1 for i in range(count)}
    state["version"] = newer
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return newer


def test_a_checkpoint_of_a_newer_nmt_says_so_in_one_short_line(tmp_path: Path, run: Path) -> None:
    """It used to be one 4,000-character line, every valid key listed again after each of
    the 14 unknown keys."""
    newer_pt = tmp_path / "newer.pt"
    newer = _newer_checkpoint(run, newer_pt)
    assert checkpoint.load(run / "last.pt")["version"] == __version__  # what nmt writes
    error = nmt("translate", "-m", str(newer_pt), stdin=b"sol luna\n").error
    assert error == (
        f"error: {newer_pt}: written by nmt {newer}, newer than this nmt {__version__} "
        f"(unknown keys: model.fancy_0, model.fancy_1, ... and 12 more); "
        f"upgrade nmt to read it"
    )
    assert len(error) < 300


def test_resuming_from_a_checkpoint_of_a_newer_nmt_says_so(tmp_path: Path, run: Path) -> None:
    shutil.copytree(run, tmp_path / "run")
    newer = _newer_checkpoint(run, tmp_path / "run" / "last.pt")
    config = write_config(tmp_path / "c.yaml", tiny_config(run.parent))
    result = nmt("train", str(config), "--run-dir", str(tmp_path / "run"), "--resume", "-q")
    assert f"written by nmt {newer}, newer than this nmt {__version__}" in result.error
    assert len(result.error) < 300


def test_resuming_from_a_damaged_last_checkpoint_says_what_to_copy(
    tmp_path: Path, run: Path
) -> None:
    """--resume reads last.pt alone: the fix names the run's other checkpoints."""
    shutil.copytree(run, tmp_path / "run")
    last = tmp_path / "run" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    others = sorted(p.name for p in (tmp_path / "run").glob("*.pt") if p != last)
    config = write_config(tmp_path / "c.yaml", tiny_config(run.parent))
    error = nmt("train", str(config), "--run-dir", str(tmp_path / "run"), "--resume", "-q").error
    assert error.startswith(f"error: {last}: cannot read checkpoint")
    assert error.endswith(
        f"--resume reads last.pt: copy another checkpoint of the run over it "
        f"({', '.join(others[-3:])}) to resume from there"
    )
    assert others


def test_resuming_a_run_directory_that_does_not_exist(tmp_path: Path, run: Path) -> None:
    """A mistyped --run-dir with --resume is an error, not a new run from step 0."""
    config = write_config(tmp_path / "c.yaml", tiny_config(run.parent))
    missing = tmp_path / "rnu"
    error = nmt("train", str(config), "--run-dir", str(missing), "--resume", "-q").error
    assert error == (
        f"error: run.dir: {missing} does not exist, so there is no run to resume; check the "
        f"--run-dir (or run.dir), or drop --resume to start a new run"
    )
    assert not missing.exists()


# ----------------------------------------------------------------------------- outputs


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.mark.parametrize("name", ["best.pt", "last.pt", "train.log", "spm.model", "config.yaml"])
def test_translate_never_writes_onto_the_model_or_a_run_file(run: Path, name: str) -> None:
    target = run / name
    before = _bytes(target)
    result = nmt("translate", "-m", str(run), "-o", str(target), stdin=b"sol luna\n")
    assert str(target) in result.error and "--output" in result.error
    assert _bytes(target) == before


def test_translate_never_writes_onto_its_input(tmp_path: Path, run: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("sol luna\n", encoding="utf-8")
    result = nmt("translate", "-m", str(run), "-i", str(source), "-o", str(source))
    assert "is the --input this command reads" in result.error
    assert source.read_text(encoding="utf-8") == "sol luna\n"


@pytest.mark.parametrize("to_stdout", [True, False])
def test_translate_never_writes_alignments_onto_its_input(
    tmp_path: Path, run: Path, to_stdout: bool
) -> None:
    source = tmp_path / "in.txt"
    source.write_text("sol luna\n", encoding="utf-8")
    output = [] if to_stdout else ["-o", str(tmp_path / "out.txt")]
    result = nmt(
        "translate", "-m", str(run), "-i", str(source), *output, "--alignments", str(source)
    )
    assert "--alignments" in result.error and "is the --input this command reads" in result.error
    assert source.read_text(encoding="utf-8") == "sol luna\n"


def test_eval_never_saves_hypotheses_onto_the_model_or_the_reference(run: Path) -> None:
    before = _bytes(run / "last.pt")
    result = nmt("eval", "--model", str(run / "last.pt"), "--save-hypotheses", str(run / "last.pt"))
    assert "--save-hypotheses" in result.error and _bytes(run / "last.pt") == before
    saved = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    reference = Path(saved["data"]["test"] + ".trg")  # the run's own data.test
    before = _bytes(reference)
    result = nmt("eval", "--model", str(run), "--save-hypotheses", str(reference))
    assert "data.test file" in result.error and _bytes(reference) == before


# ----------------------------------------------------------------------------- config values


def _train_error(tmp_path: Path, corpus: Path, section: str, values: dict) -> str:
    config = tiny_config(corpus)
    config[section] = {**config.get(section, {}), **values}
    path = write_config(tmp_path / "c.yaml", config)
    result = nmt("train", str(path), "--run-dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything is written
    return result.error


@pytest.mark.parametrize("seed", [-1, 2**70])
def test_seeds_outside_the_generators_range(tmp_path: Path, corpus: Path, seed: int) -> None:
    assert "training.seed" in _train_error(tmp_path, corpus, "training", {"seed": seed})


def test_sizes_beyond_a_sensible_bound(tmp_path: Path, corpus: Path) -> None:
    error = _train_error(tmp_path, corpus, "model", {"encoder": {"hidden_size": 10_000_000}})
    assert "model.encoder.hidden_size" in error and "65536" in error


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("training", {"epochs": True}, "training.epochs"),
        ("training", {"epochs": "3"}, "training.epochs"),
        ("decoding", {"max_len_ratio": math.inf}, "decoding.max_len_ratio"),
        ("training", {"learning_rate": math.nan}, "training.learning_rate"),
        ("training", {"clip_grad_norm": math.inf}, "training.clip_grad_norm"),
    ],
)
def test_strict_types_and_finite_numbers(
    tmp_path: Path, corpus: Path, section: str, values: dict, key: str
) -> None:
    assert key in _train_error(tmp_path, corpus, section, values)


def test_yaml_12_numbers_are_numbers(tmp_path: Path) -> None:
    from nmt.config import load

    path = tmp_path / "c.yaml"
    path.write_text("training:\n  learning_rate: 1e-3\n  weight_decay: 2E-2\n", encoding="utf-8")
    config = load(path)
    assert config.training.learning_rate == 0.001 and config.training.weight_decay == 0.02


def test_a_key_twice_in_one_mapping(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  epochs: 3\nrun:\n  dir: x\ntraining:\n  epochs: 5\n")
    assert f"{path}:5:" in nmt("train", str(path)).error
    assert "'training' appears twice" in nmt("train", str(path)).error


def test_an_empty_config(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    for text in ("", "# nothing but a comment\n", "{}\n"):
        path.write_text(text, encoding="utf-8")
        error = nmt("train", str(path), "--run-dir", str(tmp_path / "run")).error
        assert "the config is empty" in error and "data.train" in error
    assert not (tmp_path / "run").exists()


def test_an_override_with_an_empty_key_part(tmp_path: Path, corpus: Path) -> None:
    path = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    error = nmt("train", str(path), "--override", ".epochs=3").error
    assert "'.epochs' has an empty part" in error


def test_a_vocabulary_too_small_for_the_characters(tmp_path: Path, corpus: Path) -> None:
    config = tiny_config(corpus)
    config["tokenizer"] = {"vocab_size": 16, "type": "bpe"}
    path = write_config(tmp_path / "c.yaml", config)
    error = nmt("train", str(path), "--run-dir", str(tmp_path / "run")).error
    assert "tokenizer.vocab_size: 16 is too small" in error
    assert "character_coverage" in error and "--character_coverage" not in error


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("command", ["translate", "eval"])
def test_an_unknown_device(run: Path, command: str) -> None:
    result = nmt(command, "--model", str(run), "--device", "foo")
    assert "--device" in result.error and "'foo'" in result.error


def test_usage_errors_are_one_plain_line() -> None:
    result = nmt_process("translate", "-m", "x", "--beam", "0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--beam" in lines[0]
    assert "╭" not in result.stderr


# ----------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("checkpoint_exists", [False, True])
def test_ctrl_c_says_whether_there_is_anything_to_resume(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_exists: bool
) -> None:
    """Ctrl-C during data preparation (no checkpoint yet) or after one: the last line says
    what there is (the end-to-end run with a checkpoint: test_errors' Ctrl-C test)."""
    import nmt.training as training_package

    run_dir = tmp_path / "run"

    def interrupted(*args: object, **kwargs: object) -> None:
        run_dir.mkdir()
        if checkpoint_exists:
            (run_dir / "last.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(training_package, "train", interrupted)
    path = write_config(tmp_path / "c.yaml", tiny_config(corpus))
    result = nmt("train", str(path), "--run-dir", str(run_dir))
    assert result.code == 130
    expected = (
        f"interrupted: {run_dir / 'last.pt'} is saved; continue with --resume"
        if checkpoint_exists
        else "interrupted before the first checkpoint: nothing to resume; run the command again"
    )
    assert result.err.strip().splitlines()[-1] == expected


def test_config_files_keep_their_yaml(tmp_path: Path) -> None:
    """yaml.safe_dump's output (what the tests and users write) reads back the same."""
    from nmt.config import parse_yaml

    values = {"a": 1e-3, "b": [1, 2.5, "x"], "c": {"d": None, "e": True}}
    assert parse_yaml(yaml.safe_dump(values)) == values


# ----------------------------------------------------------------------------- unreadable inputs


def _gzip(text: bytes) -> bytes:
    return gzip.compress(text, mtime=0)


def _plain_named_gz(path: Path) -> Path:
    """The file as it is, renamed to end in .gz: plain text that claims to be gzip."""
    return path.rename(path.with_name(path.name + ".gz"))


def _truncated_gzip(path: Path) -> Path:
    data = _gzip(path.read_bytes())
    path.unlink()
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(data[: len(data) // 2])
    return gz


def _damaged_gzip(path: Path) -> Path:
    data = bytearray(_gzip(path.read_bytes()))
    data[-8] ^= 0xFF  # the CRC-32 of the trailer
    path.unlink()
    gz = path.with_name(path.name + ".gz")
    gz.write_bytes(bytes(data))
    return gz


def _invalid_utf8(path: Path) -> Path:
    lines = path.read_bytes().split(b"\n")
    lines[4] += b" d\xedas"  # latin-1 on line 5
    path.write_bytes(b"\n".join(lines))
    return path


BREAKS = {
    "plain text named .gz": (_plain_named_gz, "not gzip-compressed, though its name ends in .gz"),
    "truncated gzip": (_truncated_gzip, "cut short: its gzip data ends before"),
    "damaged gzip": (_damaged_gzip, "damaged gzip data (CRC check failed"),
    "invalid UTF-8": (_invalid_utf8, ":5: not valid UTF-8 (byte"),
}


@pytest.mark.parametrize("split", ["train", "dev"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_an_unreadable_corpus_file_is_named_and_never_passes_for_a_failed_write(
    tmp_path: Path, split: str, name: str
) -> None:
    """The corpus is parsed into the run's cache while it is read: an error reading it names
    the user's file and what is wrong with it, not the cache file as 'cannot write'."""
    root = write_corpus(tmp_path)
    breaks, expected = BREAKS[name]
    broken = breaks(root / f"{split}.trg")
    result = nmt("train", str(write_config(root / "c.yaml", tiny_config(root))), "--quiet")
    assert result.error.startswith(f"error: {broken}"), result.error
    assert expected in result.error
    assert "cannot write" not in result.error and "cache" not in result.error


def test_a_tsv_corpus_cut_short_is_named(tmp_path: Path) -> None:
    root = write_corpus(tmp_path)
    for split in ("train", "dev", "test"):
        src, trg = ((root / f"{split}.{side}").read_text().splitlines() for side in ("src", "trg"))
        tsv = root / f"{split}.tsv"
        tsv.write_text("".join(f"{s}\t{t}\n" for s, t in zip(src, trg, strict=True)))
    broken = _truncated_gzip(root / "train.tsv")
    config = tiny_config(root, train=broken.name, format="tsv")
    config["data"] |= {"dev": str(root / "dev.tsv"), "test": str(root / "test.tsv")}
    result = nmt("train", str(write_config(root / "c.yaml", config)), "--quiet")
    assert result.error.startswith(f"error: {broken}: cut short"), result.error


def _commands_reading(path: Path, run: Path, tmp_path: Path) -> list[tuple[str, ...]]:
    """Commands that read ``path``: as translate's input, eval's reference and hypotheses,
    score's and align's source."""
    other = tmp_path / "other.txt"
    other.write_text("sol luna\n" * 20, encoding="utf-8")
    model = ("-m", str(run))
    return [
        ("translate", *model, "-i", str(path), "-o", str(tmp_path / "out.txt")),
        ("eval", str(other), "-r", str(path)),
        ("eval", str(path), "-r", str(other)),
        ("score", *model, "-i", str(path), "-t", str(other)),
        ("align", *model, "-i", str(path), "-t", str(other)),
    ]


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_command_names_an_unreadable_input(run: Path, tmp_path: Path, name: str) -> None:
    text = tmp_path / "in.txt"
    text.write_text("sol luna\n" * 20, encoding="utf-8")
    breaks, expected = BREAKS[name]
    broken = breaks(text)
    for args in _commands_reading(broken, run, tmp_path):
        error = nmt(*args).error
        assert error.startswith(f"error: {broken}") and expected in error, (args, error)
        assert not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"\xfd7zXZ\x00\x00\x04", "xz-compressed; nmt reads UTF-8 text, plain or gzip"),
        (b"BZh91AY&SY\x8a", "bzip2-compressed; nmt reads UTF-8 text"),
        (_gzip(b"sol luna\n"), "gzip-compressed, but its name does not end in .gz"),
    ],
)
def test_a_compressed_input_nmt_cannot_read_says_to_decompress_it(
    tmp_path: Path, run: Path, header: bytes, expected: str
) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(header + b"sol\nluna\n")
    error = nmt("translate", "-m", str(run), "-i", str(path)).error
    assert error.startswith(f"error: {path}: {expected.split(';')[0]}") and expected in error


def test_invalid_utf8_typed_line_by_line_names_the_line(run: Path) -> None:
    """Streamed stdin (a terminal, --unbuffered) was decoded leniently and crashed the
    tokenizer; it is the same one line as a file's."""
    result = nmt("translate", "-m", str(run), "--unbuffered", stdin=b"sol\nd\xedas\n")
    assert result.error.startswith("error: <stdin>:2: not valid UTF-8 (byte 2 of the line)")
    assert len(result.out.splitlines()) == 1  # the first line was answered
