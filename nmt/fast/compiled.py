"""nmt's compiled CPU kernels (kernels.c beside this file): built on first use, called through
ctypes.

The file is compiled once per machine with the C compiler (``$CC``, else ``cc``) for this
CPU (``-O3 -march=native -fopenmp``) into nmt's cache directory (``$NMT_CACHE_DIR``, else
``$XDG_CACHE_HOME/nmt``, else ``~/.cache/nmt``); the library's name holds a hash of the
source, the compiler, its flags and the CPU's model and flags, so a change to any of them
builds a new one. OpenMP is the one torch's CPU build already loaded (same library name), so
the kernels share torch's threads. Where no compiler works, ``library()`` returns None, says
why once in the log, and nmt runs torch ops instead. ``NMT_NATIVE_KERNELS=0`` switches the
kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from nmt.runtime import cpu_description

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-lm")
SWITCH = "NMT_NATIVE_KERNELS"

_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_PTR = ctypes.c_void_p
# argument types of each kernel, in kernels.c's order: a pointer, or a pointer and its
# D-stride; the RNN steps end with D, B, H and the thread count
_STEP_SIZES = [_I64, _I64, _I64, _I32]
_SIGNATURES: dict[str, list[type]] = {
    "gru_forward": [_PTR, *[_PTR, _I64] * 6, *_STEP_SIZES],
    "gru_backward": [_PTR, _PTR, *[_PTR, _I64] * 2, _PTR, *[_PTR, _I64] * 4, *_STEP_SIZES],
    "lstm_forward": [_PTR, *[_PTR, _I64] * 8, *_STEP_SIZES],
    "lstm_backward": [_PTR, _PTR, *[_PTR, _I64] * 2, _PTR, *[_PTR, _I64] * 4, *_STEP_SIZES],
    "softmax_xent": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float, _I32, _PTR, _I32],
}

_state: dict[str, ctypes.CDLL | None | str] = {}


def cache_dir() -> Path:
    explicit = os.environ.get("NMT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nmt"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def library_path(compiler: str) -> Path:
    key = "\n".join(
        [SOURCE.read_text(), compiler, _compiler_version(compiler), *FLAGS, cpu_description()]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"kernels-{digest}.so"


def build(compiler: str, target: Path) -> None:
    """Compile kernels.c into ``target``, atomically (parallel processes may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-500:]}")
        os.replace(partial, target)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        for suffix in ("bf16", "f32"):
            function = getattr(lib, f"nmt_{name}_{suffix}")
            function.argtypes, function.restype = argtypes, None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on the first call; None where they cannot be had."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib = None
    if os.environ.get(SWITCH, "1") == "0":
        reason = f"{SWITCH}=0"
    elif (compiler := _compiler()) is None:
        reason = f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH"
    else:
        try:
            path = library_path(compiler)
            if not path.exists():
                log.info("compiling nmt's CPU kernels into %s", path)
                build(compiler, path)
            lib = _load(path)
            reason = f"built with {compiler}"
        except (OSError, AttributeError, subprocess.SubprocessError) as error:
            reason = f"could not build them ({error})"
    if lib is None:
        log.warning("nmt's compiled CPU kernels are off: %s; torch ops run instead", reason)
    _state["lib"], _state["reason"] = lib, reason
    return lib


def status() -> str:
    """One line for the run's environment record: whether the kernels run, and why."""
    library()
    return ("on, " if _state["lib"] is not None else "off: ") + str(_state["reason"])


def _blocks(tensor: Tensor | None) -> tuple[int | None, int]:
    """A (D, ...) tensor's address and the stride between its direction blocks, in elements.
    Each block must be contiguous (the caller's buffers are)."""
    return (None, 0) if tensor is None else (tensor.data_ptr(), tensor.stride(0))


