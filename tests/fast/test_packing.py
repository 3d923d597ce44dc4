"""The encoder's packed sequence on a GPU (``fast.recurrence.unwaited_pack``), made without
waiting for it: the same PackedSequence as ``pack_padded_sequence(..., enforce_sorted=False)``
and, through it, the same outputs and final states of a 2-layer bidirectional GRU and LSTM,
checked on a CPU; its unpacking (``unwaited_unpack``), which restores the batch's order on
the device, gives ``pad_packed_sequence``'s outputs; on a GPU the same outputs with lengths on the host (as training keeps
them) or beside the inputs, the host's never waiting. The unpacked GRU of a captured training
step (``unpacked_rnn``: lengths on the device, each direction over the padded rows, the
backward one over each row reversed within its length) against the packed module, in
float64: outputs, final states and every gradient; on a GPU without a host sync."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from nmt.fast.recurrence import plain_rnn, reversal, unpacked_rnn, unwaited_pack, unwaited_unpack


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


def test_a_reversal_flips_each_row_within_its_length_and_is_its_own_inverse() -> None:
    order = reversal(torch.tensor([3, 1, 5, 4]), 5)
    assert order.tolist() == [[2, 1, 0, 3, 4], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 2, 1, 0, 4]]
    assert torch.equal(order.gather(1, order), torch.arange(5).expand(4, 5))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("given_state", [False, True])
def test_the_unpacked_gru_is_the_packed_module_with_its_gradients(
    bidirectional: bool, layers: int, given_state: bool
) -> None:
    torch.manual_seed(2)
    rnn = nn.GRU(5, 4, batch_first=True, bidirectional=bidirectional, num_layers=layers).double()
    lengths = [4, 7, 1, 7, 3]
    inputs = torch.cat([_inputs(lengths), torch.randn(5, 2, 5, dtype=torch.float64)], dim=1)
    inputs.requires_grad_(True)  # padding past every row's end, not zeros: it must not count
    directions = 2 if bidirectional else 1
    state = None
    if given_state:
        state = torch.randn(layers * directions, 5, 4, dtype=torch.float64, requires_grad=True)
    want_out, want_final = plain_rnn(rnn, inputs, torch.tensor(lengths), state)
    got_out, got_final = unpacked_rnn(rnn, inputs, torch.tensor(lengths), state, training=True)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_final, want_final, rtol=1e-12, atol=1e-13)
    assert not got_out[2, 1:].any()  # zero past each end (a sentence of one token)
    weights = torch.randn_like(want_out)
    leaves = [inputs, *rnn.parameters(), *([state] if state is not None else [])]
    want = torch.autograd.grad((want_out * weights).sum() + want_final.sin().sum(), leaves)
    got = torch.autograd.grad((got_out * weights).sum() + got_final.sin().sum(), leaves)
    for number, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"leaf {number}")
    assert not got[0][:, 7:].any()  # the padding's inputs get no gradient


def test_the_unpacked_path_refuses_an_lstm() -> None:
    rnn = nn.LSTM(5, 4, batch_first=True)
    with pytest.raises(ValueError, match="final cell"):
        unpacked_rnn(rnn, torch.zeros(2, 3, 5), torch.tensor([3, 1]), None, training=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_unpacked_gru_is_the_packed_one_and_never_waits() -> None:
    torch.manual_seed(0)
    rnn = nn.GRU(5, 4, batch_first=True, bidirectional=True, num_layers=2).double().cuda()
    lengths = [4, 7, 1, 7, 3]
    inputs = _inputs(lengths, "cuda")
    want_out, want_final = plain_rnn(rnn, inputs, torch.tensor(lengths), None)
    on_device = torch.tensor(lengths, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_out, got_final = unpacked_rnn(rnn, inputs, on_device, None, training=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_final, want_final, rtol=1e-12, atol=1e-13)
