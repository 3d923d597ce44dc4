"""Beam search with its loop on the device (``decoding.device_loop``): every row kept to the
end, nothing read until then. It must give the plain loop's hypotheses: the same tokens,
scores and attention in float64, for every decoder and option it takes, with sentences of
different lengths (padding) that end at different steps, so that the plain loop drops
some; and running on after every sentence is done (a late flag) must change nothing. The
finished store's order among equal scores is checked on its own, and the exhaustive
enumeration of test_search is repeated through this loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from searchref import enumerate_outputs, sequence_log_probs, source

from nmt.config import Config, DecodingConfig, from_dict
from nmt.decoding import captured, search
from nmt.decoding.ensemble import Ensemble, EnsembleState
from nmt.decoding.finished import DoneFlag, Finished
from nmt.decoding.search import beam_search, greedy_search, length_penalty, runs_on_device
from nmt.decoding.steering import Steering, restrictions
from nmt.decoding.translator import Translator
from nmt.model import Seq2Seq, build_model
from nmt.model.decoder import DecoderState
from nmt.vocab import EOS_ID

VOCAB = 12

VARIANTS = {
    "bahdanau": {"decoder": {"style": "bahdanau"}},
    "luong-feed-dot": {"decoder": {"style": "luong"}, "attention": {"score": "dot"}},
    "luong-general": {"decoder": {"style": "luong", "input_feeding": False}},
    "lstm-2-layers": {"rnn": "lstm", "decoder": {"style": "luong", "layers": 2}},
    "coverage-neural": {"attention": {"score": "additive", "coverage": "neural"}},
    "local-p": {"decoder": {"style": "luong"}, "attention": {"score": "local-p", "window": 2}},
}


def _model(variant: str, seed: int) -> Seq2Seq:
    spec = VARIANTS[variant]
    rnn = spec.get("rnn", "gru")
    raw = {
        "embedding_size": 5,
        "encoder": {"rnn": rnn, "hidden_size": 4},
        "decoder": {"rnn": rnn, "hidden_size": 6, **spec.get("decoder", {})},
        "attention": {"score": "general", **spec.get("attention", {})},
    }
    if raw["decoder"].get("style") == "luong" and raw["attention"]["score"] == "dot":
        raw["encoder"]["hidden_size"] = 3  # dot: keys as wide as the decoder's 6
    torch.manual_seed(seed)
    model = build_model(from_dict({"model": raw}).model, VOCAB, VOCAB).double().eval()
    with torch.no_grad():
        model.generator.weight.mul_(3.0)
    return model


def _options(device_loop: bool, **kwargs) -> DecodingConfig:
    defaults = {"beam_size": 4, "max_len_ratio": 1.0, "max_len_offset": 4}
    return DecodingConfig(**{**defaults, **kwargs, "device_loop": device_loop})


def _both(model, src, src_lengths, n_best=1, attention=False, **kwargs):
    plain = beam_search(model, src, src_lengths, _options(False, **kwargs), n_best, attention)
    on_device = beam_search(model, src, src_lengths, _options(True, **kwargs), n_best, attention)
    return plain, on_device


def _assert_same(plain, on_device, attention: bool) -> None:
    assert len(plain) == len(on_device)
    for mine, theirs in zip(plain, on_device, strict=True):
        assert [h.tokens for h in mine] == [h.tokens for h in theirs]
        for a, b in zip(mine, theirs, strict=True):
            assert b.score == pytest.approx(a.score, abs=1e-12)
            assert b.log_prob == pytest.approx(a.log_prob, abs=1e-12)
            if attention:
                assert a.alphas is not None and b.alphas is not None
                assert b.alphas.shape == a.alphas.shape
                # the device loop hands its attention over in host memory, the plain loop
                # on the device it ran on
                torch.testing.assert_close(b.alphas.cpu(), a.alphas.cpu(), atol=1e-12, rtol=0)


def _assert_close(plain, on_device, attention: bool) -> None:
    """The same hypotheses, scores to the float32 log-probabilities' rounding: a batch
    padded to a static shape multiplies in other shapes, which changes the last bits."""
    assert len(plain) == len(on_device)
    for mine, theirs in zip(plain, on_device, strict=True):
        assert [h.tokens for h in mine] == [h.tokens for h in theirs]
        for a, b in zip(mine, theirs, strict=True):
            assert b.score == pytest.approx(a.score, rel=1e-6, abs=1e-9)
            assert b.log_prob == pytest.approx(a.log_prob, rel=1e-6, abs=1e-9)
            if attention:
                assert a.alphas is not None and b.alphas is not None
                assert b.alphas.shape == a.alphas.shape
                torch.testing.assert_close(b.alphas.cpu(), a.alphas.cpu(), atol=1e-6, rtol=0)


LENGTHS = [7, 2, 5, 1, 6, 3, 7, 4, 2, 5, 6, 1]  # 12 sentences: the plain loop drops some


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_device_loop_gives_the_plain_loops_hypotheses(variant: str) -> None:
    model = _model(variant, seed=3)
    src, src_lengths = source(LENGTHS, VOCAB, seed=5)
    plain, on_device = _both(model, src, src_lengths, n_best=3, length_penalty=0.6)
    _assert_same(plain, on_device, attention=False)
    assert any(len(h[0].tokens) != len(plain[0][0].tokens) for h in plain)  # lengths vary


@pytest.mark.parametrize(
    "options",
    [
        {"length_penalty": 0.0},
        {"length_penalty": 1.5, "beam_size": 5},
        {"coverage_penalty": 0.4},
        {"coverage_penalty": 0.4, "length_penalty": 1.0, "beam_size": 2},
        {"max_len_offset": 12, "length_penalty": 0.2},
    ],
    ids=["alpha-0", "alpha-1.5", "coverage", "coverage-beam-2", "long"],
)
def test_penalties_n_best_and_attention_through_the_device_loop(options: dict) -> None:
    model = _model("bahdanau", seed=8)
    src, src_lengths = source(LENGTHS, VOCAB, seed=2)
    n_best = options.get("beam_size", 4)
    plain, on_device = _both(model, src, src_lengths, n_best, True, **options)
    _assert_same(plain, on_device, attention=True)


def test_an_ensemble_over_a_shortlist_through_the_device_loop() -> None:
    members = [_model("bahdanau", seed=1), _model("luong-general", seed=2)]
    src, src_lengths = source(LENGTHS, VOCAB, seed=9)
    columns = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 10])
    allowed = torch.rand(len(LENGTHS), len(columns), generator=torch.Generator().manual_seed(4))
    allowed = (allowed > 0.3) | (columns[None, :] <= EOS_ID)  # EOS always allowed
    ensemble = Ensemble(members, "log_linear").restricted(columns, allowed)
    plain, on_device = _both(ensemble, src, src_lengths, n_best=2)
    _assert_same(plain, on_device, attention=False)


def test_steps_past_the_end_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the host learns late that every sentence is done; a loop that never hears
    it runs to the longest limit and must end with the same hypotheses."""
    model = _model("luong-general", seed=4)  # its sentences end 7 steps before the limit
    src, src_lengths = source(LENGTHS, VOCAB, seed=7)
    options = _options(True, coverage_penalty=0.3, max_len_offset=14)
    prompt = beam_search(model, src, src_lengths, options, 3, True)
    steps: list[int] = []

    def never(self, done: torch.Tensor) -> bool:
        steps.append(int(done.all()))
        return False

    monkeypatch.setattr(DoneFlag, "all_done", never)
    late = beam_search(model, src, src_lengths, options, 3, True)
    assert steps.count(1) >= 3  # several steps ran with every sentence done
    _assert_same(prompt, late, attention=True)