class StepKernels:
    """One RNN time step of every direction, through the compiled kernels (see kernels.c for
    the arguments). Tensors: (D, B, F) with contiguous (B, F) blocks; ``pre``, ``rec``,
    ``prev_out`` and the gate gradients in the matmul dtype (bfloat16 or float32), the rest
    float32; ``keep`` (D, B, 1) or None."""

    def __init__(self, lib: ctypes.CDLL, compute: torch.dtype):
        self.threads = torch.get_num_threads()  # torch's, as for its own ops
        suffix = "bf16" if compute == torch.bfloat16 else "f32"
        self._gru_forward = getattr(lib, f"nmt_gru_forward_{suffix}")
        self._gru_backward = getattr(lib, f"nmt_gru_backward_{suffix}")
        self._lstm_forward = getattr(lib, f"nmt_lstm_forward_{suffix}")
        self._lstm_backward = getattr(lib, f"nmt_lstm_backward_{suffix}")

    def gru_forward(
        self,
        pre: Tensor,
        n_in: Tensor,
        h: Tensor,
        keep: Tensor | None,
        n_out: Tensor,
        h_out: Tensor,
        prev_out: Tensor | None,
    ) -> None:
        directions, batch, hidden = h.shape
        self._gru_forward(
            pre.data_ptr(),
            *_blocks(n_in),
            *_blocks(h),
            *_blocks(keep),
            *_blocks(n_out),
            *_blocks(h_out),
            *_blocks(prev_out),
            directions,
            batch,
            hidden,
            self.threads,
        )

    def gru_backward(
        self,
        carry: Tensor,
        rec: Tensor,
        grad_out: Tensor,
        keep: Tensor | None,
        pre: Tensor,
        n: Tensor,
        h_prev: Tensor,
        grad_gates: Tensor,
        grad_n_in: Tensor,
    ) -> None:
        directions, batch, hidden = carry.shape
        self._gru_backward(
            carry.data_ptr(),
            rec.data_ptr(),
            *_blocks(grad_out),
            *_blocks(keep),
            pre.data_ptr(),
            *_blocks(n),
            *_blocks(h_prev),
            *_blocks(grad_gates),
            *_blocks(grad_n_in),
            directions,
            batch,
            hidden,
            self.threads,
        )

    def lstm_forward(
        self,
        pre: Tensor,
        c: Tensor,
        h: Tensor,
        keep: Tensor | None,
        act_out: Tensor,
        tanh_c_out: Tensor,
        c_out: Tensor,
        h_out: Tensor,
        prev_out: Tensor | None,
    ) -> None:
        directions, batch, hidden = h.shape
        self._lstm_forward(
            pre.data_ptr(),
            *_blocks(c),
            *_blocks(h),
            *_blocks(keep),
            *_blocks(act_out),
            *_blocks(tanh_c_out),
            *_blocks(c_out),
            *_blocks(h_out),
            *_blocks(prev_out),
            directions,
            batch,
            hidden,
            self.threads,
        )

    def lstm_backward(
        self,
        carry: Tensor,
        rec: Tensor,
        grad_out: Tensor,
        keep: Tensor | None,
        dc: Tensor,
        act: Tensor,
        tanh_c: Tensor,
        c_prev: Tensor,
        grad_gates: Tensor,
    ) -> None:
        directions, batch, hidden = carry.shape
        self._lstm_backward(
            carry.data_ptr(),
            rec.data_ptr(),
            *_blocks(grad_out),
            *_blocks(keep),
            dc.data_ptr(),
            *_blocks(act),
            *_blocks(tanh_c),
            *_blocks(c_prev),
            *_blocks(grad_gates),
            directions,
            batch,
            hidden,
            self.threads,
        )


def rnn_kernels(compute: torch.dtype, state: Tensor) -> StepKernels | None:
    """The step kernels for an RNN whose matmuls run in ``compute`` and whose states are like
    ``state``, or None where torch ops must run (no library, another device or dtype)."""
    if state.device.type != "cpu" or state.dtype != torch.float32:
        return None
    if compute not in (torch.bfloat16, torch.float32):
        return None
    lib = library()
    return None if lib is None else StepKernels(lib, compute)


def softmax_xent(
    logits: Tensor, target: Tensor, stats: Tensor, eps: float, write_grad: bool
) -> bool:
    """The output layer's loss statistics over a block of logits (n, V), bfloat16 or float32,
    with targets (n,) int64 -> stats (3, n) float32: -log p[y], -mean_v log p[v] and p[y];
    with write_grad, the logits become the loss's gradient at them (kernels.c). Returns False,
    touching nothing, where the compiled kernel cannot run it."""
    if logits.dtype not in (torch.bfloat16, torch.float32) or stats.dtype != torch.float32:
        return False
    lib = library() if logits.device.type == "cpu" else None
    if lib is None:
        return False
    rows, vocab = logits.shape
    assert logits.is_contiguous() and target.is_contiguous() and stats.stride(1) == 1
    assert target.dtype == torch.int64 and rows == target.numel() == stats.size(1)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, vocab)  # a row of exponentials per thread
    suffix = "bf16" if logits.dtype == torch.bfloat16 else "f32"
    getattr(lib, f"nmt_softmax_xent_{suffix}")(
        logits.data_ptr(),
        rows,
        vocab,
        target.data_ptr(),
        stats[0].data_ptr(),
        stats[1].data_ptr(),
        stats[2].data_ptr(),
        eps,
        int(write_grad),
        scratch.data_ptr(),
        threads,
    )
    return True
