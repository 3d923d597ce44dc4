"""The GPU faults that a CPU can test, each through the code path a GPU takes: attention copied
to the host before NumPy sees it, RNNs outside autocast where autocast would run them in fp16,
a process group that waits for data preparation, and TF32 for fp32 on CUDA."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import nmt.decoding.translator as translator_module
import nmt.fast.recurrence as recurrence
from nmt.commands.common import Models
from nmt.commands.translate import TranslateRequest, translate_command
from nmt.runtime import allow_tf32
from nmt.training import distributed


class OnDevice(torch.Tensor):
    """Stands for a tensor on a GPU: NumPy cannot read it before ``.cpu()``."""

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("can't convert a device tensor to numpy; use .cpu() first")


def test_beam_attention_reaches_the_plots_through_the_host(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = translator_module.beam_search

    def on_device(*args: Any, **kwargs: Any) -> Any:
        results = real(*args, **kwargs)
        for hyps in results:
            for hyp in hyps:
                hyp.alphas = hyp.alphas.as_subclass(OnDevice)
        return results

    monkeypatch.setattr(translator_module, "beam_search", on_device)
    source, out, plots = tmp_path / "in.txt", tmp_path / "out.txt", tmp_path / "plots"
    source.write_text("sol luna\nmar rio casa\n", encoding="utf-8")
    models = Models([run], device="cpu")
    decoding = {"beam_size": 3}
    request = TranslateRequest(models, str(source), str(out), decoding, attention_dir=plots)
    translate_command(request)
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    assert len(list(plots.glob("*.npy"))) == 2


def test_rnns_run_outside_autocast_where_it_would_pick_their_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, autocast runs cuDNN RNNs in fp16 whatever its own dtype: there the plain
    path runs them in the weights' dtype. The same path, taken for the CPU here."""
    torch.manual_seed(0)
    rnn = torch.nn.GRU(6, 5, batch_first=True, bidirectional=True)
    inputs, lengths = torch.randn(3, 4, 6), torch.tensor([4, 2, 3])
    reference, _ = recurrence.plain_rnn(rnn, inputs, lengths, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, _ = recurrence.plain_rnn(rnn, inputs.bfloat16(), lengths, None)
    assert kept.dtype == torch.bfloat16  # the CPU keeps autocast's RNN (oneDNN in bf16)
    monkeypatch.setattr(recurrence, "RNN_OUTSIDE_AUTOCAST", {"cpu", "cuda"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outside, final = recurrence.plain_rnn(rnn, inputs.bfloat16(), lengths, None)
    assert outside.dtype == final.dtype == torch.float32
    expected, _ = recurrence.plain_rnn(rnn, inputs.bfloat16().float(), lengths, None)
    torch.testing.assert_close(outside, expected, rtol=0, atol=0)
    assert not torch.equal(outside, reference)  # the input was rounded to bf16 first


def test_the_process_group_waits_for_data_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks > 0 wait in a collective while rank 0 prepares the data: far longer than torch's
    default 10 minutes on a large corpus."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(distributed.torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.torch_dist, "init_process_group", lambda *a, **k: seen.update(k)
    )
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    place, device = distributed.init_distributed("cpu")
    assert place.world_size == 2 and device.type == "cpu"
    assert seen["timeout"] >= timedelta(hours=2)


def test_fp32_on_cuda_allows_tf32() -> None:
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [flag.allow_tf32 for flag in flags]
    try:
        for flag in flags:
            flag.allow_tf32 = False
        allow_tf32(torch.device("cpu"), "fp32")
        allow_tf32(torch.device("cuda"), "bf16")
        assert not flags[0].allow_tf32 and not flags[1].allow_tf32
        allow_tf32(torch.device("cuda"), "fp32")
        assert flags[0].allow_tf32 and flags[1].allow_tf32
    finally:
        for flag, value in zip(flags, before, strict=True):
            flag.allow_tf32 = value


@pytest.mark.parametrize("feeding", [True, False])
def test_an_lstm_trains_under_cpu_bf16_autocast_on_any_cpu(feeding: bool) -> None:
    """oneDNN runs an LSTM under CPU bf16 autocast in bf16, which CPUs without bf16
    instructions cannot: there the plain path runs it outside autocast."""
    import numpy as np

    from nmt.config import from_dict
    from nmt.data.batching import make_batch
    from nmt.model import build_model

    raw = {
        "embedding_size": 8,
        "encoder": {"rnn": "lstm", "hidden_size": 4},
        "decoder": {"style": "luong", "rnn": "lstm", "hidden_size": 8, "input_feeding": feeding},
        "attention": {"score": "dot"},
    }
    torch.manual_seed(0)
    model = build_model(from_dict({"model": raw}).model, 20, 20).train()
    batch = make_batch([[4, 5, 6], [7, 8]], [[9, 10], [11, 12, 13]], np.arange(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model.loss(*batch.tensors(), 0.1)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()  # search: each step through the plain path
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        memory, state = model.encode(batch.src, batch.src_lengths)
        features, _, _ = model.decoder.step(batch.trg_in[:, 0], memory, state)
    assert torch.isfinite(features.float()).all()
