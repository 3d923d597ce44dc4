"""nmt's compiled CPU kernels (kernels.c beside this file): built on first use, called through
ctypes.

The file is compiled once per machine with the C compiler (``$CC``, else ``cc``) for this
CPU (``-O3 -march=native -fopenmp -fno-trapping-math``, ``FLAGS``) into nmt's cache
directory (``$NMT_CACHE_DIR``, else ``$XDG_CACHE_HOME/nmt``, else ``~/.cache/nmt``); the
library's name holds a hash of the source, the compiler, its flags and the CPU's model and
flags, so a change to any of them builds a new one. OpenMP is the one torch's CPU build
already loaded (same library name), so the kernels share torch's threads. Where no compiler
works, ``library()`` returns None, says why once in the log, and nmt runs torch ops instead.

Whether a model uses the kernels is decided once, when it is built: ``FastPaths.native_kernels``
(nmt.fast), passed down to the recurrence and the loss. ``NMT_NATIVE_KERNELS=0`` in the
environment sets that field's default to off (``enabled_by_default``).
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
# -fno-trapping-math: GCC keeps a select on a computed float (the exponential's clamps,
# kernels.c) as a branch while a comparison may trap, and then leaves the loops over a row's
# units scalar; no trap is ever enabled. Nothing is reordered or contracted by it: the RNN
# steps keep their results' bits and run vectorised; the reductions the
# kernels mark ``omp simd`` (the softmax sums) vectorise as marked, so they round in another
# order than the scalar loops did.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-lm",
)
SWITCH = "NMT_NATIVE_KERNELS"

_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_PTR = ctypes.c_void_p
# kernels.c's RNN steps take their tensors in this order, each as "c", a pointer (contiguous
# over the directions), or "s", a pointer and its D-stride; then D, B, H and the thread count
_STEP_ARGUMENTS = {
    "gru_forward": "cssssss",
    "gru_backward": "ccsscssss",
    "lstm_forward": "cssssssss",
    "lstm_backward": "ccsscssss",
}
_SOFTMAX_XENT: list[type] = [
    _PTR,
    _I64,
    _I64,
    _PTR,
    _PTR,
    _PTR,
    _PTR,
    ctypes.c_float,
    _I32,
    _PTR,
    _I32,
]


def _signatures() -> dict[str, list[type]]:
    """The argument types of each kernel, in kernels.c's order."""
    kinds: dict[str, list[type]] = {"c": [_PTR], "s": [_PTR, _I64]}
    signatures = {
        name: [t for kind in layout for t in kinds[kind]] + [_I64, _I64, _I64, _I32]
        for name, layout in _STEP_ARGUMENTS.items()
    }
    return {**signatures, "softmax_xent": _SOFTMAX_XENT}


# kernels.c's decoding kernels, float32 alone
_DECODING: dict[str, list[type]] = {
    "log_softmax": [_PTR, _I64, _I64, _PTR, _I32],
    "top_k": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I32],
    "gru_cell": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I32],  # gx, gh, h, h_out, B, H
    "lstm_cell": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I32],  # gx, gh, c, h_out, c_out
    # q, keys, values, mask, B, R, S, A, F, scale, alphas, context
    "attend": [_PTR] * 4 + [_I64] * 5 + [ctypes.c_float, _PTR, _PTR, _I32],
}
TOP_K_MAX = 128  # a larger k: torch's top-k (each value that enters shifts up to k others)


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
    for name, argtypes in _signatures().items():
        for suffix in ("bf16", "f32"):
            function = getattr(lib, f"nmt_{name}_{suffix}")
            function.argtypes, function.restype = argtypes, None
    for name, argtypes in _DECODING.items():
        function = getattr(lib, f"nmt_{name}_f32")
        function.argtypes, function.restype = argtypes, None
    return lib


def enabled_by_default() -> bool:
    """``FastPaths.native_kernels``' default: on unless ``NMT_NATIVE_KERNELS=0``."""
    return os.environ.get(SWITCH, "1") != "0"


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built and loaded on the first call (once per process); None
    where they cannot be had. Whether a model uses them is its ``FastPaths``' decision."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib = None
    if (compiler := _compiler()) is None:
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
        _say_off(reason)
    _state["lib"], _state["reason"] = lib, reason
    return lib


