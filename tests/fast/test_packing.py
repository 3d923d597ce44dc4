"""The encoder's packed sequence on a GPU (``fast.recurrence.unwaited_pack``), made without
waiting for it: the same PackedSequence as ``pack_padded_sequence(..., enforce_sorted=False)``
and, through it, the same outputs and final states of a 2-layer bidirectional GRU and LSTM,
checked on a CPU; its unpacking (``unwaited_unpack``), which restores the batch's order on
the device, gives ``pad_packed_sequence``'s outputs; on a GPU the same outputs with lengths on the host (as training keeps
them) or beside the inputs, the host's never waiting."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.fast.recurrence import plain_rnn, unwaited_pack, unwaited_unpack


def _inputs(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(len(lengths))
    inputs = torch.randn(len(lengths), max(lengths), 5, generator=generator, dtype=torch.float64)
    for row, length in enumerate(lengths):
        inputs[row, length:] = 0.0
    return inputs.to(device)


@pytest.mark.parametrize("lengths", [[4, 7, 1, 7, 3], [2], [5, 5, 5], [1, 2, 3, 4, 5, 6]])
def test_the_same_packed_sequence_as_torchs(lengths: list[int]) -> None:
    inputs = _inputs(lengths)
    want = pack_padded_sequence(
        inputs, torch.tensor(lengths), batch_first=True, enforce_sorted=False
    )
    got = unwaited_pack(inputs, torch.tensor(lengths))
    assert torch.equal(got.data, want.data)
    assert torch.equal(got.batch_sizes, want.batch_sizes)
    assert torch.equal(got.sorted_indices, want.sorted_indices)
    assert torch.equal(got.unsorted_indices, want.unsorted_indices)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_rnn_over_it_gives_torchs_outputs_and_final_states(kind: type[nn.RNNBase]) -> None:
    torch.manual_seed(0)
    rnn = kind(5, 4, batch_first=True, bidirectional=True, num_layers=2).double()
    lengths = [4, 7, 1, 7, 3]
    inputs = _inputs(lengths)
    packed = pack_padded_sequence(inputs, torch.tensor(lengths), True, enforce_sorted=False)
    out, final = rnn(packed)
    want, _ = pad_packed_sequence(out, batch_first=True, total_length=inputs.size(1))
    got_out, got_final = rnn(unwaited_pack(inputs, torch.tensor(lengths)))
    got, _ = pad_packed_sequence(got_out, batch_first=True, total_length=inputs.size(1))
    assert torch.equal(got, want)
    finals = (final, got_final) if kind is nn.GRU else (final[0], got_final[0])
    assert torch.equal(finals[0], finals[1])
    if kind is nn.LSTM:
        assert torch.equal(final[1], got_final[1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
@pytest.mark.parametrize("lengths", [[4, 7, 1, 7, 3], [2], [1, 2, 3, 4, 5, 6]])
@pytest.mark.parametrize("extra", [0, 3])
def test_the_unpacked_outputs_are_torchs(
    kind: type[nn.RNNBase], lengths: list[int], extra: int
) -> None:
    torch.manual_seed(1)
    rnn = kind(5, 4, batch_first=True, bidirectional=True).double()
    inputs = _inputs(lengths)
    total = inputs.size(1) + extra  # padded past the longest, as a batch's bucket may be
    for packed in (
        pack_padded_sequence(inputs, torch.tensor(lengths), True, enforce_sorted=False),
        unwaited_pack(inputs, torch.tensor(lengths)),
    ):
        out, _ = rnn(packed)
        want, _ = pad_packed_sequence(out, batch_first=True, total_length=total)
        assert torch.equal(unwaited_unpack(out, total), want)
    ordered = pack_padded_sequence(inputs[:1], torch.tensor(lengths[:1]), True)  # no indices
    out, _ = rnn(ordered)
    want, _ = pad_packed_sequence(out, batch_first=True, total_length=total)
    assert torch.equal(unwaited_unpack(out, total), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_same_outputs_with_host_or_device_lengths() -> None:
    torch.manual_seed(0)
    rnn = nn.GRU(5, 4, batch_first=True, bidirectional=True).double().cuda()
    lengths = [4, 7, 1, 7, 3]
    inputs = _inputs(lengths, "cuda")
    on_host, _ = plain_rnn(rnn, inputs, torch.tensor(lengths), None)
    on_device, _ = plain_rnn(rnn, inputs, torch.tensor(lengths, device="cuda"), None)
    assert torch.equal(on_host, on_device)
    with torch.cuda.device(0):
        torch.cuda.set_sync_debug_mode("error")
        try:
            plain_rnn(rnn, inputs, torch.tensor(lengths), None)  # host lengths: no wait
        finally:
            torch.cuda.set_sync_debug_mode(0)
