"""Sampled segmentations for subword regularisation, drawn from a generator seeded by the
pair's seed alone: the algorithms of sentencepiece's ``SampleEncode``, on the same model.

- unigram, all segmentations (Kudo 2018, section 3.2): forward-filtering backward-sampling on
  the lattice of the vocabulary's pieces, a path drawn with probability
  P(x) ∝ exp(α Σ_i log p(x_i)).
- unigram, the n best: the n best paths by Σ_i log p(x_i), one drawn with probability
  ∝ exp(α Σ_i log p(x_i)).
- BPE-dropout (Provilkov et al. 2020): the merges in order of priority, each one dropped with
  probability α when its turn comes.

Why not sentencepiece's own: in sentencepiece 0.2.3 the seed that
``set_random_generator_seed`` sets is salted with 4 bytes of OS entropy read once per process
(abseil's salted seed sequence; 0.2.0 seeded each thread's generator once, on first use, so a
seed set per line did nothing). A seed then gives one sample all through a process and another
in the next: a resumed run, another rank or a worker process of ``Dataset.map`` sampled other
ids for the same epoch, and a prepared epoch's entry, removed and sampled again by another
process, came back different. Here each line's sample is a function of (model, text, seed,
α, n) alone, in any process.
sentencepiece still normalises the text; the lattice, its pieces' scores and the unknown
characters' penalty follow its unigram and BPE models (``unigram_model.cc``, ``bpe_model.cc``),
and unknown characters become byte pieces (byte fallback) or one unknown piece per run, as in
its ``PopulateSentencePieceText``.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import re
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from nmt.errors import DataError

SAMPLER_VERSION = 1  # part of a sampled epoch's store key: bump when what is drawn changes
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # piece types
UNIGRAM, BPE = 1, 2  # trainer_spec.model_type
UNK_PENALTY = 10.0  # an unknown character's score below the lowest piece's (kUnkPenalty)
FLT_MIN = 1.1754943508222875e-38  # the start of sentencepiece's maximum piece score
WORDS = re.compile("▁?[^▁]+|▁")  # normalized text's words, each with the ▁ that starts it
TABLES = 50_000  # the words whose sampling tables a process keeps, the latest drawn
Table = tuple[array, array, array, array]  # Sampler.table's starts, begins, ids, cumulative


@dataclass
class Model:
    """What sampling reads of a sentencepiece model: its pieces (text, score, type), its
    kind and whether unknown characters fall back to bytes."""

    pieces: list[tuple[str, float, int]]
    kind: int = UNIGRAM
    byte_fallback: bool = False
    ids: dict[str, int] = field(init=False)  # the pieces a text's symbols can be
    reserved: dict[str, int] = field(init=False)  # unknown, control and byte pieces
    unk_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.ids, self.reserved = {}, {}
        for i, (piece, _, kind) in enumerate(self.pieces):
            (self.reserved if kind in (UNKNOWN, CONTROL, BYTE) else self.ids)[piece] = i
        self.unk_id = next(i for i, (_, _, kind) in enumerate(self.pieces) if kind == UNKNOWN)

    def piece_id(self, piece: str) -> int:
        """sentencepiece's ``PieceToId``: the reserved pieces first, unknown if none."""
        return self.reserved.get(piece, self.ids.get(piece, self.unk_id))


def read_model(proto: bytes) -> Model:
    """The pieces, kind and byte fallback of a serialized ``ModelProto`` (fields 1 pieces:
    {1 piece, 2 score, 3 type}, 2 trainer_spec: {3 model_type, 35 byte_fallback})."""
    pieces: list[tuple[str, float, int]] = []
    kind, byte_fallback = UNIGRAM, False
    for number, value in _fields(proto):
        if number == 1:
            text, score, type_ = "", 0.0, NORMAL
            for inner, item in _fields(value):
                if inner == 1:
                    text = item.decode("utf-8")
                elif inner == 2:
                    score = item
                elif inner == 3:
                    type_ = item
            pieces.append((text, score, type_))
        elif number == 2:
            for inner, item in _fields(value):
                if inner == 3:
                    kind = item
                elif inner == 35:
                    byte_fallback = bool(item)
    return Model(pieces, kind, byte_fallback)


