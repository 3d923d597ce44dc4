"""Training on a real filesystem that fills up: a small tmpfs, mounted in a user and mount
namespace of its own (``unshare``), so that no test mounts anything on the machine.

The run stops at a checkpoint with one line and exit status 2; the checkpoints written before
stay byte for byte and no temporary file is left; once space is freed, ``--resume`` finishes
the run exactly as an uninterrupted run does (the same weights and one history)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from runs import read_metrics
from synthetic import data_section, luong_model_section, write_corpus

from nmt import checkpoint
from nmt.config import from_dict
from nmt.training import train


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None or not Path("/proc/self/fd").is_dir():
        return False
    try:
        done = subprocess.run(
            [
                "unshare",
                "--user",
                "--map-root-user",
                "--mount",
                "sh",
                "-c",
                "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d && rmdir $d",
            ],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_work(), reason="needs unshare with user and mount namespaces (Linux)"
)

MOUNT_SIZE = 32 * 2**20


def config(corpus: Path, run_dir: Path) -> dict:
    """A tiny model whose checkpoint (about 0.1 MiB) is a sizeable share of the disk left."""
    return {
        "data": data_section(corpus),
        "tokenizer": {"vocab_size": 40, "type": "bpe"},
        "model": luong_model_section(input_feeding=False),
        "training": {
            "epochs": 1,  # 33 steps
            "batch_tokens": 200,
            "validate_every": 10,
            "log_every": 5,
            "keep_last": 1,
            "best_metric": "loss",  # dev loss falls at every validation: best.pt each time
        },
        "decoding": {"max_len_offset": 3, "max_len_ratio": 1.0},
        "run": {"dir": str(run_dir), "device": "cpu", "tensorboard": False},
    }


def used_bytes(directory: Path) -> int:
    """Bytes a directory takes on a tmpfs: each file rounded up to whole 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in directory.rglob("*") if p.is_file())


SCRIPT = """
set -u
mount -t tmpfs -o size={size} tmpfs {disk}
head -c {filler} /dev/zero > {disk}/filler
{python} -m nmt train {config} --quiet 2> {out}/first.err; echo $? > {out}/first.rc
cp -a {disk}/run {out}/stopped
rm {disk}/filler
{python} -m nmt train {config} --quiet --resume 2> {out}/second.err; echo $? > {out}/second.rc
cp -a {disk}/run {out}/resumed
"""


def test_a_full_disk_stops_training_and_resume_finishes_it_exactly(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus, {"train": 300, "dev": 8})
    reference = tmp_path / "reference"  # uninterrupted, in this process (one thread too)
    train(from_dict(config(corpus, reference)), quiet=True)

    # room for everything but the checkpoints, two checkpoints (best.pt and last.pt at the
    # first validation) and half of a third: the second validation's best.pt cannot be written
    point = (reference / "last.pt").stat().st_size
    others = used_bytes(reference) - 2 * -(-point // 4096) * 4096
    room = others + 2 * point + point // 2
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    on_disk = tmp_path / "on_disk.yaml"
    on_disk.write_text(yaml.safe_dump(config(corpus, disk / "run")), encoding="utf-8")
    script = SCRIPT.format(
        size=MOUNT_SIZE,
        disk=disk,
        filler=MOUNT_SIZE - room,
        python=sys.executable,
        config=on_disk,
        out=out,
    )
    subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        check=True,
        timeout=600,
    )

    first = (out / "first.err").read_text(encoding="utf-8").strip().splitlines()
    assert (out / "first.rc").read_text().strip() == "2", first
    assert len(first) == 1 and first[0].startswith("error: "), first
    line = first[0]
    assert "cannot write it (No space left on device)" in line, line
    assert "free there, and a checkpoint takes about " in line, line
    assert line.endswith(
        "training stopped at step 20: free some space, then nmt train --resume continues "
        "from step 10 (last.pt)"
    )
    stopped = out / "stopped"
    assert not list(stopped.glob(".*.tmp")), sorted(p.name for p in stopped.iterdir())
    at_10 = checkpoint.load(stopped / "last.pt")
    assert at_10["progress"]["step"] == 10  # the last good checkpoint, whole and loadable
    assert checkpoint.load(stopped / "best.pt")["progress"]["step"] == 10

    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()
    resumed = out / "resumed"
    for name in ("last.pt", "best.pt"):
        mine, theirs = checkpoint.load(resumed / name), checkpoint.load(reference / name)
        assert mine["progress"]["step"] == theirs["progress"]["step"]
        for key, value in theirs["model"].items():
            assert torch.equal(mine["model"][key], value), (name, key)
    drop = ("time", "target_tokens_per_s")
    history = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(resumed)]
    expected = [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(reference)]
    assert history == expected
    info = json.loads((resumed / "environment.json").read_text(encoding="utf-8"))
    assert info["precision"] == "fp32"
