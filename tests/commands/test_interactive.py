"""`nmt translate` typed at a terminal answers each line as it is entered (stdin a pseudo
terminal, output read before the next line is typed)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from queue import Empty, Queue

import pytest
from clirun import nmt

pty = pytest.importorskip("pty")


def _reader(stream, lines: Queue) -> None:  # type: ignore[no-untyped-def]
    for line in iter(stream.readline, ""):
        lines.put(line)


def test_a_terminal_gets_each_line_as_it_is_typed(run: Path) -> None:
    """Two lines typed one after the other: each translation arrives while stdin is still
    open, and equals the batch translation of that line."""
    expected = nmt("translate", "-m", str(run), stdin=b"sol luna\nagua\n").out.splitlines()
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "translate", "-m", str(run)],
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(secondary)
    lines: Queue = Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    try:
        answers = []
        for typed in ("sol luna", "agua"):
            os.write(primary, typed.encode() + b"\n")
            try:
                answers.append(lines.get(timeout=120).rstrip("\n"))
            except Empty:
                pytest.fail(f"no answer to {typed!r} while the terminal stays open")
        assert process.poll() is None  # still reading: nothing waited for the end of input
        os.write(primary, b"\x04")  # Ctrl-D: end of input
        assert process.wait(timeout=120) == 0, process.stderr.read() if process.stderr else ""
    finally:
        if process.poll() is None:
            process.kill()
        os.close(primary)
    assert answers == expected