def test_the_exhaustive_beam_through_the_device_loop() -> None:
    """No candidate pruned (K >= 6 * 5^(limit-2) on 6 symbols): every output up to the
    limit, each scored sum(log p) / lp(|y|+1) by the float64 reference, best first."""
    model = _model("bahdanau", seed=11).float()
    vocab = VOCAB
    src, src_lengths = source([3, 1], vocab, seed=1)
    limit, alpha = 3, 0.8
    candidates = enumerate_outputs(vocab, limit - 1)
    beam = len(candidates)
    options = DecodingConfig(
        beam_size=beam,
        length_penalty=alpha,
        max_len_ratio=1e-3,
        max_len_offset=limit - 1,
        device_loop=True,
    )
    results = beam_search(model, src, src_lengths, options, n_best=beam)
    for b, hyps in enumerate(results):
        scores = sequence_log_probs([model], src[b : b + 1, : int(src_lengths[b])], candidates)
        expected = {y: s / length_penalty(len(y) + 1, alpha) for y, s in scores.items()}
        found = {tuple(h.tokens): h.score for h in hyps}
        assert found.keys() == expected.keys()
        for y, score in found.items():
            assert score == pytest.approx(expected[y], abs=1e-4)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_the_finished_store_keeps_the_earlier_of_equal_scores() -> None:
    store = Finished(batch=2, slots=3, width=0, attention=False, device="cpu", longest=2)
    inf = float("-inf")
    first = torch.tensor([[-1.0, inf], [-2.0, -2.0]], dtype=torch.float64)
    store.add(first, first, 2, torch.tensor([[[5, 0]], [[6, 0]]]).expand(2, 2, 2), None)
    second = torch.tensor([[-1.0, -0.5], [-2.0, inf]], dtype=torch.float64)
    store.add(second, second, 3, torch.tensor([[[7, 8]], [[9, 10]]]).expand(2, 2, 2), None)
    assert store.count.tolist() == [3, 3]
    (s0, _, t0, _), (s1, _, t1, _) = store.hypotheses(3)
    assert s0 == [-0.5, -1.0, -1.0] and t0 == [[7, 8], [5], [7, 8]]
    assert s1 == [-2.0, -2.0, -2.0] and t1 == [[6], [6], [9, 10]]


