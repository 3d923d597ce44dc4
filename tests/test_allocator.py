"""The malloc settings of CPU training (nmt.allocator.tune_allocator): blocks of every size come
from the heap and stay there for reuse, instead of being mapped and unmapped (and their pages
faulted in again) every time; users' own malloc settings win; only CPU runs with
``run.fast_kernels`` apply them. `nmt train` on a CPU starts itself again with glibc's tcache
off (nmt.allocator.MALLOC_TUNABLES), and this glibc takes that setting. And the `nmt` command's
cap on oneDNN's kernel cache."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from synthetic import data_section, luong_model_section, write_corpus

from nmt import allocator, cli

# The start of a script for a fresh process: glibc's malloc statistics (mallinfo2, 2.33 and
# later) through ctypes.
MALLINFO2 = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
"""

# A fresh process allocates a tensor of argv[2] bytes and prints how many bytes malloc has mapped
# outside its heap while the tensor lives.
MAPPED_WHILE_HELD = (
    MALLINFO2
    + """
import sys, torch
from nmt.allocator import tune_allocator
if sys.argv[1] == "tuned":
    assert tune_allocator()
before = libc.mallinfo2().hblkhd
block = torch.ones(int(sys.argv[2]), dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""
)


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


def _without_malloc_settings() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    return env


def _printed_number(script: str, *args: str, **extra_env: str) -> int:
    """What ``script`` prints, run in a fresh process without any malloc settings but extra_env."""
    env = {**_without_malloc_settings(), **extra_env}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def _mapped_while_held(mode: str, size: int, **extra_env: str) -> int:
    return _printed_number(MAPPED_WHILE_HELD, mode, str(size), **extra_env)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ on Linux only")
@pytest.mark.parametrize("size", [8 << 20, 64 << 20])  # below and above glibc's largest threshold
def test_tuned_malloc_serves_large_blocks_from_its_heap(size) -> None:
    assert _mapped_while_held("default", size) >= size  # glibc maps a first block this large
    assert _mapped_while_held("tuned", size) == 0  # tuned: from the heap, kept there when freed


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ on Linux only")
def test_the_restarts_own_tunables_keep_the_malloc_settings() -> None:
    size = 64 << 20
    assert _mapped_while_held("tuned", size, GLIBC_TUNABLES=allocator.MALLOC_TUNABLES) == 0


def test_users_malloc_settings_win(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(allocator.ctypes, "CDLL", refuse)
    for name in allocator._MALLOC_ENVIRONMENT:
        with monkeypatch.context() as env:
            env.setenv(name, "1048576")
            assert allocator.tune_allocator() is False


def test_only_cpu_training_with_fast_kernels_tunes_malloc(
    tiny_config: Path, tmp_path: Path, monkeypatch
) -> None:
    from nmt.config import load
    from nmt.training import train

    calls = []
    monkeypatch.setattr(allocator, "tune_allocator", lambda: calls.append(1) or True)
    train(load(tiny_config, ["run.fast_kernels=false"]), tmp_path / "plain", quiet=True)
    assert calls == []
    train(load(tiny_config), tmp_path / "fast", quiet=True)
    assert calls == [1]


def _kernel_cache_seen_by_the_command(monkeypatch: pytest.MonkeyPatch) -> str:
    """The ONEDNN_PRIMITIVE_CACHE_CAPACITY that torch would read in an `nmt` process: what the
    environment holds after the command's entry point ran (``nmt --version``)."""
    monkeypatch.setattr(sys, "argv", ["nmt", "--version"])
    with pytest.raises(SystemExit):
        cli.main()
    return os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]


def test_the_command_caps_onednns_kernel_cache_unless_the_user_did(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert _kernel_cache_seen_by_the_command(monkeypatch) == "32"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    assert _kernel_cache_seen_by_the_command(monkeypatch) == "7"


# ----------------------------------------------------------------------------- tcache restart


# A fresh process takes 8 small chunks (emptying the tcache's list of that size, which holds at
# most 7), frees one and prints how many chunks glibc's fast bins hold more than before: 0 when
# the chunk went to the tcache, 1 when it went to a fast bin (where the next large allocation
# merges it with the free space beside it).
FREED_TO_FAST_BINS = (
    MALLINFO2
    + """
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
chunks = [libc.malloc(40) for _ in range(8)]
before = libc.mallinfo2().smblks
libc.free(chunks.pop())
print(libc.mallinfo2().smblks - before)
"""
)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ on Linux only")
def test_the_restarts_tunables_switch_glibcs_tcache_off() -> None:
    assert _printed_number(FREED_TO_FAST_BINS) == 0  # the tcache took it
    tuned = _printed_number(FREED_TO_FAST_BINS, GLIBC_TUNABLES=allocator.MALLOC_TUNABLES)
    assert tuned == 1


def test_only_cpu_runs_with_fast_kernels_and_no_tunables_of_the_users_restart(
    monkeypatch,
) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(allocator, "_glibc", lambda: True)
    cpu = "cpu"
    assert allocator.wants_malloc_tunables(cpu, True)
    assert not allocator.wants_malloc_tunables(cpu, False)
    assert not allocator.wants_malloc_tunables("cuda", True)
    monkeypatch.setenv("GLIBC_TUNABLES", "")  # the user's, even empty: left alone
    assert not allocator.wants_malloc_tunables(cpu, True)
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr(allocator, "_glibc", lambda: False)  # musl, macOS, Windows
    assert not allocator.wants_malloc_tunables(cpu, True)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("restart")
    write_corpus(root, {"train": 60, "dev": 8})
    config = {
        "data": data_section(root),
        "tokenizer": {"vocab_size": 40, "type": "bpe"},
        "model": luong_model_section(8),
        "training": {"max_steps": 1, "batch_tokens": 200},
        "run": {"device": "cpu"},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _tunables_of_the_run(run_dir: Path) -> str | None:
    info = json.loads((run_dir / "environment.json").read_text(encoding="utf-8"))
    return info["glibc_tunables"]


@pytest.mark.skipif(not allocator._glibc(), reason="glibc on Linux only")
def test_nmt_train_on_a_cpu_runs_with_the_tcache_off(tiny_config: Path, tmp_path: Path) -> None:
    """The command restarts itself with the tunables and records them (which runs restart:
    ``test_only_cpu_runs_with_fast_kernels_and_no_tunables_of_the_users_restart``)."""
    command = [sys.executable, "-m", "nmt", "train", str(tiny_config), "-q"]
    command += ["--run-dir", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, env=_without_malloc_settings())
    assert done.returncode == 0, done.stderr
    assert _tunables_of_the_run(tmp_path / "run") == allocator.MALLOC_TUNABLES


def test_only_the_command_restarts_never_an_in_process_call(
    tiny_config: Path, tmp_path: Path, monkeypatch
) -> None:
    restarts = []
    monkeypatch.setattr(allocator, "_glibc", lambda: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(allocator, "restart_with_malloc_tunables", lambda: restarts.append(1))
    monkeypatch.setitem(cli._state, "may_restart", False)
    for entry, run_dir in ((cli.main, tmp_path / "main"), (cli.command, tmp_path / "command")):
        monkeypatch.setattr(sys, "argv", ["nmt", "train", str(tiny_config), "-q"])
        sys.argv += ["--run-dir", str(run_dir)]
        with pytest.raises(SystemExit) as stopped:
            entry()
        assert stopped.value.code == 0
        assert restarts == ([] if entry is cli.main else [1])
