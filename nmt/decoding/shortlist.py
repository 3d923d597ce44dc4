"""The lexical shortlist: each sentence is decoded over the target pieces its source can
bring, not the whole vocabulary (Marian's lexical shortlist; Jean et al. 2015, section 3.2,
for candidate lists per sentence).

A sentence's pieces C(x) are the special pieces, the ``shortlist_frequent`` most frequent
target pieces of the training data, the ``shortlist_per_word`` most probable translations of
each piece of its source (IBM Model 1, ``nmt.data.lexicon``) and the pieces of its prefix and
constraints. A batch's columns are its sentences' pieces together; the output layer computes
only those rows of W_o, and each row's softmax normalises over its own sentence's pieces
(the others get -inf, ``Ensemble.restricted``):

    p'(y_t | y_<t, x) = exp(w_y . f_t) / sum_{v in C(x)} exp(w_v . f_t),   y in C(x)

so a hypothesis's score is its log-probability under the model restricted to C(x), and no
translation depends on the other sentences of its batch.

Search runs unchanged over column indices: the columns are sorted and start with every
special piece, so BOS, EOS, UNK and PAD keep their ids; the decoder is fed the piece of the
column chosen (``Ensemble.restricted``), and the outputs, prefixes and constraints are
mapped between pieces and columns here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt.data.lexicon import FREQUENT, PER_WORD, build_lexicon, lexicon_sample
from nmt.data.store import TokenizedCorpus
from nmt.decoding.search import Hypothesis
from nmt.decoding.steering import Steering
from nmt.errors import CheckpointError
from nmt.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SPECIALS = sorted((PAD_ID, UNK_ID, BOS_ID, EOS_ID))
ALIGN = 64  # a batch's columns are filled up to a multiple of this with the next most
# frequent pieces (while there are any): the output layer's matmul and the compiled top-k
# (blocks of 64 values) take whole blocks


@dataclass
class Shortlist:
    """frequent: (F,) target ids, most frequent first; table: (V_src, K) target ids per
    source id, most probable first, -1 where a source piece has fewer."""

    frequent: Tensor
    table: Tensor

    @cached_property
    def width(self) -> int:
        """One past the largest target id it holds."""
        largest = [int(t.max()) for t in (self.frequent, self.table) if t.numel()]
        return max(largest, default=-1) + 1

    @classmethod
    def build(
        cls, corpus: TokenizedCorpus, src_vocab_size: int, trg_vocab_size: int, seed: int
    ) -> Shortlist:
        """The shortlist of a prepared training split (``nmt.data.lexicon``: Model 1 on
        its pairs, or on a seeded sample of a large corpus)."""
        src_ids, trg_ids = corpus.pairs(
            lexicon_sample(corpus.src_lengths, corpus.trg_lengths, seed)
        )
        lexicon = build_lexicon(src_ids, trg_ids, src_vocab_size, trg_vocab_size)
        return cls(
            torch.from_numpy(lexicon.frequent).long(), torch.from_numpy(lexicon.table).long()
        )

    def state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint keeps: int32 tensors."""
        return {"frequent": self.frequent.int(), "table": self.table.int()}

    @classmethod
    def from_state_dict(
        cls, state: Any, src_vocab_size: int, trg_vocab_size: int, path: Path
    ) -> Shortlist:
        """A checkpoint's shortlist, checked: a damaged or foreign one is a CheckpointError."""
        problem = _problem(state, src_vocab_size, trg_vocab_size)
        if problem:
            raise CheckpointError(
                f"{path}: its shortlist {problem}; the checkpoint is damaged or was edited: "
                f"use another checkpoint of the run, or decode with --shortlist off"
            )
        return cls(state["frequent"].long(), state["table"].long())


