"""Small random models and float64 references for the decoding tests: teacher-forced
log-probabilities of given outputs under one model or an ensemble (written from the
definitions, not through nmt.decoding), exhaustive output lists and the length limit."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from nmt.config import DecodingConfig, ModelConfig, from_dict
from nmt.data.batching import pad
from nmt.data.tokenizer import BOS_ID, EOS_ID
from nmt.model import Seq2Seq, build_model


def config(style: str = "bahdanau", rnn: str = "gru", input_feeding: bool = True) -> ModelConfig:
    raw = {
        "embedding_size": 5,
        "encoder": {"rnn": rnn, "hidden_size": 4},
        "decoder": {"style": style, "rnn": rnn, "hidden_size": 6, "input_feeding": input_feeding},
        "attention": {"score": "general"},
    }
    return from_dict({"model": raw}).model


def model(
    vocab: int,
    seed: int,
    style: str = "bahdanau",
    feeding: bool = True,
    sharpen: float = 4.0,
    eos: float = 1.0,
    rnn: str = "gru",
) -> Seq2Seq:
    """A random model; ``sharpen`` scales the output layer (peakier distributions, fewer
    near-ties) and ``eos`` the EOS row on top of it (how readily sentences end)."""
    torch.manual_seed(seed)
    out = build_model(config(style, rnn, feeding), vocab, vocab)
    with torch.no_grad():
        out.generator.weight.mul_(sharpen)
        out.generator.weight[EOS_ID].mul_(eos)
    return out.eval()


def source(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random word ids (no special symbols), right-padded: (B, S) and the lengths (B,)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]
    return pad(ids), torch.tensor(lengths)


def limit(src_length: int, ratio: float, offset: int) -> int:
    """The longest output, EOS included, written from the definition."""
    return max(1, math.ceil(src_length * ratio) + offset)


def options(
    beam_size: int = 5,
    alpha: float = 1.0,
    ratio: float = 1.5,
    offset: int = 3,
    no_repeat_ngram: int = 0,
    coverage: float = 0.0,
    average: str = "linear",
) -> DecodingConfig:
    return DecodingConfig(
        beam_size=beam_size,
        length_penalty=alpha,
        max_len_ratio=ratio,
        max_len_offset=offset,
        no_repeat_ngram=no_repeat_ngram,
        coverage_penalty=coverage,
        ensemble_average=average,
    )


def lp(length: int, alpha: float) -> float:
    """GNMT's length penalty ((5 + |Y|) / 6)^alpha, written from the definition."""
    return ((5.0 + length) / 6.0) ** alpha


def mix(log_probs: Sequence[torch.Tensor], average: str) -> torch.Tensor:
    """Members' float64 log-probabilities (each (..., V)) -> the ensemble's, by definition:
    linear log(1/M sum_m p_m), log_linear log softmax(1/M sum_m log p_m)."""
    stacked = torch.stack([x.double() for x in log_probs])  # (M, ..., V)
    if average == "linear":
        return stacked.exp().mean(dim=0).log()
    return torch.log_softmax(stacked.mean(dim=0), dim=-1)


@torch.no_grad()
def forced(models: Sequence[Seq2Seq], src: torch.Tensor, y: Sequence[int], average: str = "linear"):
    """One sentence src (1, S) unpadded and an output y (no EOS) -> float64 log p(y EOS | x)
    of the (mixed) models and each member's attention (|y|+1, S)."""
    trg_in = torch.tensor([[BOS_ID, *y]])
    gold = torch.tensor([*y, EOS_ID])
    members, attention = [], []
    for m in models:
        features, alphas = m(src, torch.tensor([src.size(1)]), trg_in)
        members.append(F.log_softmax(m.generator(features[0]).double(), dim=-1))  # (T, V)
        attention.append(alphas[0].double())
    log_probs = mix(members, average) if len(models) > 1 else members[0]
    return float(log_probs.gather(1, gold[:, None]).sum()), attention


@torch.no_grad()
def sequence_log_probs(
    models: Sequence[Seq2Seq],
    src: torch.Tensor,
    candidates: list[tuple[int, ...]],
    average: str = "linear",
) -> dict[tuple[int, ...], float]:
    """float64 log p(y + EOS | x) for each candidate, by teacher forcing; src: (1, S)
    unpadded; several models: their mixture by ``average``."""
    out = []
    for length, group in itertools.groupby(sorted(candidates, key=len), key=len):
        group = list(group)
        trg_in = torch.tensor([[BOS_ID, *y] for y in group]).view(len(group), length + 1)
        gold = torch.tensor([[*y, EOS_ID] for y in group]).view(len(group), length + 1)
        lengths = torch.full((len(group),), src.size(1))
        members = []
        for m in models:
            features, _ = m(src.expand(len(group), -1), lengths, trg_in)
            members.append(F.log_softmax(m.generator(features).double(), dim=-1))  # (N, T, V)
        log_probs = mix(members, average) if len(models) > 1 else members[0]
        picked = log_probs.gather(2, gold[:, :, None]).squeeze(2).sum(1)  # (N,)
        out.extend(zip(group, picked.tolist(), strict=True))
    return dict(out)


def enumerate_outputs(vocab: int, max_tokens: int) -> list[tuple[int, ...]]:
    """Every output of at most ``max_tokens`` non-EOS symbols (any symbol of the vocabulary)."""
    words = [i for i in range(vocab) if i != EOS_ID]
    return [y for n in range(max_tokens + 1) for y in itertools.product(words, repeat=n)]


def contains(tokens: Sequence[int], phrase: Sequence[int]) -> bool:
    """Whether ``phrase`` occurs in ``tokens`` as a contiguous run."""
    n = len(phrase)
    return any(list(tokens[i : i + n]) == list(phrase) for i in range(len(tokens) - n + 1))
