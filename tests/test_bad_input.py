"""Bad input that used to slip through, each fixed where it got in (the loader, the schema, the
output check), driven through the command line as a user types it: exit status 2, one line
naming the file, key or option, and no file changed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from clirun import nmt, nmt_process, tiny_config, write_config

from nmt import checkpoint

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
