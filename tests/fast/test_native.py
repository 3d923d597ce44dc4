"""nmt.fast.compiled: the compiled CPU step kernels' sigmoid and tanh against float64 on the
whole float range, their bfloat16 rounding against torch's, the loader's fallbacks, and
FastPaths.native_kernels as the one switch (NMT_NATIVE_KERNELS its default). The recurrence
through them against the float64 equations: tests/fast/test_rnn.py."""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_rnn import LENGTHS, _inputs, _rnn, _state, reference

from nmt.fast import FastPaths
from nmt.fast import compiled as native
from nmt.fast.recurrence import runs_here

needs_kernels = pytest.mark.skipif(
    native.library() is None, reason=f"no compiled kernels: {native.status()}"
)


def _gru_step(pre: torch.Tensor, n_in: torch.Tensor, h: torch.Tensor, prev: torch.Tensor | None):
    """One compiled GRU step on (1, B, H) tensors -> n, h'."""
    kernels = native.rnn_kernels(pre.dtype, h)
    assert kernels is not None
    n_out, h_out = torch.empty_like(h), torch.empty_like(h)
    kernels.run("gru_forward", pre, n_in, h, None, n_out, h_out, prev)
    return n_out, h_out


@needs_kernels
def test_sigmoid_and_tanh_are_accurate_over_the_float_range():
    """With a_n = 0, h = 1: n = tanh(n_in) and h' = n + z (1 - n), so z = (h' - n) / (1 - n);
    with n_in = 0 too, h' = z = sigmoid(a_z) itself."""
    x = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([-1e30, 1e30, 0.0])])
    width = x.numel()
    zeros = torch.zeros(1, 1, width)
    pre = torch.cat([zeros, x.view(1, 1, width), zeros], dim=-1)  # a_r, a_z, a_n
    _, z = _gru_step(pre, zeros, torch.ones(1, 1, width), None)
    expected = torch.sigmoid(x.double())
    error = (z.view(-1).double() - expected).abs()
    normal = expected > 1e-30  # below it, exp's clamp at -87.3 leaves at most 1e-37
    assert (error[normal] <= 2.4e-7 * expected[normal]).all()  # 2 float32 rounding steps
    assert (error[~normal] <= 1e-37).all()
    n, _ = _gru_step(torch.zeros(1, 1, 3 * width), x.view(1, 1, width), zeros, None)
    assert ((n.view(-1).double() - torch.tanh(x.double())).abs() <= 2.4e-7).all()
    pre = torch.zeros(1, 1, 3)
    pre[..., 1] = float("nan")
    _, h_out = _gru_step(pre, torch.zeros(1, 1, 1), torch.ones(1, 1, 1), None)
    assert h_out.isnan().all()  # a NaN is not clamped away