def test_a_dropped_sentence_keeps_its_finished_hypotheses() -> None:
    store = Finished(batch=3, slots=2, width=0, attention=False, device="cpu", longest=2)
    scores = torch.tensor([[-1.0, -3.0], [-2.0, -4.0], [-0.5, -9.0]], dtype=torch.float64)
    tokens = torch.tensor([[[4, 0]], [[5, 0]], [[6, 0]]]).expand(3, 2, 2)
    store.add(scores, scores, 2, tokens, None)
    store.select([0, 2])  # sentence 1 is done
    later = torch.tensor([[-0.125, float("-inf")], [float("-inf"), float("-inf")]]).double()
    store.add(later, later, 3, torch.tensor([[[7, 8]], [[9, 9]]]).expand(2, 2, 2), None)
    rows = store.hypotheses(2)
    assert [r[0] for r in rows] == [[-0.125, -1.0], [-2.0, -4.0], [-0.5, -9.0]]
    assert [r[2] for r in rows] == [[[7, 8], [4]], [[5], [5]], [[6], [6]]]


def test_when_the_loop_stays_on_the_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not runs_on_device(DecodingConfig(), cpu, None)
    assert runs_on_device(DecodingConfig(), cuda, None)
    assert runs_on_device(DecodingConfig(device_loop=True), cpu, None)
    assert not runs_on_device(DecodingConfig(device_loop=False), cuda, None)
    assert not runs_on_device(DecodingConfig(), cuda, Steering([[4]]))  # read every step
    assert not runs_on_device(DecodingConfig(no_repeat_ngram=2), cuda, None)
    assert not runs_on_device(DecodingConfig(), cuda, Steering(None, [[]]))  # lists read
    # asked of the restrictions, in the order they apply: only EOS at the limit needs no host
    bans = restrictions(DecodingConfig(no_repeat_ngram=2), Steering([[4]], [[[5]]]))
    assert [ban.host for ban in bans] == [True, True, False, True]


