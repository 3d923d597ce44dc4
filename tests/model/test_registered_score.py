"""A new score function is two files, its class and its test: this module defines one, a cosine
of the projected query and the key with a learned temperature, registers it (for this module
alone: the fixture takes it out again, so the registry, the config and docs/config.md of other
tests are the shipped ones), and the config takes its name without a schema edit. A tiny
Luong model with it learns to reverse sequences on the CPU; then greedy and beam search on
every path (the plain loop and the fixed-shape device loop, the compiled kernels on and off),
forced scoring and the ONNX export under onnxruntime each give the log-probabilities and the
attention of a float64 reference that computes the score from its equation, sentence by
sentence without padding, where the batch has padding."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.config import Config, DecodingConfig, from_dict
from nmt.data.batching import make_batch, pad
from nmt.data.tokenizer import Tokenizer, train_sentencepiece
from nmt.decoding.ensemble import Ensemble, StepTables
from nmt.decoding.exported import load_exported
from nmt.decoding.onnx import export_onnx
from nmt.decoding.scoring import score_batch
from nmt.decoding.search import Hypothesis, beam_search, greedy_search
from nmt.errors import ConfigError
from nmt.fast import FastPaths
from nmt.model import Seq2Seq, build_model
from nmt.model.attention import SCORES, Attention, Memory, masked_softmax, register_score
from nmt.vocab import BOS_ID, EOS_ID

NAME = "tempered_cosine"
SYMBOLS = range(4, 14)  # the reversal task's ten symbols


class TemperedCosine(Attention):
    """e = exp(tau) cos(W q, k): the cosine of the projected query W q and the key k, sharpened
    by a learned temperature exp(tau), tau initialised to log 5."""

    content = shares_beams = True

    def __init__(self, query_size: int, key_size: int):
        super().__init__(query_size, key_size)
        self.query_proj = nn.Linear(query_size, key_size, bias=False)  # W
        self.log_temperature = nn.Parameter(torch.tensor(math.log(5.0)))  # tau

    def project_keys(self, values: Tensor) -> Tensor:
        return values / values.norm(dim=-1, keepdim=True).clamp(min=1e-6)  # (B, S, Hk)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        q = self.query_proj(query)  # (B, T, Hk)
        q = q / q.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        return self.log_temperature.exp() * memory.with_keys(q)  # (B, T, S)


class Equation(Attention):
    """The reference, in float64: a_t(s) = softmax_s(exp(tau) (W q_t)^T h_s / (|W q_t| |h_s|))
    from the encoder states h_s themselves."""

    def __init__(self, score: TemperedCosine):
        super().__init__(score.query_size, score.key_size)
        self.w = score.query_proj.weight.detach().double()  # (Hk, Hq)
        self.tau = float(score.log_temperature.detach())

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        q = query.double() @ self.w.T  # (B, T, Hk)
        h = memory.values.double()  # (B, S, Hk)
        cosines = torch.einsum("btk,bsk->bts", q, h)
        cosines = cosines / (q.norm(dim=-1)[:, :, None] * h.norm(dim=-1)[:, None, :])
        return masked_softmax(math.exp(self.tau) * cosines, memory.mask)


def _section() -> dict[str, object]:
    return {
        "embedding_size": 16,
        "embedding_dropout": 0.0,
        "encoder": {"hidden_size": 16, "dropout": 0.0},
        "decoder": {"style": "luong", "hidden_size": 24, "dropout": 0.0},
        "attention": {"score": NAME},
    }


@contextmanager
def _registration() -> Iterator[str]:
    register_score(NAME)(TemperedCosine)
    try:
        yield NAME
    finally:
        del SCORES[NAME]


@pytest.fixture
def registered() -> Iterator[str]:
    """The score registered for one test, and taken out after it."""
    with _registration() as name:
        yield name


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A tokenizer for the export to carry (the model is trained on ids)."""
    words = ["sol luna mar", "rio casa perro", "gato libro agua", "fuego tierra aire"]
    proto = train_sentencepiece(words * 50, 40, "bpe", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def _reversal(rng: np.random.Generator, size: int) -> tuple[list[list[int]], list[list[int]]]:
    sources = [rng.choice(SYMBOLS, size=rng.integers(2, 7)).tolist() for _ in range(size)]
    return sources, [s[::-1] for s in sources]


@pytest.fixture(scope="module")
def trained(tokenizer: Tokenizer) -> tuple[Seq2Seq, Config]:
    """The tiny model with the registered score, trained to reverse."""
    vocab = tokenizer.src_vocab_size
    with _registration():
        config = from_dict({"model": _section()})
        torch.manual_seed(0)
        model = build_model(config.model, vocab, vocab)
    assert isinstance(model.decoder.attention, TemperedCosine)
    rng = np.random.default_rng(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):
        src, trg = _reversal(rng, 32)
        batch = make_batch([[*s, EOS_ID] for s in src], trg, np.arange(len(src)))
        loss, _ = model.loss(*batch.tensors())
        optimizer.zero_grad()
        (loss / batch.n_target_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model.eval(), config


SOURCES = [[4, 9, 5, 11, 6, 7], [7, 8], [12, 4, 13], [10, 11, 12, 5, 6]]


def _batch() -> tuple[Tensor, Tensor]:
    return pad([[*s, EOS_ID] for s in SOURCES]), torch.tensor([len(s) + 1 for s in SOURCES])


def _reference(model: Seq2Seq) -> Seq2Seq:
    """The model in float64, attending by ``Equation``."""
    wide = copy.deepcopy(model).double()
    score = wide.decoder.attention
    assert isinstance(score, TemperedCosine)
    wide.decoder.attention = Equation(score)
    return wide


@torch.no_grad()
def _forced(reference: Seq2Seq, b: int, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """Sentence b alone (no padding), read with ``tokens`` then EOS: float64 log-probabilities
    (n+1, V) and attention (n+1, S_b)."""
    src = torch.tensor([[*SOURCES[b], EOS_ID]])
    features, alphas = reference(
        src, torch.tensor([src.size(1)]), torch.tensor([[BOS_ID, *tokens]])
    )
    return F.log_softmax(reference.generator(features[0]).double(), dim=-1), alphas[0]


def _check(reference: Seq2Seq, b: int, hyp: Hypothesis, greedy: bool) -> None:
    """A hypothesis's log-probability and attention are the reference's; greedy's tokens
    are the reference's argmax at every step."""
    log_probs, alphas = _forced(reference, b, hyp.tokens)
    gold = torch.tensor([*hyp.tokens, EOS_ID])
    picked = log_probs.gather(1, gold[:, None]).squeeze(1)  # (n+1,)
    assert hyp.log_prob == pytest.approx(float(picked.sum()), abs=1e-4)
    assert hyp.score == pytest.approx(hyp.log_prob, abs=1e-6)  # no length penalty
    if greedy:
        assert bool((picked >= log_probs.max(dim=1).values - 1e-5).all())
    assert hyp.alphas is not None
    length = len(SOURCES[b]) + 1
    torch.testing.assert_close(hyp.alphas[:, :length].double(), alphas, atol=2e-5, rtol=1e-4)
    assert bool((hyp.alphas[:, length:] == 0).all())  # the batch's padding


def _tables(model: Seq2Seq) -> StepTables:
    """The tables a Translator makes for a CPU search in float32."""
    return StepTables(
        model.decoder.gate_table(),
        model.fast.product(model.generator.weight),
        model.decoder.search_products(),
        model.encoder.gate_table(),
    )


def _stepper(model: Seq2Seq, config: Config, kernels: bool) -> Ensemble:
    """The trained model as a search steps it: with nmt's compiled kernels and the
    Translator's tables, or plain PyTorch."""
    fast = FastPaths() if kernels else FastPaths.plain()
    vocab = model.generator.weight.size(0)
    copied = build_model(config.model, vocab, vocab, fast)
    copied.load_state_dict(model.state_dict())
    copied.eval()
    return Ensemble([copied], tables=[_tables(copied)] if kernels else None)


def test_the_config_takes_a_registered_name_and_names_the_registered_ones(
    registered: str,
) -> None:
    assert from_dict({"model": _section()}).model.attention.score == registered
    with pytest.raises(ConfigError) as error:
        from_dict({"model": {"attention": {"score": "tempered"}}})
    message = str(error.value)
    assert "\n" not in message
    assert "model.attention.score: got 'tempered', expected one of additive," in message
    assert message.split("expected one of ")[1].split(", ")[-1].startswith(NAME)


def test_it_learns_to_reverse(trained: tuple[Seq2Seq, Config]) -> None:
    model, _ = trained
    sources, targets = _reversal(np.random.default_rng(123), 100)
    src = pad([[*s, EOS_ID] for s in sources])
    lengths = torch.tensor([len(s) + 1 for s in sources])
    found = greedy_search(model, src, lengths, DecodingConfig(beam_size=1))
    right = sum(h.tokens == t for h, t in zip(found, targets, strict=True))
    assert right >= 90, f"greedy exact match {right}/100"


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "plain"])
@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop"])
@pytest.mark.parametrize("beam_size", [1, 3], ids=["greedy", "beam"])
def test_every_search_path_gives_the_references_probabilities_and_attention(
    trained: tuple[Seq2Seq, Config],
    registered: str,
    kernels: bool,
    device_loop: bool,
    beam_size: int,
) -> None:
    model, config = trained
    reference = _reference(model)
    scorer = _stepper(model, config, kernels)
    src, lengths = _batch()
    decoding = DecodingConfig(beam_size=beam_size, length_penalty=0.0, device_loop=device_loop)
    n_best = 1 if beam_size == 1 else 2
    found = beam_search(scorer, src, lengths, decoding, n_best=n_best, return_attention=True)
    for b, hyps in enumerate(found):
        assert len(hyps) == n_best
        assert hyps[0].tokens == SOURCES[b][::-1]
        for hyp in hyps:
            _check(reference, b, hyp, greedy=beam_size == 1)


def test_forced_scoring_gives_the_references_probabilities_and_attention(
    trained: tuple[Seq2Seq, Config], registered: str
) -> None:
    """Targets of other lengths than the outputs (padding on both sides)."""
    model, config = trained
    reference = _reference(model)
    targets = [s[::-1] for s in SOURCES]
    targets[1] = [8, 7, 8, 7, 9]
    src, lengths = _batch()
    decoding = DecodingConfig(length_penalty=0.0)
    for kernels in (True, False):
        scorer = _stepper(model, config, kernels)
        scored = score_batch(scorer, src, lengths, targets, decoding, return_attention=True)
        for b, (result, target) in enumerate(zip(scored, targets, strict=True)):
            log_probs, alphas = _forced(reference, b, target)
            want = log_probs.gather(1, torch.tensor([*target, EOS_ID])[:, None]).squeeze(1)
            assert result.token_log_probs == pytest.approx(want.tolist(), abs=1e-5)
            assert result.alphas is not None
            torch.testing.assert_close(result.alphas.double(), alphas, atol=2e-5, rtol=1e-4)


def test_the_onnx_export_gives_the_references_probabilities_and_attention(
    trained: tuple[Seq2Seq, Config], registered: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Exported (the export checks its graphs against the model), read back under
    onnxruntime, and searched greedily and by beam."""
    model, config = trained
    export_onnx(model, tokenizer, config, tmp_path, "trained here")
    graphs = load_exported(tmp_path).model
    reference = _reference(model)
    src, lengths = _batch()
    for beam_size in (1, 3):
        decoding = DecodingConfig(beam_size=beam_size, length_penalty=0.0)
        found = beam_search(graphs, src, lengths, decoding, return_attention=True)
        for b, hyps in enumerate(found):
            assert hyps[0].tokens == SOURCES[b][::-1]
            _check(reference, b, hyps[0], greedy=beam_size == 1)


def test_the_registration_ends_with_its_test(trained: tuple[Seq2Seq, Config]) -> None:
    """Outside the fixture (even after the module trained its model with the score) the
    registry holds the shipped names alone, and the config refuses the name."""
    assert NAME not in SCORES
    with pytest.raises(ConfigError, match=f"got '{NAME}', expected one of additive"):
        from_dict({"model": _section()})
