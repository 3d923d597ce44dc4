"""nmt.files: what an output path is written as. A regular file (or a new one) is replaced
atomically; a symlink's target is replaced and the link kept; a device, a FIFO or an open file
(/dev/stdout, /dev/fd/N) is written straight through, never replaced by a regular file. Text
outputs named .gz are gzip-compressed, the same bytes for the same lines. Standard input is
read by one input at most; a closed standard output is one line, not a traceback."""

from __future__ import annotations

import gzip
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from clirun import nmt

from nmt.errors import DataError, WriteError
from nmt.files import atomic_write_text, check_output, read_lines, replaced_file, write_lines


def test_a_symlink_is_followed_and_kept(tmp_path: Path) -> None:
    target = tmp_path / "target.txt"
    target.write_text("old\n", encoding="utf-8")
    link = tmp_path / "link.txt"
    link.symlink_to("target.txt")
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == "target.txt"
    assert target.read_text(encoding="utf-8") == "new\n"
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to("created.txt")
    atomic_write_text(dangling, "made\n")
    assert dangling.is_symlink()
    assert (tmp_path / "created.txt").read_text(encoding="utf-8") == "made\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "created.txt", "dangling.txt", "link.txt", "target.txt",
    ]  # fmt: skip


def test_a_fifo_is_written_through(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    check_output(fifo, "--output")
    atomic_write_text(fifo, "through the pipe\n")
    reader.join(timeout=30)
    assert received == [b"through the pipe\n"]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"]


def test_an_open_file_descriptor_is_written_through() -> None:
    """/dev/fd/N (bash's >(...)) leads through /proc to a pipe, not to a name to replace."""
    read, write = os.pipe()
    try:
        atomic_write_text(Path(f"/dev/fd/{write}"), "to the pipe\n")
        os.close(write)
        write = -1
        with os.fdopen(read, "rb") as handle:
            read = -1
            assert handle.read() == b"to the pipe\n"
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)


def test_devices_and_open_files_are_never_replaced() -> None:
    """By their path only: no test writes to the system's device nodes."""
    for path in ("/dev/null", "/dev/stdout", "/dev/fd/1"):
        assert replaced_file(Path(path)) is None, path
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device needs root")
def test_a_character_device_stays_one(tmp_path: Path) -> None:
    device = tmp_path / "null"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    check_output(device, "--output")
    atomic_write_text(device, "gone\n")
    assert stat.S_ISCHR(device.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["null"]


def test_text_named_gz_is_compressed_reproducibly(tmp_path: Path) -> None:
    lines = ["uno", "", "dos tres"]
    first, second = tmp_path / "a.txt.gz", tmp_path / "b.gz"
    write_lines(str(first), lines)
    write_lines(second, lines)
    assert first.read_bytes() == second.read_bytes()  # no timestamp, no name inside
    assert gzip.decompress(first.read_bytes()) == b"uno\n\ndos tres\n"
    assert read_lines(first) == lines
    write_lines(str(tmp_path / "plain.txt"), lines)
    assert (tmp_path / "plain.txt").read_bytes() == b"uno\n\ndos tres\n"


def test_every_text_output_named_gz_is_compressed(run: Path, corpus: Path, tmp_path: Path) -> None:
    source = str(corpus / "test.src")
    plain = nmt("translate", "-m", str(run), "-i", source, "--alignments", str(tmp_path / "al"))
    assert plain.code == 0, plain.err
    output, links, hypotheses = (tmp_path / name for name in ("out.gz", "al.gz", "hyp.gz"))
    args = ["-i", source, "-o", str(output), "--alignments", str(links)]
    assert nmt("translate", "-m", str(run), *args).code == 0
    assert gzip.decompress(output.read_bytes()).decode() == plain.out
    assert gzip.decompress(links.read_bytes()) == (tmp_path / "al").read_bytes()
    evaluated = nmt("eval", "--model", str(run), "--save-hypotheses", str(hypotheses))
    assert evaluated.code == 0, evaluated.err
    assert gzip.decompress(hypotheses.read_bytes()).decode() == plain.out
    scores = tmp_path / "scores.gz"
    pairs = ["-i", source, "-t", str(output), "-o", str(scores)]
    assert nmt("score", "-m", str(run), *pairs).code == 0  # reads the .gz it wrote
    assert len(read_lines(scores)) == len(read_lines(source))


# Two of a command's inputs on standard input at once (after -m RUN for the decoding
# commands; {tmp}: the test's folder) and the options the error names.
TWO_STDIN = [
    ("translate", ["-i", "-", "--prefix", "-"], "--input, --prefix"),
    ("translate", ["--constraints", "-"], "--input, --constraints"),
    ("score", ["-i", "-", "--n-best", "-"], "-i, --n-best"),
    ("score", ["-i", "-", "-t", "-"], "-i, -t"),
    ("score", ["--align-ref", "-", "--attention-dir", "{tmp}/maps"], "--tsv, --align-ref"),
    ("align", ["-i", "-", "-t", "-"], "-i, -t"),
    ("align", ["--tsv", "-", "-t", "-"], "-t, --tsv"),
    ("eval", ["-", "--ref", "-"], "HYPOTHESES, --ref"),
    ("eval", ["--align", "-", "--align-ref", "-"], "--align, --align-ref"),
]


@pytest.mark.parametrize(("command", "args", "readers"), TWO_STDIN)
def test_standard_input_is_read_by_one_input_at_most(
    run: Path, tmp_path: Path, command: str, args: list[str], readers: str
) -> None:
    model = [] if command == "eval" else ["-m", str(run)]
    given = [arg.format(tmp=tmp_path) for arg in args]
    result = nmt(command, *model, *given, stdin=b"sol\tSOL\n")
    assert result.error == (
        f"error: only one input can be standard input (-): {readers} read it; give files for "
        f"all but one"
    )


def _closed_error(redirect: str, *args: str) -> str:
    """The stderr of `nmt ARGS` started with a standard stream closed (``>&-``, ``<&-``),
    which must be one line and exit status 2."""
    command = [sys.executable, "-m", "nmt", *args]
    result = subprocess.run(
        ["sh", "-c", f'"$@" {redirect}', "sh", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr


def test_a_closed_standard_output_is_one_line(
    run: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started with >&-, Python's sys.stdout is None: each command that writes there says so
    (before any work), exit status 2."""
    source = str(corpus / "test.src")
    for args in (["translate", "-m", str(run), "-i", source], ["eval", source, "--ref", source]):
        error = _closed_error(">&-", *args)
        assert error.startswith("error: standard output is closed (>&-): nowhere to write")
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(WriteError, match="standard output is closed"):
        write_lines("-", ["a line"])


def test_a_closed_standard_input_is_one_line(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started with <&-, Python's sys.stdin is None: translate reading it (batch or line by
    line) and read_lines("-") say so, exit status 2."""
    for extra in ([], ["--unbuffered"]):
        error = _closed_error("<&-", "translate", "-m", str(run), *extra)
        assert error.startswith("error: standard input is closed (<&-): nothing to read")
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(DataError, match="standard input is closed"):
        read_lines("-")