def status() -> str:
    """One line for the run's environment record: whether a model built with the default
    ``FastPaths`` runs the kernels, and why."""
    if not enabled_by_default():
        _say_off(f"{SWITCH}=0")  # the library is then neither built nor loaded
        return f"off: {SWITCH}=0"
    library()
    return ("on, " if _state["lib"] is not None else "off: ") + str(_state["reason"])


def _say_off(reason: str) -> None:
    log.warning("nmt's compiled CPU kernels are off: %s; torch ops run instead", reason)


def _blocks(tensor: Tensor | None) -> tuple[int | None, int]:
    """A (D, ...) tensor's address and the stride between its direction blocks, in elements.
    Each block must be contiguous (the caller's buffers are)."""
    return (None, 0) if tensor is None else (tensor.data_ptr(), tensor.stride(0))


class StepKernels:
    """One RNN time step of every direction, through the compiled kernels. Tensors: (D, B, F)
    with contiguous (B, F) blocks; the gates' pre-activations, the recurrent gradient, h' for
    the next matmul and the gate gradients in the matmul dtype (bfloat16 or float32), the rest
    float32; ``keep`` (D, B, 1) or None."""

    def __init__(self, lib: ctypes.CDLL, compute: torch.dtype, state: Tensor):
        self.threads = torch.get_num_threads()  # torch's, as for its own ops
        self.sizes = tuple(state.shape)  # D, B, H
        suffix = "bf16" if compute == torch.bfloat16 else "f32"
        self._functions = {name: getattr(lib, f"nmt_{name}_{suffix}") for name in _STEP_ARGUMENTS}

    def run(self, name: str, *tensors: Tensor | None) -> None:
        """kernels.c's ``nmt_<name>`` on ``tensors``, in its order (see kernels.c)."""
        arguments: list[int | None] = []
        for kind, tensor in zip(_STEP_ARGUMENTS[name], tensors, strict=True):
            if kind == "c":
                arguments.append(None if tensor is None else tensor.data_ptr())
            else:
                arguments.extend(_blocks(tensor))
        self._functions[name](*arguments, *self.sizes, self.threads)


def rnn_steps_run(device: torch.device, states: torch.dtype, compute: torch.dtype) -> bool:
    """Whether the RNN step kernels run on ``device`` for states in ``states`` and matmuls in
    ``compute``: a CPU, float32 states, bfloat16 or float32 matmuls, and the library."""
    if device.type != "cpu" or states != torch.float32:
        return False
    return compute in (torch.bfloat16, torch.float32) and library() is not None


def rnn_kernels(compute: torch.dtype, state: Tensor) -> StepKernels | None:
    """The step kernels for an RNN whose matmuls run in ``compute`` and whose states are like
    ``state`` (D, B, H), or None where they cannot run (``rnn_steps_run``)."""
    if not rnn_steps_run(state.device, state.dtype, compute):
        return None
    lib = library()
    assert lib is not None
    return StepKernels(lib, compute, state)


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


def _decoding_library(tensor: Tensor) -> ctypes.CDLL | None:
    """The library, where a search step's float32 CPU tensor can go through it."""
    if not tensor.is_cpu or tensor.dtype != torch.float32 or tensor.dim() != 2:
        return None
    return library() if tensor.is_contiguous() else None


def log_softmax_(logits: Tensor, allowed: Tensor | None) -> bool:
    """A search step's log-softmax over each row of ``logits`` (N, V) float32, in place; with
    ``allowed`` (N, V) bool, over each row's allowed columns alone, the others -inf (kernels.c).
    Returns False, touching nothing, where the compiled kernel cannot run it."""
    lib = _decoding_library(logits)
    if lib is None or (allowed is not None and not allowed.is_contiguous()):
        return False
    rows, vocab = logits.shape
    mask = None
    if allowed is not None:
        assert allowed.shape == logits.shape and allowed.dtype == torch.bool
        mask = allowed.view(torch.uint8).data_ptr()
    lib.nmt_log_softmax_f32(logits.data_ptr(), rows, vocab, mask, torch.get_num_threads())
    return True


