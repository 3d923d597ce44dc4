"""A writer killed at any moment (SIGKILL: no cleanup runs) never leaves a damaged file under
the final name: checkpoints and text outputs are the previous version or the new one, whole."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nmt import checkpoint, files
from nmt.training.rundir import RunLock

ROUNDS = 5

CHECKPOINT_WRITER = """
import sys
import torch
from pathlib import Path
from nmt import checkpoint

path, first = Path(sys.argv[1]), int(sys.argv[2])
for i in range(first, first + 10_000):
    weights = torch.full((1 << 20,), float(i))  # 4 MB of float32, every value i
    state = {"model": {"w": weights}, "config": {}, "tokenizer": {}, "i": i}
    print(f"start {i}", flush=True)
    checkpoint.save(path, state)
    print(f"done {i}", flush=True)
"""

TEXT_WRITER = """
import sys
import time
from pathlib import Path
from nmt import files

path, first = Path(sys.argv[1]), int(sys.argv[2])
for i in range(first, first + 10_000):
    line = f"{i}\\n" * 50_000

    def write(handle, line=line):  # slowly, so that most kills land inside a write
        for _ in range(40):
            handle.write(line.encode())
            time.sleep(0.002)

    print(f"start {i}", flush=True)
    files.atomic_write_bytes(path, write)
    print(f"done {i}", flush=True)
"""


def _kill_midway(script: Path, target: Path, first: int, rng: random.Random) -> int:
    """Run a writer, kill it soon after it starts a write; returns the last finished write."""
    process = subprocess.Popen(
        [sys.executable, str(script), str(target), str(first)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    done, starts = first - 1, 0
    wanted = rng.randint(2, 4)  # let at least one write finish, then kill inside a later one
    for line in process.stdout:
        kind, number = line.split()
        if kind == "done":
            done = int(number)
        elif (starts := starts + 1) == wanted:
            time.sleep(rng.uniform(0.0, 0.05))
            break
    process.send_signal(signal.SIGKILL)
    for line in process.stdout:  # what it wrote before it died
        kind, number = line.split()
        if kind == "done":
            done = int(number)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    return done


def _write_script(tmp_path: Path, name: str, source: str) -> Path:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    return script


def _temporaries(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_killed_checkpoint_writes_leave_a_loadable_checkpoint(tmp_path: Path) -> None:
    script = _write_script(tmp_path, "writer.py", CHECKPOINT_WRITER)
    run_dir = tmp_path / "run"
    target = run_dir / "last.pt"
    rng = random.Random(7)
    first = 0
    for _ in range(ROUNDS):
        done = _kill_midway(script, target, first, rng)
        assert checkpoint.resolve(run_dir) == target  # a temporary is never taken for it
        state = checkpoint.load(run_dir)
        i = state["i"]
        assert i in (done, done + 1)  # the last finished write, or the one killed after its rename
        weights = state["model"]["w"]
        assert weights.shape == (1 << 20,) and bool((weights == float(i)).all())
        for leftover in _temporaries(run_dir):
            assert leftover.name.startswith(".last.pt.")
            assert not leftover.name.endswith(".pt")
        first = i + 1
    # the next training run, holding the lock, clears what killed writers left
    with RunLock(run_dir):
        assert _temporaries(run_dir) == []
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "last.pt"]


def test_killed_text_writes_leave_the_old_or_the_new_file(tmp_path: Path) -> None:
    script = _write_script(tmp_path, "writer.py", TEXT_WRITER)
    target = tmp_path / "out" / "hypotheses.txt"
    rng = random.Random(11)
    first, killed_inside = 0, 0
    for _ in range(ROUNDS):
        done = _kill_midway(script, target, first, rng)
        lines = target.read_text(encoding="utf-8").split("\n")
        assert lines[-1] == "" and len(lines) == 40 * 50_000 + 1  # complete
        (i,) = set(lines[:-1])
        assert int(i) in (done, done + 1)
        killed_inside += bool(_temporaries(target.parent))
        first = int(i) + 1
    assert killed_inside > 0  # the kills did land inside writes


def test_atomic_write_text_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    """An exception inside a write leaves the old file and no temporary."""
    target = tmp_path / "report.json"
    files.atomic_write_text(target, "old\n")

    def failing(handle) -> None:  # type: ignore[no-untyped-def]
        handle.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        files.atomic_write_bytes(target, failing)
    assert target.read_text(encoding="utf-8") == "old\n"
    assert _temporaries(tmp_path) == []
    files.atomic_write_text(target, "new\n")
    assert target.read_text(encoding="utf-8") == "new\n"
    assert os.stat(target).st_mode & 0o777 != 0o600  # the umask's permissions, not mkstemp's


def test_checkpoint_save_is_loadable_and_self_describing(tmp_path: Path) -> None:
    path = tmp_path / "best.pt"
    checkpoint.save(path, {"model": {"w": torch.ones(3)}, "config": {}, "tokenizer": {}})
    state = checkpoint.load(path)
    assert state["format"] == checkpoint.FORMAT and state["version"]
