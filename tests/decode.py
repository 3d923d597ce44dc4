"""The tests' short spellings of a search call: positional options as the tests vary them,
turned into the typed ``DecodingConfig`` that nmt.decoding.search takes."""

from __future__ import annotations

from nmt.config import DecodingConfig
from nmt.decoding.search import Hypothesis, beam_search, greedy_search


def decoding(
    beam_size: int = 5,
    alpha: float = 1.0,
    max_len_ratio: float = 1.5,
    max_len_offset: int = 10,
    no_repeat_ngram: int = 0,
) -> DecodingConfig:
    return DecodingConfig(
        beam_size=beam_size,
        length_penalty=alpha,
        max_len_ratio=max_len_ratio,
        max_len_offset=max_len_offset,
        no_repeat_ngram=no_repeat_ngram,
    )


def run_beam(
    model,
    src,
    src_lengths,
    beam_size: int = 5,
    alpha: float = 1.0,
    max_len_ratio: float = 1.5,
    max_len_offset: int = 10,
    n_best: int = 1,
    return_attention: bool = False,
    no_repeat_ngram: int = 0,
) -> list[list[Hypothesis]]:
    options = decoding(beam_size, alpha, max_len_ratio, max_len_offset, no_repeat_ngram)
    return beam_search(model, src, src_lengths, options, n_best, return_attention)


def run_greedy(
    model,
    src,
    src_lengths,
    max_len_ratio: float = 1.5,
    max_len_offset: int = 10,
    return_attention: bool = False,
    alpha: float = 1.0,
    no_repeat_ngram: int = 0,
) -> list[Hypothesis]:
    options = decoding(1, alpha, max_len_ratio, max_len_offset, no_repeat_ngram)
    return greedy_search(model, src, src_lengths, options, return_attention)
