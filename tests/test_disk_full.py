"""A full disk (or any other OS error) at every place nmt writes a file: one line naming the
file and the error, exit status 2, the previous file byte for byte, no temporary file left.

The disk fills at the OS call: ``os.fsync`` of the file being written fails with ENOSPC, as
it does on a filesystem that allocates late (and where the write itself already failed, the
same path runs). A real full filesystem, and an exact resume once space is free, are in
tests/training/test_disk_full_training.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from clirun import nmt, tiny_config, unchanged, write_config

from nmt import files

ENOSPC = "No space left on device"


def fill_disk_for(monkeypatch: pytest.MonkeyPatch, name: Callable[[str], bool]) -> list[str]:
    """Make fsync fail with ENOSPC for files whose final name (``.NAME.XXXX.tmp`` -> NAME)
    satisfies ``name``; returns the names it failed."""
    real = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        base = Path(target).name
        final = base[1:].rsplit(".", 2)[0] if base.startswith(".") else base
        if base.endswith(".tmp") and name(final):
            failed.append(final)
            raise OSError(errno.ENOSPC, ENOSPC)
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    return failed


def no_temporaries(directory: Path) -> bool:
    return not list(directory.glob(".*.tmp"))


def assert_one_line(result, path: Path) -> None:  # type: ignore[no-untyped-def]
    line = result.error
    assert f"{path}: cannot write it ({ENOSPC})" in line, line
    assert "free there: free some space and run it again" in line, line


pytestmark = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)"
)


def test_translate_output(run: Path, previous: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = fill_disk_for(monkeypatch, lambda n: n == previous.name)
    result = nmt("translate", "-m", str(run), "-o", str(previous), stdin=b"sol luna\nmar\n")
    assert_one_line(result, previous)
    assert failed and unchanged(previous) and no_temporaries(previous.parent)


def test_translate_alignments(run: Path, previous: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill_disk_for(monkeypatch, lambda n: n == previous.name)
    out = previous.with_name("hyp.txt")
    result = nmt(
        "translate", "-m", str(run), "-o", str(out), "--alignments", str(previous), stdin=b"sol\n"
    )
    assert_one_line(result, previous)
    assert unchanged(previous) and no_temporaries(previous.parent)


@pytest.mark.parametrize("command", ["score", "align"])
def test_score_and_align_output(
    run: Path, corpus: Path, previous: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    fill_disk_for(monkeypatch, lambda n: n == previous.name)
    args = ["-i", str(corpus / "test.src"), "-t", str(corpus / "test.trg"), "-o", str(previous)]
    result = nmt(command, "-m", str(run), *args)
    assert_one_line(result, previous)
    assert unchanged(previous) and no_temporaries(previous.parent)


def test_eval_save_hypotheses(run: Path, previous: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill_disk_for(monkeypatch, lambda n: n == previous.name)
    result = nmt("eval", "--model", str(run), "--split", "test", "--save-hypotheses", str(previous))
    assert_one_line(result, previous)
    assert unchanged(previous) and no_temporaries(previous.parent)


def test_average_output(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "averaged.pt"
    out.write_bytes(b"an earlier average")
    fill_disk_for(monkeypatch, lambda n: n == out.name)
    result = nmt("average", str(run / "last.pt"), str(run / "last.pt"), "-o", str(out))
    assert_one_line(result, out)
    assert out.read_bytes() == b"an earlier average" and no_temporaries(tmp_path)


def test_attention_pictures(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pictures = tmp_path / "attention"
    fill_disk_for(monkeypatch, lambda n: n.endswith(".png"))
    result = nmt("translate", "-m", str(run), "--attention-dir", str(pictures), stdin=b"sol\n")
    assert "cannot write it (No space left on device)" in result.error
    assert ".png" in result.error and no_temporaries(pictures)


def test_another_os_error_names_the_file_without_the_space_advice(
    run: Path, previous: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files.os, "fsync", fsync)
    result = nmt("translate", "-m", str(run), "-o", str(previous), stdin=b"sol\n")
    assert result.error == f"error: {previous}: cannot write it (Input/output error)"
    assert unchanged(previous) and no_temporaries(previous.parent)


# ----------------------------------------------------------------------------- training


def train_config(corpus: Path, root: Path, tensorboard: bool = False, **training: object) -> Path:
    config = tiny_config(corpus)
    config["run"] |= {"dir": str(root / "run"), "tensorboard": tensorboard}
    config["training"] |= {"max_steps": 12, "validate_every": 4, "log_every": 2, **training}
    return write_config(root / "config.yaml", config)


@pytest.mark.parametrize("name", ["spm.model", "config.yaml", "environment.json"])
def test_training_files_written_at_the_start(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    config = train_config(corpus, tmp_path)
    fill_disk_for(monkeypatch, lambda n: n == name)
    result = nmt("train", str(config), "--quiet")
    assert f"{tmp_path / 'run' / name}: cannot write it ({ENOSPC})" in result.error
    assert no_temporaries(tmp_path / "run") and not (tmp_path / "run" / "last.pt").exists()


def test_a_checkpoint_on_a_full_disk_stops_training_with_the_step_to_resume_from(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second validation's checkpoint meets a full disk: last.pt and best.pt stay those of
    step 4, byte for byte, and the line says how much a checkpoint takes and where to resume."""
    config = train_config(corpus, tmp_path, keep_last=1)
    run_dir = tmp_path / "run"
    seen: dict[str, bytes] = {}
    real = os.fsync

    def fsync(fd: int) -> None:
        base = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        if base.startswith((".last.pt.", ".best.pt.")):
            if "last" in seen:  # the second checkpoint: the disk is full
                seen["failed"] = base.split(".")[1].encode()
                seen["best_before"] = (run_dir / "best.pt").read_bytes()
                seen["last_before"] = (run_dir / "last.pt").read_bytes()
                raise OSError(errno.ENOSPC, ENOSPC)
            if base.startswith(".last.pt."):
                seen["last"] = b"written"
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    result = nmt("train", str(config), "--quiet")
    line = result.error
    assert line.startswith(
        f"error: {run_dir / (seen['failed'].decode() + '.pt')}: cannot write it ({ENOSPC}); "
    )
    assert "free there, and a checkpoint takes about " in line and "iB;" in line
    assert line.endswith(
        "training stopped at step 8: free some space, then nmt train --resume continues from "
        "step 4 (last.pt)"
    )
    assert (run_dir / "last.pt").read_bytes() == seen["last_before"]
    assert (run_dir / "best.pt").read_bytes() == seen["best_before"]
    assert no_temporaries(run_dir)


