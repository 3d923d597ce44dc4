"""The lexical shortlist in search: the restricted step against the log-softmax over the
columns written in float64, greedy search against a plain float64 reference over the
columns, every column equal to the whole vocabulary to the bit, steering mapped through the
columns, the batch's columns, the checks of a saved shortlist (when one is used: test_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from searchref import model, options, source

from nmt.config import Config
from nmt.data.tokenizer import BOS_ID, EOS_ID
from nmt.decoding.ensemble import Ensemble
from nmt.decoding.options import SearchOptions
from nmt.decoding.search import beam_search, greedy_search
from nmt.decoding.shortlist import (
    ALIGN,
    SPECIALS,
    Columns,
    Shortlist,
    batch_columns,
    forced_pieces,
)
from nmt.decoding.steering import Steering
from nmt.decoding.translator import Translator
from nmt.errors import CheckpointError

VOCAB = 12


def _columns(*ids: int) -> torch.Tensor:
    return torch.tensor(sorted({*SPECIALS, *ids}))


def test_restricted_step_is_the_log_softmax_over_the_columns() -> None:
    """A float64 model, padding in the batch: log p'(y) = w_y . f - log sum_{v in C_b}
    exp(w_v . f) for each column of the row's sentence b's own C_b, to float32's round-off
    (search's log-probabilities are float32), -inf for the batch's other columns; the
    attention that of the whole model's step."""
    m = model(VOCAB, seed=4).double()
    src, src_lengths = source([6, 2, 4], VOCAB, seed=5)
    columns = _columns(5, 7, 8, 11)  # (8,)
    allowed = torch.ones(3, len(columns), dtype=torch.bool)  # (B, V') each sentence's own
    allowed[0, [5, 6]] = False  # sentence 0 without pieces 7 and 8
    allowed[2, 7] = False  # sentence 2 without piece 11
    whole, restricted = Ensemble([m]), Ensemble([m]).restricted(columns, allowed)
    state = restricted.encode(src, src_lengths, repeat=2)
    prev_columns = torch.tensor([2, 4, 5, 6, 7, 2])  # column indices: BOS and pieces 5 to 11
    prev = columns[prev_columns]
    with torch.no_grad():
        log_probs, alphas, _ = restricted.step(prev_columns, state)
        _, want_alphas, _ = whole.step(prev, whole.encode(src, src_lengths, repeat=2))
        features, _, _ = m.decoder.step(prev, state.memories[0], state.states[0])
        logits = features.double() @ m.generator.weight.double()[columns].T  # (N, V')
    own = allowed.repeat_interleave(2, dim=0)  # (N, V') each row's sentence's
    norm = torch.logsumexp(logits.masked_fill(~own, -torch.inf), dim=-1, keepdim=True)
    reference = logits - norm
    assert log_probs.shape == (6, len(columns))
    assert log_probs.dtype == torch.float32
    assert torch.allclose(log_probs.double()[own], reference[own], rtol=0, atol=2e-6)
    assert torch.all(log_probs[~own] == -torch.inf)
    assert torch.equal(alphas, want_alphas)


def _greedy_reference(m, src: torch.Tensor, length: int, columns: torch.Tensor, limit: int):
    """Argmax over the columns at each step by teacher forcing the output so far, in float64:
    the output's pieces and its summed restricted log-probability (EOS included)."""
    output: list[int] = []
    total = 0.0
    with torch.no_grad():
        for t in range(limit):
            trg_in = torch.tensor([[BOS_ID, *output]])
            features, _ = m(src[:, :length], torch.tensor([length]), trg_in)
            logits = features[0, -1].double() @ m.generator.weight.double()[columns].T
            log_probs = logits - torch.logsumexp(logits, dim=-1)
            best = EOS_ID if t == limit - 1 else int(columns[log_probs.argmax()])
            total += float(log_probs[(columns == best).nonzero()[0, 0]])
            if best == EOS_ID:
                break
            output.append(best)
    return output, total


def test_greedy_over_the_columns_follows_the_reference() -> None:
    """Greedy search through the columns (mapped back to pieces) gives, for every sentence
    of a padded batch, the float64 reference's outputs and log-probabilities over that
    sentence's own columns."""
    m = model(VOCAB, seed=8, eos=0.5).double()
    src, src_lengths = source([5, 2, 4, 3], VOCAB, seed=9)
    own = [_columns(4, 6, 9, 10), _columns(6, 7), _columns(4, 5, 9, 11), _columns(8, 10)]
    ids = torch.unique(torch.cat(own))
    allowed = torch.stack([torch.isin(ids, mine) for mine in own])  # (B, V')
    columns = Columns(ids)
    cfg = options(beam_size=1, alpha=0.0, ratio=1.5, offset=2)
    restricted = Ensemble([m]).restricted(ids, allowed)
    hyps = columns.hypotheses(greedy_search(restricted, src, src_lengths, cfg))
    for row, hyp in enumerate(hyps):
        length = int(src_lengths[row])
        limit = -(-length * 3 // 2) + 2
        want, log_prob = _greedy_reference(m, src[row : row + 1], length, own[row], limit)
        assert hyp.tokens == want
        assert hyp.log_prob == pytest.approx(log_prob, abs=1e-5)  # float32 sums
        assert set(hyp.tokens) <= set(own[row].tolist())


def test_every_column_decodes_as_the_whole_vocabulary() -> None:
    """With every piece a column of every sentence, beam search (n-best, attention, a
    prefix, constraints) and greedy search give the unrestricted outputs and scores to the
    bit."""
    m = model(VOCAB, seed=12)
    src, src_lengths = source([5, 3, 6], VOCAB, seed=13)
    every = torch.arange(VOCAB)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    steering = Steering(prefixes=[[5], [], [7, 8]], constraints=[[[9]], [], [[10, 4]]])
    cfg = options(beam_size=4, alpha=0.6, ratio=2.0, offset=4)
    plain = beam_search(m, src, src_lengths, cfg, 3, True, steering)
    columns = Columns(every)
    restricted = beam_search(
        Ensemble([m]).restricted(every, allowed), src, src_lengths, cfg, 3, True,
        columns.steering(steering),
    )  # fmt: skip
    for a, b in zip(plain, restricted, strict=True):
        assert [(h.tokens, h.score, h.log_prob) for h in a] == [
            (h.tokens, h.score, h.log_prob) for h in columns.hypotheses(b)
        ]
        assert all(torch.equal(x.alphas, y.alphas) for x, y in zip(a, b, strict=True))
    greedy = options(beam_size=1)
    want = greedy_search(m, src, src_lengths, greedy)
    got = greedy_search(Ensemble([m]).restricted(every, allowed), src, src_lengths, greedy)
    assert [(h.tokens, h.score) for h in want] == [(h.tokens, h.score) for h in got]


def test_steering_goes_through_the_columns() -> None:
    """Prefix and constraint pieces become column indices and the outputs pieces again: a
    forced piece outside the shortlist's translations is a column of its own sentence (not
    of the other's), and every output starts with its prefix and holds its phrase."""
    m = model(VOCAB, seed=14)
    src, src_lengths = source([4, 5], VOCAB, seed=15)
    shortlist = Shortlist(torch.tensor([4, 5]), torch.full((VOCAB, 2), -1))
    steering = Steering(prefixes=[[11, 10], []], constraints=[[], [[9, 8]]])
    forced = forced_pieces(steering, 2)
    assert forced == [[11, 10], [9, 8]]
    ids, allowed = batch_columns([shortlist], src.tolist(), 2, 2, forced)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert ids[allowed[0]].tolist() == [0, 1, 2, 3, 4, 5, 10, 11]
    assert ids[allowed[1]].tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    columns = Columns(ids)
    results = beam_search(
        Ensemble([m]).restricted(ids, allowed), src, src_lengths,
        options(beam_size=3, offset=4), 2, False, columns.steering(steering),
    )  # fmt: skip
    first, second = (columns.hypotheses(hyps) for hyps in results)
    assert first and all(h.tokens[:2] == [11, 10] for h in first)
    assert second and all(
        any(h.tokens[i : i + 2] == [9, 8] for i in range(len(h.tokens))) for h in second
    )
    assert all(set(h.tokens) <= {0, 1, 2, 3, 4, 5, 10, 11} for h in first)
    assert all(set(h.tokens) <= {0, 1, 2, 3, 4, 5, 8, 9} for h in second)


def test_a_batchs_columns() -> None:
    """A sentence's own columns: the special pieces, the first F frequent, the first K
    translations of each of its source pieces and its forced pieces, sorted, once each; the
    batch's: all of them, filled with the next frequent pieces up to a multiple of ALIGN
    while there are any (no sentence's own); an ensemble's: its members' together."""
    frequent = torch.arange(200, 100, -1)  # (100,) pieces 200 down to 101
    table = torch.full((50, 3), -1)
    table[7] = torch.tensor([20, 21, 22])
    table[9] = torch.tensor([21, 30, -1])
    shortlist = Shortlist(frequent, table)
    ids, allowed = batch_columns([shortlist], [[7, 9], [9]], 2, 2, forced=[[40], []])
    first = [*SPECIALS, 20, 21, 30, 40, 200, 199]
    second = [*SPECIALS, 21, 30, 200, 199]
    assert ids.numel() == ALIGN
    assert ids.tolist() == sorted(first + list(range(198, 198 - (ALIGN - len(first)), -1)))
    assert ids[allowed[0]].tolist() == sorted(first)
    assert ids[allowed[1]].tolist() == sorted(second)
    small = Shortlist(torch.tensor([5, 6]), table)
    ids, allowed = batch_columns([small], [[7]], 1, 1)
    assert ids.tolist() == [*SPECIALS, 5, 6, 20]
    assert allowed.tolist() == [[True] * 5 + [False, True]]
    other = Shortlist(torch.tensor([8]), torch.full((50, 1), 33))
    ids, allowed = batch_columns([small, other], [[7]], 1, 1)
    assert ids.tolist() == [*SPECIALS, 5, 6, 8, 20, 33]
    assert ids[allowed[0]].tolist() == [*SPECIALS, 5, 8, 20, 33]


def _own_columns(
    shortlists: list[Shortlist], src: list[int], frequent: int, per_word: int, forced: list[int]
) -> set[int]:
    """A sentence's own pieces C(x), written from the definition with sets."""
    own = {*SPECIALS, *forced}
    for shortlist in shortlists:
        own |= set(shortlist.frequent[:frequent].tolist())
        for piece in src:
            own |= {t for t in shortlist.table[piece, :per_word].tolist() if t >= 0}
    return own


@pytest.mark.parametrize("seed", range(6))
def test_a_batchs_columns_against_sets(seed: int) -> None:
    """Random batches (ensembles of up to three shortlists, tables with missing entries,
    repeated and empty sources, forced pieces beyond every table) against the definition:
    each sentence's own columns, and the batch's as their union filled up to ALIGN."""
    generator = torch.Generator().manual_seed(seed)
    count = 1 + seed % 3
    shortlists = []
    for _ in range(count):
        table = torch.randint(4, 90, (40, 6), generator=generator)
        table[torch.rand(40, 6, generator=generator) < 0.3] = -1
        shortlists.append(Shortlist(torch.randperm(86, generator=generator) + 4, table))
    batch = [
        torch.randint(4, 40, (int(n),), generator=generator).tolist()
        for n in torch.randint(0, 9, (7,), generator=generator)
    ]
    batch[1] = batch[0]  # a repeated source
    forced = [
        [] if b % 2 else torch.randint(4, 120, (2,), generator=generator).tolist()
        for b in range(len(batch))
    ]
    frequent, per_word = 1 + seed, 1 + seed % 6
    ids, allowed = batch_columns(shortlists, batch, frequent, per_word, forced)
    owns = [
        _own_columns(shortlists, src, frequent, per_word, f)
        for src, f in zip(batch, forced, strict=True)
    ]
    union = set().union(*owns)
    assert ids.tolist() == sorted(ids.tolist()) and len(set(ids.tolist())) == ids.numel()
    assert union <= set(ids.tolist())
    assert ids.numel() % ALIGN == 0 or ids.numel() == len(union | set(range(4, 90)))
    for b, own in enumerate(owns):
        assert set(ids[allowed[b]].tolist()) == own


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"frequent": torch.tensor([4])}, "not a dict of frequent and table"),
        ({"frequent": torch.tensor([4.0]), "table": torch.zeros(6, 2)}, "not integer ids"),
        ({"frequent": torch.tensor([4]), "table": torch.zeros(5, 2, dtype=torch.int32)}, "shapes"),
        (
            {"frequent": torch.tensor([12]), "table": torch.zeros(6, 2, dtype=torch.int32)},
            "outside",
        ),
        ({"frequent": torch.tensor([4]), "table": torch.full((6, 2), -2)}, "outside"),
        (
            {"frequent": torch.tensor([4]), "table": torch.zeros(6, 101, dtype=torch.int32)},
            "larger",
        ),
    ],
)
def test_a_damaged_shortlist_is_refused(state: dict, problem: str) -> None:
    with pytest.raises(CheckpointError, match=f"best.pt: its shortlist .*{problem}"):
        Shortlist.from_state_dict(state, 6, 12, Path("run/best.pt"))