def _fields(data: bytes) -> list[tuple[int, Any]]:
    """The (field number, value) of a protobuf message: varints as int, 32-bit values as
    float, length-delimited ones as bytes (64-bit ones skipped)."""
    out: list[tuple[int, Any]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            out.append((number, data[pos : pos + size]))
            pos += size
        elif wire == 5:
            out.append((number, struct.unpack_from("<f", data, pos)[0]))
            pos += 4
        else:
            raise ValueError(f"not a sentencepiece model: wire type {wire} at byte {pos}")
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


class Sampler:
    """Sampled segmentations of normalized text (``normalize`` is sentencepiece's) under one
    model; ``sample`` is ``SampleEncode``'s ids with nmt's generator."""

    def __init__(self, model: Model, normalize: Callable[[str], str]):
        self.model, self.normalize = model, normalize
        normal = [score for _, score, kind in model.pieces if kind == NORMAL]
        self.unk_score = min(normal) - UNK_PENALTY
        top = max([FLT_MIN, *normal])
        self.nodes: dict[str, tuple[int, float]] = {}  # a unigram lattice's pieces: id, score
        for i, (piece, score, kind) in enumerate(model.pieces):
            if kind == NORMAL:
                self.nodes[piece] = (i, score)
            elif kind == USER_DEFINED:  # always taken: a bonus over any normal piece
                self.nodes[piece] = (i, len(piece) * top - 0.1)
        self.trie: dict[str, Any] = {}  # character by character; "" holds (id, score)
        for piece, found in self.nodes.items():
            branch = self.trie
            for char in piece:
                branch = branch.setdefault(char, {})
            branch[""] = found
        self.by_word = all("▁" not in piece[1:] for piece in self.nodes)
        self.tables: dict[tuple[str, float], Any] = {}  # a word's table, drawn from again
        self.user_defined = sorted(
            (piece for piece, _, kind in model.pieces if kind == USER_DEFINED), key=len
        )[::-1]

    def sample(self, text: str, seed: int, alpha: float, nbest: int) -> list[int]:
        """One sampled segmentation's ids: unigram sampling among all segmentations
        (``nbest`` < 0) or the ``nbest`` best, BPE-dropout (merges dropped at rate
        ``alpha``) for a BPE model; the same for the same arguments in any process."""
        normalized = self.normalize(text)
        if not normalized:
            return []
        rng = random.Random(seed)
        if self.model.kind == BPE:
            return self.finish(self.bpe_dropout(normalized, alpha, rng))
        if self.model.kind != UNIGRAM:
            raise DataError(
                "tokenizer.sampling_alpha: the tokenizer is a sentencepiece word or char model, "
                "which has no sampled segmentations; use a unigram or BPE model, or set "
                "tokenizer.sampling_alpha: null"
            )
        if nbest < 0:
            path = self.draw(normalized, alpha, rng)
        else:
            paths = self.nbest(self.lattice(normalized), max(1, nbest))
            weights = [alpha * score for score, _ in paths]
            top = max(weights)
            path = paths[_pick([math.exp(w - top) for w in weights], rng)][1]
        return self.finish([(normalized[begin:end], piece) for begin, end, piece in path])

    def lattice(self, text: str) -> list[list[tuple[int, int, float]]]:
        """The nodes ending at each position (0..len): (begin, id, score) for every piece
        found in ``text``, and an unknown node where no one-character piece starts."""
        size = len(text)
        ends: list[list[tuple[int, int, float]]] = [[] for _ in range(size + 1)]
        unknown = (self.model.unk_id, self.unk_score)
        for begin in range(size):
            branch = self.trie.get(text[begin])
            single = branch is not None and "" in branch
            end = begin + 1
            while branch is not None:
                found = branch.get("")
                if found is not None:
                    ends[end].append((begin, *found))
                if end == size:
                    break
                branch = branch.get(text[end])
                end += 1
            if not single:
                ends[begin + 1].append((begin, *unknown))
        return ends

    def draw(self, text: str, theta: float, rng: random.Random) -> list[tuple[int, int, int]]:
        """Forward filtering, backward sampling: walking back from the end, the node ending
        at ``pos`` is drawn in proportion to exp(forward[begin] + θ score) (``table``).
        Where no piece spans a word boundary (a ``▁`` after its first character), the
        words' segmentations are independent and drawn word by word, each word's table
        made once and kept while it is among the ``TABLES`` latest drawn. Returns (begin,
        end, id) of each piece."""
        path: list[tuple[int, int, int]] = []
        offset = 0
        for word in WORDS.findall(text) if self.by_word else [text]:
            table = self.tables.pop((word, theta), None)
            if table is None:
                table = self.table(self.lattice(word), theta)
                if len(self.tables) >= TABLES:  # the least recently drawn word goes
                    del self.tables[next(iter(self.tables))]
            if self.by_word:
                self.tables[(word, theta)] = table  # the most recently drawn: last
            starts, begins, ids, cumulative = table
            pieces = []
            pos = len(word)
            while pos > 0:
                low, high = starts[pos], starts[pos + 1]
                index = low
                if high - low > 1:
                    drawn = rng.random() * cumulative[high - 1]
                    index = min(bisect.bisect_right(cumulative, drawn, low, high), high - 1)
                pieces.append((offset + begins[index], offset + pos, ids[index]))
                pos = begins[index]
            path.extend(reversed(pieces))
            offset += len(word)
        return path

    def table(self, ends: list[list[tuple[int, int, float]]], theta: float) -> Table:
        """The nodes ending at each position, packed: those ending at ``pos`` are
        ``starts[pos]:starts[pos + 1]`` of ``begins`` and ``ids``, with the running sum of
        their weights exp(forward[begin] + θ score - forward[pos]) in ``cumulative``, where
        ``forward[pos]`` is the log of the summed exp(θ Σ score) of the paths from the start
        to ``pos``."""
        forward = [0.0] * len(ends)
        starts, begins, ids = array("i", [0, 0]), array("i"), array("i")
        cumulative = array("d")
        for pos in range(1, len(ends)):
            nodes = ends[pos]
            logits = [forward[begin] + theta * score for begin, _, score in nodes]
            forward[pos] = logits[0] if len(logits) == 1 else _logsumexp(logits)
            cumulative.extend(accumulate(math.exp(logit - forward[pos]) for logit in logits))
            begins.extend(begin for begin, _, _ in nodes)
            ids.extend(piece for _, piece, _ in nodes)
            starts.append(len(ids))
        return starts, begins, ids, cumulative

    def nbest(
        self, ends: list[list[tuple[int, int, float]]], size: int
    ) -> list[tuple[float, list[tuple[int, int, int]]]]:
        """The ``size`` best paths by total score, best first, each as (begin, end, id) of
        its pieces (k-best Viterbi: each position keeps the ``size`` best paths that reach
        it, as (score, the node's index among those ending there, the rank of the path it
        extends))."""
        best: list[list[tuple[float, int, int]]] = [[(0.0, -1, -1)]]
        for pos in range(1, len(ends)):
            reach = [
                (score + node[2], index, rank)
                for index, node in enumerate(ends[pos])
                for rank, (score, _, _) in enumerate(best[node[0]])
            ]
            best.append(heapq.nlargest(size, reach, key=lambda item: item[0]))
        out = []
        for score, index, rank in best[-1]:
            pieces, pos = [], len(ends) - 1
            while pos > 0:
                begin, piece, _ = ends[pos][index]
                pieces.append((begin, pos, piece))
                pos = begin
                _, index, rank = best[pos][rank]
            out.append((score, pieces[::-1]))
        return out

    def bpe_dropout(self, text: str, alpha: float, rng: random.Random) -> list[tuple[str, int]]:
        """sentencepiece's BPE with dropout: symbols (characters; user-defined pieces whole
        and never merged) merged pair by pair, the highest-scored pair first (the leftmost
        on a tie), each merge skipped with probability ``alpha`` when it comes up."""
        symbols: list[str] = []
        frozen: list[bool] = []
        pos = 0
        while pos < len(text):
            whole = next((u for u in self.user_defined if text.startswith(u, pos)), None)
            symbols.append(whole or text[pos])
            frozen.append(whole is not None)
            pos += len(symbols[-1])
        prev = list(range(-1, len(symbols) - 1))
        nxt = [*range(1, len(symbols)), -1]
        agenda: list[tuple[float, int, int, str]] = []
        split: dict[str, tuple[str, str]] = {}  # unused pieces: how to undo their merge

        def offer(left: int, right: int) -> None:
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            piece = symbols[left] + symbols[right]
            found = self.model.ids.get(piece)
            if found is None:
                return
            heapq.heappush(agenda, (-self.model.pieces[found][1], left, right, piece))
            if self.model.pieces[found][2] == UNUSED:
                split[piece] = (symbols[left], symbols[right])

        for i in range(1, len(symbols)):
            offer(i - 1, i)
        while agenda:
            _, left, right, piece = heapq.heappop(agenda)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != piece:
                continue  # one side was merged into something else meanwhile
            if alpha > 0 and (alpha >= 1 or rng.random() < alpha):
                continue
            symbols[left], symbols[right] = piece, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            offer(prev[left], left)
            offer(left, nxt[left])
        out: list[tuple[str, int]] = []
        index = 0 if symbols else -1
        while index >= 0:
            self._resegment(symbols[index], split, out)
            index = nxt[index]
        return out

    def _resegment(self, piece: str, split: dict[str, tuple[str, str]], out: list) -> None:
        """An unused piece back into the symbols it was merged from."""
        found = self.model.piece_id(piece)
        if self.model.pieces[found][2] == UNUSED and piece in split:
            for half in split[piece]:
                self._resegment(half, split, out)
        else:
            out.append((piece, found))

    def finish(self, pieces: list[tuple[str, int]]) -> list[int]:
        """The ids of a segmentation: an unknown piece becomes the byte pieces of its UTF-8
        bytes under byte fallback, else a run of unknown pieces one unknown id."""
        ids: list[int] = []
        previous_unknown = False
        for piece, found in pieces:
            unknown = found == self.model.unk_id
            if unknown and self.model.byte_fallback:
                ids.extend(self.model.piece_id(f"<0x{b:02X}>") for b in piece.encode("utf-8"))
            elif not (unknown and previous_unknown):
                ids.append(found)
            previous_unknown = unknown
        return ids


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _pick(weights: list[float], rng: random.Random) -> int:
    """An index drawn in proportion to ``weights``."""
    target = rng.random() * sum(weights)
    for index, weight in enumerate(weights):
        target -= weight
        if target < 0:
            return index
    return len(weights) - 1