def top_k(values: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """The k largest values of each row of ``values`` (N, V) float32 and their indices, each
    (N, k), largest first and, among equal values, the first first (kernels.c); None where
    the compiled kernel cannot run it."""
    lib = _decoding_library(values)
    if lib is None or not 1 <= k <= min(TOP_K_MAX, values.size(1)):
        return None
    rows, vocab = values.shape
    best = torch.empty(rows, k)
    at = torch.empty(rows, k, dtype=torch.int64)
    threads = torch.get_num_threads()
    lib.nmt_top_k_f32(values.data_ptr(), rows, vocab, k, best.data_ptr(), at.data_ptr(), threads)
    return best, at


def attend(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor] | None:
    """A search step's attention by a dot-product score (kernels.c's ``nmt_attend_f32``):
    query (B*R, A), R rows per sentence, keys (B, S, A), values (B, S, F), mask (B, S) bool,
    True at the real positions -> context (B*R, F) and alphas (B*R, S), the softmax over the
    real positions of scale * q^T k_s, exactly 0 at padding; None where the kernel cannot
    run them (not all contiguous float32 CPU tensors of those shapes, or no library)."""
    if query.dim() != 2 or keys.dim() != 3 or values.dim() != 3 or mask.dim() != 2:
        return None
    sentences, length, width = keys.shape
    if (
        values.size(0) != sentences
        or values.size(1) != length
        or mask.size(0) != sentences
        or mask.size(1) != length
        or mask.dtype != torch.bool
        or query.size(1) != width
        or query.size(0) % sentences
        or keys.dtype != torch.float32
        or values.dtype != torch.float32
        or not (keys.is_cpu and values.is_cpu and mask.is_cpu)
        or not (keys.is_contiguous() and values.is_contiguous() and mask.is_contiguous())
    ):
        return None
    lib = _decoding_library(query)
    if lib is None:
        return None
    rows, features = query.size(0), values.size(2)
    alphas = torch.empty(rows, length)
    context = torch.empty(rows, features)
    lib.nmt_attend_f32(
        query.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        mask.view(torch.uint8).data_ptr(),
        sentences,
        rows // sentences,
        length,
        width,
        features,
        scale,
        alphas.data_ptr(),
        context.data_ptr(),
        torch.get_num_threads(),
    )
    return context, alphas


def rnn_cell(
    gates_x: Tensor, gates_h: Tensor, h: Tensor, c: Tensor | None
) -> tuple[Tensor, Tensor | None] | None:
    """One step of a GRU (c None) or LSTM layer without gradients (kernels.c's
    ``nmt_gru_cell_f32`` / ``nmt_lstm_cell_f32``): the input gates W_i x + b_i and the
    recurrent gates W_h h + b_h (B, G*H), the state h and (LSTM) c (B, H) -> h' and c' (None
    for a GRU), new tensors; None where the kernel cannot run them (not all float32
    contiguous 2-D CPU tensors, or no library: ``_decoding_library``)."""
    tensors = [gates_x, gates_h, h] if c is None else [gates_x, gates_h, h, c]
    if any(_decoding_library(tensor) is None for tensor in tensors):
        return None
    lib = library()
    assert lib is not None
    batch, hidden = h.shape
    threads = torch.get_num_threads()
    h_out = torch.empty_like(h)
    if c is None:
        lib.nmt_gru_cell_f32(
            gates_x.data_ptr(),
            gates_h.data_ptr(),
            h.data_ptr(),
            h_out.data_ptr(),
            batch,
            hidden,
            threads,
        )
        return h_out, None
    c_out = torch.empty_like(c)
    lib.nmt_lstm_cell_f32(
        gates_x.data_ptr(),
        gates_h.data_ptr(),
        c.data_ptr(),
        h_out.data_ptr(),
        c_out.data_ptr(),
        batch,
        hidden,
        threads,
    )
    return h_out, c_out
