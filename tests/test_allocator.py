"""The malloc settings of CPU training (nmt.runtime.tune_allocator): blocks of every size come
from the heap and stay there for reuse, instead of being mapped and unmapped (and their pages
faulted in again) every time; users' own malloc settings win; only CPU runs with
``run.fast_kernels`` apply them. And the `nmt` command's cap on oneDNN's kernel cache."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from nmt import runtime

# A fresh process allocates a tensor of argv[2] bytes and prints how many bytes malloc has mapped
# outside its heap while the tensor lives (glibc's mallinfo2, 2.33 and later).
MAPPED_WHILE_HELD = """
import ctypes, sys, torch
from nmt.runtime import tune_allocator
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "tuned":
    assert tune_allocator()
before = libc.mallinfo2().hblkhd
block = torch.ones(int(sys.argv[2]), dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - before)
"""


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


def _mapped_while_held(mode: str, size: int) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run(
        [sys.executable, "-c", MAPPED_WHILE_HELD, mode, str(size)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return int(done.stdout.strip())


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33+ on Linux only")
@pytest.mark.parametrize("size", [8 << 20, 64 << 20])  # below and above glibc's largest threshold
def test_tuned_malloc_serves_large_blocks_from_its_heap(size) -> None:
    assert _mapped_while_held("default", size) >= size  # glibc maps a first block this large
    assert _mapped_while_held("tuned", size) == 0  # tuned: from the heap, kept there when freed


def test_users_malloc_settings_win(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(runtime.ctypes, "CDLL", refuse)
    for name in runtime._MALLOC_ENVIRONMENT:
        with monkeypatch.context() as env:
            env.setenv(name, "1048576")
            assert runtime.tune_allocator() is False


def test_only_cpu_runs_with_fast_kernels_tune_malloc(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(runtime, "tune_allocator", lambda: calls.append(1) or True)
    try:
        runtime.choose_fast_paths(False, torch.device("cpu"))
        assert not runtime.fast_kernels(torch.device("cpu")) and calls == []
        runtime.choose_fast_paths(True, torch.device("cuda"))
        assert calls == []
        runtime.choose_fast_paths(True, torch.device("cpu"))
        assert runtime.fast_kernels(torch.device("cpu")) and calls == [1]
    finally:
        runtime.set_fast_kernels(True)


def _kernel_cache_seen_by_the_command(env: dict[str, str]) -> str:
    """The ONEDNN_PRIMITIVE_CACHE_CAPACITY that torch would read in an `nmt` process."""
    code = (
        "import os, sys\n"
        "from nmt import cli\n"
        "sys.argv = ['nmt', '--version']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def test_the_command_caps_onednns_kernel_cache_unless_the_user_did() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert _kernel_cache_seen_by_the_command(env) == "32"
    assert _kernel_cache_seen_by_the_command({**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}) == "7"
