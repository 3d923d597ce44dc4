"""A model that passes the config's bounds but not the machine's memory: one line naming the
sizes to lower, exit 2, not an allocator's traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from clirun import nmt, tiny_config, write_config

import nmt.training.run as run_module

GIB = 1024**3


def _memory_bytes() -> int:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    swap = 0
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("SwapTotal:"):
                swap = int(line.split()[1]) * 1024
    return pages + swap


def _refuses_huge_allocations() -> bool:
    """Linux refuses at once an allocation larger than RAM and swap unless overcommit is
    'always' (mode 1); then a huge model would instead be killed when touched."""
    try:
        mode = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
    except OSError:
        return False
    return mode in ("0", "2")


def _config(tmp_path: Path, corpus: Path, hidden: int) -> Path:
    config = tiny_config(corpus)
    config["model"]["encoder"] = {"hidden_size": hidden}
    config["run"] = {"device": "cpu", "dir": str(tmp_path / "run"), "tensorboard": False}
    return write_config(tmp_path / "c.yaml", config)


@pytest.mark.skipif(not _refuses_huge_allocations(), reason="overcommit 'always': not refused")
def test_a_model_larger_than_memory_is_one_line(tmp_path: Path, corpus: Path) -> None:
    """An encoder of 65,536 units (the bound) needs a 48 GiB recurrent matrix: refused."""
    hidden = 65536
    needed = 3 * hidden * hidden * 4  # the GRU's W_hh in float32
    if needed <= _memory_bytes():
        pytest.skip(f"this machine could hold {needed / GIB:.0f} GiB")
    result = nmt("train", str(_config(tmp_path, corpus, hidden)), "--quiet")
    assert result.code == 2
    assert "does not fit in the memory of cpu" in result.error
    assert "model.encoder.hidden_size=65536" in result.error and "lower them" in result.error


def test_an_out_of_memory_error_names_the_sizes(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's OutOfMemoryError (what CUDA raises) becomes the same one line."""

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(run_module, "build_model", out_of_memory)
    result = nmt("train", str(_config(tmp_path, corpus, 8)), "--quiet")
    assert result.code == 2
    assert "does not fit in the memory of cpu" in result.error
    assert "model.encoder.hidden_size=8" in result.error
    assert "Traceback" not in result.error


def test_other_runtime_errors_are_not_disguised(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RuntimeError that is not about memory is not reported as one."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug somewhere else")

    monkeypatch.setattr(run_module, "build_model", broken)
    with pytest.raises(RuntimeError, match="a bug somewhere else"):
        nmt("train", str(_config(tmp_path, corpus, 8)), "--quiet")