@pytest.mark.parametrize("where", ["metrics.jsonl", "tensorboard"])
def test_metrics_on_a_full_disk_stop_training_in_one_line(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """metrics.jsonl is appended to, tensorboard writes from its own thread: the disk fills
    under them after the first checkpoint (step 4)."""
    import torch.utils.tensorboard as tensorboard

    config = train_config(corpus, tmp_path, tensorboard=True)
    run_dir = tmp_path / "run"
    full = lambda: (run_dir / "last.pt").exists()  # noqa: E731

    if where == "metrics.jsonl":
        real_open = Path.open

        def open_(self: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.name == "metrics.jsonl" and full():
                raise OSError(errno.ENOSPC, ENOSPC, str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(Path, "open", open_)
    else:
        real_add = tensorboard.SummaryWriter.add_scalar

        def add_scalar(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if full():  # what its writer thread raises on the next call
                raise OSError(errno.ENOSPC, ENOSPC)
            return real_add(self, *args, **kwargs)

        monkeypatch.setattr(tensorboard.SummaryWriter, "add_scalar", add_scalar)
    result = nmt("train", str(config), "--quiet")
    line = result.error
    assert f"{run_dir / where}: cannot write it ({ENOSPC})" in line, line
    assert "then nmt train --resume continues from step 4 (last.pt)" in line


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_s_writer_thread_failing_is_one_error_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """tensorboard writes from a thread of its own: its failure surfaces at the next call in
    the training thread as the one WriteError, and the thread prints no traceback."""
    import time

    from tensorboard.summary.writer import record_writer

    from nmt.errors import WriteError
    from nmt.training.tracking import Tracker

    tracker = Tracker(tmp_path / "run")

    def write(self, data: bytes) -> None:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    with pytest.raises(WriteError) as raised:
        for step in range(1, 200):
            tracker.scalars(step, {"loss": 1.0}, "train")
            time.sleep(0.01)  # the thread takes the event and fails
    assert str(raised.value).startswith(f"{tmp_path / 'run' / 'tensorboard'}: cannot write it")
    tracker.close(failed=True)
    # Python prints an uncaught thread exception's traceback (pytest turns it into a warning,
    # an error here)
    assert "Traceback" not in capfd.readouterr().err


def test_an_error_reading_the_input_inside_a_write_passes_unchanged(tmp_path: Path) -> None:
    """A cache written while its input is read: the input's error (raised ``from None`` over
    the OSError of the gzip reader) is not the cache's failed write."""
    from nmt.errors import DataError

    target = tmp_path / "cache.arrow"
    target.write_bytes(b"before")

    def write(handle: object) -> None:
        try:
            raise OSError("Not a gzipped file (b'CA')")
        except OSError:
            raise DataError("train.es.gz: not gzip-compressed") from None

    with pytest.raises(DataError, match=r"^train\.es\.gz: not gzip-compressed$"):
        files.atomic_write_bytes(target, write)
    assert target.read_bytes() == b"before" and no_temporaries(tmp_path)