def test_a_saved_shortlist_reads_back() -> None:
    shortlist = Shortlist(torch.tensor([5, 4]), torch.tensor([[6, -1], [7, 8]]))
    again = Shortlist.from_state_dict(shortlist.state_dict(), 2, 12, Path("best.pt"))
    assert torch.equal(again.frequent, shortlist.frequent)
    assert torch.equal(again.table, shortlist.table)


def test_a_translation_does_not_depend_on_its_batch() -> None:
    """With shortlists that differ from sentence to sentence, each sentence decoded with the
    others gives what it gives alone: its own columns only (beam 5, n-best 3)."""
    m = model(VOCAB, seed=16)
    table = torch.full((VOCAB, 2), -1)
    for piece in range(4, VOCAB):  # each source piece brings two others
        table[piece] = torch.tensor([4 + (piece * 3) % 8, 4 + (piece * 5 + 1) % 8])
    shortlist = Shortlist(torch.tensor([4]), table)
    config = Config()
    decoding = config.decoding.model_copy(update={"shortlist_frequent": 1, "shortlist_per_word": 2})
    translator = Translator(m, None, config, torch.device("cpu"), shortlists=[shortlist])  # type: ignore[arg-type]
    sentences = [[5, 6], [9, 10, 11], [7], [8, 4, 6]]
    search = SearchOptions(n_best=3)
    together = translator.decode_ids(sentences, decoding, search)
    columns = [set(batch_columns([shortlist], [s], 1, 2)[0].tolist()) for s in sentences]
    assert len(set(map(frozenset, columns))) > 1  # the sentences' own pieces differ
    for sentence, own, hyps in zip(sentences, columns, together, strict=True):
        (alone,) = translator.decode_ids([sentence], decoding, search)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-5)
        assert all(set(h.tokens) <= own for h in hyps)