def test_the_device_loop_reads_nothing_until_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain loop reads which sentences are done at every step; the device loop reads
    only the limits before its first step and its flag (DoneFlag, which on a GPU does not
    wait), until the results are collected."""
    model = _model("bahdanau", seed=4)
    src, src_lengths = source(LENGTHS, VOCAB, seed=3)
    reads: list[str] = []
    in_loop: list[int] = []
    for name in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, _original=original, _name=name):
            reads.append(_name)
            return _original(self)

        monkeypatch.setattr(torch.Tensor, name, counted)
    collect = Finished.hypotheses

    def collected(self, n_best):
        in_loop.append(len(reads))
        return collect(self, n_best)

    monkeypatch.setattr(Finished, "hypotheses", collected)
    monkeypatch.setattr(DoneFlag, "all_done", lambda self, done: False)  # a GPU's late flag
    beam_search(model, src, src_lengths, _options(True), 2)
    beam_search(model, src, src_lengths, _options(False), 2)
    device_reads, plain_reads = in_loop[0], in_loop[1] - len(reads[: in_loop[0]])
    assert device_reads == 1  # search_limits
    assert plain_reads > 10  # at least one a step


def _carried_tensors(inputs: Any) -> list[torch.Tensor]:
    """Every tensor a step reads and writes, the state's included (memory aside)."""
    out = []
    fields = (*vars(inputs).values(), *vars(inputs.beams).values())
    for value in (*fields, *vars(inputs.finished).values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
    for member in inputs.state.states:
        out += [v for v in vars(member).values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_after_the_first_steps_a_step_replaces_nothing(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CUDA graph's capture needs, on a CPU: after the eager steps, every step
    (``strict``: a replacement is an error) writes into the same tensors at the same
    addresses, and the search still gives the plain loop's hypotheses."""
    addresses: list[list[int]] = []
    beam_step = search._beam_step

    def noted(scorer, inputs, bans, in_place=False, strict=False):  # each strict step's
        beam_step(scorer, inputs, bans, in_place, strict)  # tensors' addresses
        if strict:
            addresses.append([t.data_ptr() for t in _carried_tensors(inputs)])

    def emulated(step):  # the capture's warm-up, then "replays" that replace nothing
        step()
        return lambda: step(strict=True)

    monkeypatch.setattr(search, "_beam_step", noted)
    monkeypatch.setattr(captured, "captures", lambda decoding, device: True)
    # the batch as it is, for the plain loop's float64 results to the bit (the static
    # shapes that captured steps take are tested below)
    monkeypatch.setattr(captured, "static_shapes", lambda graphs, scorer: False)
    monkeypatch.setattr(captured, "capture", emulated)
    model = _model(variant, seed=3)
    src, src_lengths = source(LENGTHS, VOCAB, seed=5)
    plain, on_device = _both(model, src, src_lengths, 3, True, coverage_penalty=0.3)
    _assert_same(plain, on_device, attention=True)
    assert len(addresses) >= 3 and all(a == addresses[0] for a in addresses)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_through_the_device_loop(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy search in fixed shapes gives plain greedy's hypotheses in float64 (attention
    and a coverage penalty too); after its first two steps a step replaces nothing."""
    model = _model(variant, seed=7)
    src, src_lengths = source(LENGTHS, VOCAB, seed=8)
    options = {"beam_size": 1, "coverage_penalty": 0.3, "max_len_offset": 6}
    plain = greedy_search(model, src, src_lengths, _options(False, **options), True)
    strict: list[bool] = []

    def emulated(step):
        step()
        return lambda: (step(strict=True), strict.append(True))

    monkeypatch.setattr(captured, "captures", lambda decoding, device: True)
    monkeypatch.setattr(captured, "static_shapes", lambda graphs, scorer: False)
    monkeypatch.setattr(captured, "capture", emulated)
    on_device = greedy_search(model, src, src_lengths, _options(True, **options), True)
    _assert_same([[h] for h in plain], [[h] for h in on_device], attention=True)
    assert len(strict) >= 3


def test_a_strict_step_refuses_to_replace_a_tensor() -> None:
    state = EnsembleState([], [DecoderState(torch.zeros(1, 2, 3))], None)
    grown = EnsembleState([], [DecoderState(torch.ones(1, 2, 3), coverage=torch.ones(2, 4))])
    with pytest.raises(ValueError, match="would replace a NoneType"):
        captured.write_back(state, grown, strict=True)
    captured.write_back(state, grown)  # an eager step may
    assert state.states[0].coverage is not None and torch.equal(
        state.states[0].hidden, grown.states[0].hidden
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["bahdanau", "luong-feed-dot", "coverage-neural", "local-p"])
def test_the_device_loop_on_cuda(variant: str, caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU, where the flag arrives late, with the step captured as a CUDA graph and
    without: the plain loop's hypotheses in float64, attention and a coverage penalty too,
    beam search and greedy; and no capture fell back."""
    model = _model(variant, seed=3).cuda()
    src, src_lengths = source(LENGTHS, VOCAB, seed=5)
    src, src_lengths = src.cuda(), src_lengths.cuda()
    options = {"coverage_penalty": 0.2, "max_len_offset": 9}
    plain = beam_search(model, src, src_lengths, _options(False, **options), 3, True)
    for graphs in (False, True):  # with graphs, a static batch: the same to rounding
        config = _options(True, cuda_graphs=graphs, **options)
        same = _assert_close if graphs else _assert_same
        same(plain, beam_search(model, src, src_lengths, config, 3, True), True)
    greedy = {**options, "beam_size": 1}
    first = greedy_search(model, src, src_lengths, _options(False, **greedy), True)
    for graphs in (False, True):
        config = _options(True, cuda_graphs=graphs, **greedy)
        found = greedy_search(model, src, src_lengths, config, True)
        same = _assert_close if graphs else _assert_same
        same([[h] for h in first], [[h] for h in found], True)
    assert "could not be captured" not in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_captured_step_under_bf16_autocast() -> None:
    """As a translator decodes on a GPU (bf16 autocast): the captured step's outputs equal
    the uncaptured step's (the same kernels, replayed)."""
    model = _model("luong-general", seed=4).float().cuda()
    src, src_lengths = source(LENGTHS * 4, VOCAB, seed=6)
    src, src_lengths = src.cuda(), src_lengths.cuda()
    found = {}
    for graphs in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            config = _options(True, cuda_graphs=graphs, beam_size=5)
            found[graphs] = beam_search(model, src, src_lengths, config, 2)
    for eager, replayed in zip(found[False], found[True], strict=True):
        assert [h.tokens for h in eager] == [h.tokens for h in replayed]
        assert [h.score for h in eager] == pytest.approx([h.score for h in replayed], abs=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_loop_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's sync debug mode raises on any operation that waits for the GPU: the device
    loop's steps and flags (beam search and greedy, without graphs, whose capture itself
    synchronises) raise nothing."""
    run = captured.run_steps

    def checked(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(captured, "run_steps", checked)
    model = _model("luong-feed-dot", seed=2).cuda()
    src, src_lengths = source(LENGTHS, VOCAB, seed=4)
    src, src_lengths = src.cuda(), src_lengths.cuda()
    for beam in (4, 1):
        config = _options(True, beam_size=beam, cuda_graphs=False, coverage_penalty=0.2)
        beam_search(model, src, src_lengths, config, 1, True)


# --- captured steps kept for later batches, on a CPU: the capture emulated as above, its
# "replay" the capturing batch's own step over the inputs it was captured with


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Static batches and kept steps as on a GPU; -> the number of captures, as they come."""
    captures: list[int] = []

    def emulated(step):
        step()
        captures.append(1)
        return lambda: step(strict=True)

    monkeypatch.setattr(captured, "captures", lambda decoding, device: True)
    monkeypatch.setattr(captured, "capture", emulated)
    monkeypatch.setattr(captured, "_THREAD", threading.local())
    return captures


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches: two of one length class (32) with different lengths and sizes, then a
    longer one (a source of 40: class 64)."""
    return [
        source([7, 2, 5, 1, 6, 3], VOCAB, seed=5),
        source([4, 9, 2, 3], VOCAB, seed=6),
        source([40, 3, 11], VOCAB, seed=7),
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_later_batches_replay_a_kept_step(variant: str, kept: list[int]) -> None:
    """A batch of a length class met before copies its tensors into the kept step's and
    replays it: the plain loop's hypotheses for every batch (n-best, attention, a coverage
    penalty), an earlier batch's results untouched by the later ones, and one capture per
    static shape."""
    model = _model(variant, seed=3)
    options = {"coverage_penalty": 0.3, "max_len_offset": 5, "batch_size": 8}
    results, wanted = [], []
    for src, src_lengths in _batches():
        wanted.append(beam_search(model, src, src_lengths, _options(False, **options), 3, True))
        results.append(beam_search(model, src, src_lengths, _options(True, **options), 3, True))
        assert len(results[-1]) == src.size(0)  # the padding sentences dropped
    for plain, found in zip(wanted, results, strict=True):
        _assert_close(plain, found, attention=True)
    assert len(kept) == 2  # the second batch replayed the first one's step
    assert len(captured.kept_graphs()) == 2


@pytest.mark.parametrize("variant", ["bahdanau", "luong-general", "coverage-neural"])
def test_greedy_batches_replay_a_kept_step(variant: str, kept: list[int]) -> None:
    model = _model(variant, seed=7)
    options = {"beam_size": 1, "coverage_penalty": 0.3, "max_len_offset": 6, "batch_size": 8}
    results, wanted = [], []
    for src, src_lengths in _batches():
        wanted.append(greedy_search(model, src, src_lengths, _options(False, **options), True))
        results.append(greedy_search(model, src, src_lengths, _options(True, **options), True))
    for plain, found in zip(wanted, results, strict=True):
        _assert_close([[h] for h in plain], [[h] for h in found], attention=True)
    assert len(kept) == 2


def test_a_step_is_kept_per_model_and_setting(kept: list[int]) -> None:
    """Another model's weights, another beam size or a shortlist's own output layer is a
    step of its own; the least recently used goes beyond GRAPH_CACHE."""
    first, second = _model("bahdanau", seed=1), _model("bahdanau", seed=2)
    src, src_lengths = _batches()[0]
    for model in (first, second, first):
        beam_search(model, src, src_lengths, _options(True, batch_size=8), 2)
    assert len(kept) == 2  # the first model's step kept while the second's was captured
    beam_search(first, src, src_lengths, _options(True, batch_size=8, beam_size=3), 2)
    assert len(kept) == 3
    columns = torch.tensor([0, 1, 2, 3, 4, 6, 7, 9, 10])
    allowed = torch.ones(src.size(0), len(columns), dtype=torch.bool)
    restricted = Ensemble([first]).restricted(columns, allowed)
    for _ in range(2):
        beam_search(restricted, src, src_lengths, _options(True, batch_size=8), 2)
    assert len(kept) == 5 and len(captured.kept_graphs()) == 3  # captured each time, not kept
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(captured, "GRAPH_CACHE", 1)
        beam_search(second, src, src_lengths, _options(True, batch_size=8), 2)  # kept: a hit
        assert len(kept) == 5 and len(captured.kept_graphs()) == 3
        beam_search(first, src, src_lengths, _options(True, batch_size=16), 2)  # new: 32 rows
        assert len(kept) == 6 and len(captured.kept_graphs()) == 1


def test_each_thread_keeps_its_own_steps(kept: list[int]) -> None:
    """A search on another thread (a decoding worker on a GPU, nmt serve's decode thread)
    keeps its steps apart from this thread's, so that no two write into one step's
    tensors; each thread replays its own."""
    model = _model("bahdanau", seed=1)
    src, src_lengths = _batches()[0]
    found: list[Any] = []

    def search() -> None:
        for _ in range(2):
            found.append(beam_search(model, src, src_lengths, _options(True, batch_size=8), 2))
        found.append(len(captured.kept_graphs()))

    thread = threading.Thread(target=search)
    thread.start()
    thread.join()
    assert len(kept) == 1 and found[-1] == 1 and not captured.kept_graphs()
    beam_search(model, src, src_lengths, _options(True, batch_size=8), 2)  # this thread's own
    assert len(kept) == 2 and len(captured.kept_graphs()) == 1
    plain = beam_search(model, src, src_lengths, _options(False, batch_size=8), 2)
    for hypotheses in found[:2]:
        _assert_close(plain, hypotheses, attention=False)


def test_a_static_batch() -> None:
    src, src_lengths = source([7, 2, 5], VOCAB, seed=5)
    decoding = _options(True, batch_size=5)
    padded, lengths, limits, length = captured.static_batch(src, src_lengths, [9, 4, 7], decoding)
    assert padded.shape == (5, 32) and torch.equal(padded[:3, :7], src)
    assert padded[3:, 0].tolist() == [EOS_ID, EOS_ID] and not padded[:, 7:].any()
    assert lengths.tolist() == [7, 2, 5, 1, 1] and limits == [9, 4, 7, 1, 1] and length == 32
    classes = [captured.length_class(n) for n in (1, 32, 33, 100, 512, 513)]
    assert classes == [32, 32, 64, 128, 512, 768]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["bahdanau", "luong-feed-dot", "coverage-neural"])
def test_kept_cuda_graphs_serve_later_batches(
    variant: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU, real captures: three batches, two of one static shape, beam search and
    greedy; each batch gets the plain loop's hypotheses, and two steps are kept for each
    search."""
    monkeypatch.setattr(captured, "_THREAD", threading.local())
    model = _model(variant, seed=3).cuda()
    options = {"coverage_penalty": 0.2, "max_len_offset": 5, "batch_size": 8}
    for beam, n_best in ((4, 3), (1, 1)):
        settings = {**options, "beam_size": beam}
        for src, src_lengths in _batches():
            src, src_lengths = src.cuda(), src_lengths.cuda()
            plain = beam_search(model, src, src_lengths, _options(False, **settings), n_best, True)
            found = beam_search(model, src, src_lengths, _options(True, **settings), n_best, True)
            _assert_close(plain, found, attention=True)
    assert len(captured.kept_graphs()) == 4
    assert "could not be captured" not in caplog.text


def test_workers_side_by_side_keep_their_own_steps(kept: list[int]) -> None:
    """``decoding.workers`` threads (on a GPU, each on its own stream) each keep and replay
    their own steps: the translations of one worker, and of the plain loop."""
    model = _model("luong-general", seed=2)
    translator = Translator(model, None, Config(), torch.device("cpu"))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 12, (24,), generator=generator).tolist()
    ids = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    options = {"beam_size": 3, "batch_size": 4, "max_len_offset": 4}
    side_by_side = translator.decode_ids(ids, _options(True, workers=2, **options))
    assert 1 <= len(kept) <= 2 and not captured.kept_graphs()  # the workers' own, gone
    plain = translator.decode_ids(ids, _options(False, workers=1, **options))
    _assert_close(plain, side_by_side, attention=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_workers_decode_side_by_side(caplog: pytest.LogCaptureFixture) -> None:
    """Two workers on a GPU, each on its own CUDA stream with its own kept steps (captured
    while the other replays): the translations of one worker."""
    model = _model("bahdanau", seed=2).cuda()
    translator = Translator(model, None, Config(), torch.device("cuda"))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 40, (48,), generator=generator).tolist()
    ids = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    for beam in (4, 1):
        options = {"beam_size": beam, "batch_size": 8, "max_len_offset": 4}
        one = translator.decode_ids(ids, _options(True, workers=1, **options))
        two = translator.decode_ids(ids, _options(True, workers=2, **options))
        _assert_close(one, two, attention=False)
    assert "could not be captured" not in caplog.text