@needs_kernels
def test_bfloat16_copy_rounds_as_torch_does():
    """The step's h' for the next matmul, rounded to bfloat16, equals torch's rounding of h'
    bit for bit, ties to even included."""
    torch.manual_seed(4)
    width = 4096
    h = torch.randn(1, 1, width)
    # ties: float32 values in [1, 2) exactly halfway between two bfloat16 values
    bits = torch.randint(0, 2**7, (width // 4,), dtype=torch.int32) << 16 | 0x8000
    h[0, 0, : width // 4] = (bits | 0x3F800000).view(torch.float32)
    pre = torch.full((1, 1, 3 * width), 0.0, dtype=torch.bfloat16)
    pre[..., width : 2 * width] = 1e4  # z = 1: h' = h
    prev = torch.empty(1, 1, width, dtype=torch.bfloat16)
    _, h_out = _gru_step(pre, torch.zeros(1, 1, width), h, prev)
    torch.testing.assert_close(h_out, h, rtol=0, atol=0)
    assert torch.equal(prev.view(torch.int16), h_out.to(torch.bfloat16).view(torch.int16))


def _fresh_library(monkeypatch) -> None:
    """Forget the loaded library (and a switch in the environment the tests run in)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv(native.SWITCH, raising=False)


def test_the_switch_sets_the_default_and_builds_nothing(monkeypatch, tmp_path, caplog):
    _fresh_library(monkeypatch)
    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path))
    assert FastPaths().native_kernels
    monkeypatch.setenv(native.SWITCH, "0")
    assert not FastPaths().native_kernels
    assert FastPaths(native_kernels=True).native_kernels  # an explicit choice wins
    with caplog.at_level(logging.WARNING, logger="nmt.fast.compiled"):
        assert native.status() == f"off: {native.SWITCH}=0"
    assert "torch ops run instead" in caplog.text
    assert list(tmp_path.iterdir()) == []  # switched off: not even built


def _count_kernel_calls(monkeypatch) -> list[str]:
    """Record every call of a compiled kernel (letting it run)."""
    calls: list[str] = []
    run, softmax_xent = native.StepKernels.run, native.softmax_xent

    def counted_run(self, name, *tensors):
        calls.append(name)
        run(self, name, *tensors)

    def counted_softmax(*args):
        calls.append("softmax_xent")
        return softmax_xent(*args)

    monkeypatch.setattr(native.StepKernels, "run", counted_run)
    monkeypatch.setattr(native, "softmax_xent", counted_softmax)
    return calls


@needs_kernels
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_fast_paths_field_decides_whether_the_kernels_run(cell, monkeypatch):
    """FastPaths.native_kernels, not the environment, decides: the same training step of the
    recurrence and the loss runs the compiled kernels with it and none without it (with the
    environment saying the opposite each time), to the same results."""
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(7)
    rnn = _rnn(cell, True, 1, torch.float32).train()
    x, lengths, h0, c0 = _inputs(2, 1, cell == "lstm", torch.float32)
    weight = torch.randn(11, 2 * rnn.hidden_size, requires_grad=True)
    results = []
    for use, environment in [(True, "0"), (False, "1")]:
        monkeypatch.setenv(native.SWITCH, environment)
        fast = FastPaths(native_kernels=use)
        calls.clear()
        outputs, _ = fast.recurrence(rnn, x, lengths, _state(h0, c0), training=True)
        features = outputs.reshape(-1, outputs.size(-1))
        target = torch.randint(
            0, 11, (features.size(0),), generator=torch.Generator().manual_seed(8)
        )
        loss, _ = fast.output_loss(features, weight, target, 0.1, training=True)
        grads = torch.autograd.grad(loss, [weight, *rnn.parameters()])
        expected = {f"{cell}_forward", f"{cell}_backward", "softmax_xent"} if use else set()
        assert set(calls) == expected
        results.append([loss.detach(), *grads])
    for ours, eager in zip(*results, strict=True):
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)


def test_a_failing_compiler_falls_back_to_torch_ops(monkeypatch, tmp_path, caplog):
    _fresh_library(monkeypatch)
    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level(logging.WARNING, logger="nmt.fast.compiled"):
        assert native.library() is None
    assert native.status().startswith("off: could not build them")
    assert list(tmp_path.glob("*.so")) == []  # nothing half-written left behind
    torch.manual_seed(5)
    rnn = _rnn("gru", True, 1, torch.float32).train()
    x, lengths, h0, _ = _inputs(2, 1, False, torch.float32, LENGTHS)
    assert not runs_here(rnn, x)
    outputs, _ = FastPaths().recurrence(rnn, x, lengths, h0, training=True)  # the module's
    with torch.no_grad():
        ref, _, _ = reference(rnn.double(), x.double(), lengths, h0.double(), None)
    torch.testing.assert_close(outputs.double(), ref, rtol=0, atol=2e-6)


def test_no_compiler_on_path(monkeypatch):
    _fresh_library(monkeypatch)
    monkeypatch.setenv("CC", "no-such-compiler-nmt")
    assert native.library() is None
    assert native.status() == "off: no C compiler (no-such-compiler-nmt) on PATH"


@needs_kernels
def test_builds_once_per_source_into_the_cache(monkeypatch, tmp_path):
    _fresh_library(monkeypatch)
    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path / "cache"))
    assert native.library() is not None
    (built,) = (tmp_path / "cache").glob("kernels-*.so")
    # a changed source gets a library of its own
    changed = tmp_path / "kernels.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    compiler = native._compiler()
    assert compiler is not None
    assert native.library_path(compiler) != built
    assert native.library_path(compiler).parent == Path(tmp_path / "cache")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_softmax_cross_entropy_kernel_matches_float64(dtype):
    """The output layer's kernel against the equations in float64: log Z - z_y, log Z -
    mean_v z_v, p_y, and G = softmax - eps / V - (1 - eps) onehot(y) in place of the logits
    (rounded once to their dtype); without write_grad the logits stay as they were."""
    torch.manual_seed(6)
    rows, vocab, eps = 37, 1003, 0.1
    logits = (4 * torch.randn(rows, vocab)).to(dtype)
    logits[0, 5] = 60.0  # a peaked row
    target = torch.randint(0, vocab, (rows,))
    target[:2] = torch.tensor([0, vocab - 1])
    z = logits.double()
    log_z = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, target[:, None]).squeeze(1)
    softmax = torch.softmax(z, dim=-1)
    expected_grad = softmax - eps / vocab
    expected_grad[torch.arange(rows), target] -= 1 - eps
    for write_grad in (False, True):
        buffer, stats = logits.clone(), torch.empty(3, rows)
        assert native.softmax_xent(buffer, target, stats, eps, write_grad)
        torch.testing.assert_close(stats[0].double(), log_z - z_y, rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(stats[1].double(), log_z - z.mean(-1), rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(
            stats[2].double(), softmax.gather(1, target[:, None]).squeeze(1), rtol=2e-6, atol=1e-9
        )
        if not write_grad:
            assert torch.equal(buffer, logits)
            continue
        # float32: the error of the float32 sum over V exponentials, which the vector lanes
        # accumulate in V / lanes steps (up to ~40 rounding steps of 2^-24 with AVX2's 8
        # lanes, half that with AVX-512); bfloat16: one rounding of G on top
        rtol = 2.0**-8 if dtype == torch.bfloat16 else 4e-6
        torch.testing.assert_close(buffer.double(), expected_grad, rtol=rtol, atol=1e-7)


@needs_kernels
def test_concurrent_builds_leave_one_whole_library(tmp_path):
    """Several processes (xdist workers, torchrun ranks) may build at once: each writes its
    own temporary file and renames it into place, so the library is always whole."""
    compiler = native._compiler()
    assert compiler is not None
    target = tmp_path / "kernels-test.so"
    with ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(lambda _: native.build(compiler, target), range(3)))
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary left
    native._load(target)  # every kernel's symbol is there