def batch_columns(
    shortlists: Sequence[Shortlist],
    src_ids: Sequence[Sequence[int]],
    frequent: int,
    per_word: int,
    forced: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor]:
    """A batch's columns: the sorted target ids (V',) it is decoded over, every sentence's
    own columns together (an ensemble's: each model's shortlist's, as its members may come
    from different data) filled up to a multiple of ALIGN; and which of them are each
    sentence's own (B, V') bool, the only ones its search may choose and normalise over, so
    that no sentence's translation depends on the others in its batch. ``forced``: each
    sentence's prefix and constraint pieces.

    Each sentence's pieces are marked in one (B, V + 1) mask for the whole batch: its source
    pieces' rows of every table gathered at once and marked through the flat mask, a table's
    -1 (no more translations) in the extra column V, which is then dropped; the mask's
    columns that any sentence has are the batch's. (Marking through a long index keeps the
    search for the found entries, a boolean index's, out of the batch's time.)"""
    batch = len(src_ids)
    flat = torch.tensor([piece for ids in src_ids for piece in ids], dtype=torch.long)  # (P,)
    lengths = torch.tensor([len(ids) for ids in src_ids], dtype=torch.long)
    sentence = torch.repeat_interleave(lengths)  # (P,) the sentence of each piece
    extra = [list(f) for f in forced] if forced is not None else [[] for _ in range(batch)]
    width = max(
        max(SPECIALS) + 1,
        *(s.width for s in shortlists),
        *(max(f) + 1 for f in extra if f),
    )
    marks = torch.zeros(batch, width + 1, dtype=torch.bool)  # (B, V + 1), V: no piece
    marks[:, SPECIALS] = True
    for shortlist in shortlists:
        marks[:, shortlist.frequent[:frequent]] = True
        picks = shortlist.table[flat, :per_word]  # (P, K) -1 where a piece has fewer
        picks = torch.where(picks >= 0, picks, width)
        marks.view(-1)[(sentence * (width + 1))[:, None] + picks] = True
    for b, pieces_b in enumerate(extra):
        marks[b, pieces_b] = True
    own = marks[:, :width]  # (B, V) each sentence's pieces
    union = own.any(dim=0)  # (V,)
    short = -int(union.sum()) % ALIGN
    if short:
        spare = shortlists[0].frequent[frequent:]  # (F',) the next most frequent pieces
        union[spare[~union[spare]][:short]] = True
    ids = union.nonzero().view(-1) if batch else torch.tensor(SPECIALS)  # sorted
    return ids, own[:, ids]


def _problem(state: Any, src_vocab_size: int, trg_vocab_size: int) -> str | None:
    """What is wrong with a saved shortlist, or None."""
    if not isinstance(state, dict) or set(state) != {"frequent", "table"}:
        return "is not a dict of frequent and table"
    frequent, table = state["frequent"], state["table"]
    if not all(isinstance(t, Tensor) and not t.is_floating_point() for t in (frequent, table)):
        return "holds tensors that are not integer ids"
    if frequent.dim() != 1 or table.dim() != 2 or table.size(0) != src_vocab_size:
        return (
            f"has shapes {tuple(frequent.shape)} and {tuple(table.shape)}, not (F,) and "
            f"({src_vocab_size}, K)"
        )
    if frequent.numel() > FREQUENT or table.size(1) > PER_WORD:
        return f"is larger than nmt builds ({FREQUENT} frequent, {PER_WORD} per word)"
    for name, ids, low in (("frequent", frequent, 0), ("table", table, -1)):
        if ids.numel() and (int(ids.min()) < low or int(ids.max()) >= trg_vocab_size):
            return f"has {name} ids outside the target vocabulary of {trg_vocab_size}"
    return None


class Columns:
    """One batch's columns (sorted target ids) and the maps between ids and columns."""

    def __init__(self, ids: Tensor):
        self.ids = ids  # (V',)
        self.id_list: list[int] = ids.tolist()
        self.column_of = {piece: column for column, piece in enumerate(self.id_list)}

    def steering(self, steering: Steering | None) -> Steering | None:
        """Prefixes and constraints in columns (each piece is among the columns)."""
        if steering is None:
            return None
        column = self.column_of.__getitem__
        prefixes = steering.prefixes
        constraints = steering.constraints
        return Steering(
            [[column(i) for i in prefix] for prefix in prefixes] if prefixes is not None else None,
            [[[column(i) for i in phrase] for phrase in phrases] for phrases in constraints]
            if constraints is not None
            else None,
        )

    def hypotheses(self, hyps: list[Hypothesis]) -> list[Hypothesis]:
        """Hypotheses over columns -> over target ids (in place)."""
        for hyp in hyps:
            hyp.tokens = [self.id_list[c] for c in hyp.tokens]
        return hyps


def forced_pieces(steering: Steering | None, sentences: int) -> list[list[int]]:
    """Each sentence's prefix and constraint pieces: each must be among its columns."""
    return [steering.forced_pieces(b) if steering else [] for b in range(sentences)]
