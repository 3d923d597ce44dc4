"""Attention read as word alignment, and alignments scored against a reference.

Words are the whitespace tokens of the text (what reference alignments count). A model's
attention links subword pieces; ``piece_words`` maps each piece to the word its characters
come from (sentencepiece's offsets), and ``word_attention`` turns the pieces' attention
(target pieces x source pieces) into words': a target word's row is the mean of its pieces'
rows (each a distribution over the source), a source word's column the sum of its pieces'
columns (the probability mass on that word); EOS on either side is left out.

Extraction (``extract_links``):
- ``argmax`` (the default): each target word links to the source word with most attention
  mass. Every target word gets one link, as in Bahdanau et al.'s figures and most
  attention-alignment studies; it suits any decoder.
- ``threshold``: every pair whose mass reaches the threshold (several or no links per word).
- ``intersect``: the argmax links that are also the source word's own argmax, the target
  word that puts most mass on it (the intersection of the two directions' best links, as
  statistical aligners intersect their two directions): fewer links, much more precise;
  recall falls.
- ``gdfa``: grow-diag-final-and (Koehn et al. 2005) of the same two directions, as
  statistical aligners symmetrise theirs: from the intersection, add the argmax links of
  either direction next to a link already in (diagonals included) that align a word not yet
  aligned, then those whose two words are both unaligned. On a demo model's attention it
  aligns best of the four (content-word AER 29.1 against 30.6 intersect and 32.0 argmax,
  docs/alignment.md); on an alignment head, whose argmax links are surer, intersect does.
- ``next``: the attention of the step after the word's own, taken at the position the
  decoder has just read the word (the state that has read y_t, predicting y_{t+1}). On the
  demo corpus's reference alignment a Luong demo model aligns far better with ``argmax``
  (content-word AER 35.0 against 65.2): its attention points at the source of the word it
  predicts.

A model with an alignment head (nmt.model.aligner) aligns with the head's weights instead
(row t: target piece t, read once it is known), unless the attention is asked for.

Scores (Och & Ney 2003): with A the links given, S the sure and P the possible reference
links (S included in P), precision |A & P| / |A|, recall |A & S| / |S| and the alignment
error rate AER = 1 - (|A & S| + |A & P|) / (|A| + |S|), summed over the corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from nmt.data.guidance import word_link_cells
from nmt.data.tokenizer import piece_words

if TYPE_CHECKING:
    from nmt.config import DecodingConfig
    from nmt.decoding.scoring import Scored
    from nmt.decoding.translator import Translator

Link = tuple[int, int]
EXTRACTIONS = ("argmax", "threshold", "next", "intersect", "gdfa")
THRESHOLD = 0.5  # the threshold method's least mass, where none is given


def link_cells(
    sure: set[tuple[int, int]],
    possible: set[tuple[int, int]],
    src_words: Sequence[int],
    trg_words: Sequence[int],
) -> list[tuple[int, int, bool]]:
    """Word links (source word, target word) -> the attention cells (target piece, source
    piece, sure) of every piece pair of the two words, for a heatmap overlay; a cell that
    two links share is sure if either is."""
    cells = dict.fromkeys(word_link_cells(sorted(possible), src_words, trg_words), False)
    cells.update(dict.fromkeys(word_link_cells(sorted(sure), src_words, trg_words), True))
    return [(row, column, is_sure) for (row, column), is_sure in sorted(cells.items())]


def word_attention(alphas: Tensor, src_words: Sequence[int], trg_words: Sequence[int]) -> Tensor:
    """alphas (T+1, S+1): target pieces and EOS x source pieces and EOS -> (W_trg, W_src)
    word attention, float64."""
    weights = alphas.double()[: len(trg_words), : len(src_words)]  # without the EOS row/col
    n_src, n_trg = max(src_words) + 1, max(trg_words) + 1
    src_map = torch.zeros(len(src_words), n_src, dtype=torch.float64)
    src_map[torch.arange(len(src_words)), torch.tensor(src_words)] = 1.0
    trg_map = torch.zeros(n_trg, len(trg_words), dtype=torch.float64)
    trg_map[torch.tensor(trg_words), torch.arange(len(trg_words))] = 1.0
    trg_map /= trg_map.sum(dim=1, keepdim=True)  # mean over a word's pieces
    return trg_map @ weights @ src_map


def extract_links(
    alphas: Tensor,
    src_words: Sequence[int],
    trg_words: Sequence[int],
    method: str = "argmax",
    threshold: float = THRESHOLD,
) -> list[tuple[int, int]]:
    """Word links (source word, target word) from one sentence's attention (see above)."""
    if not src_words or not trg_words:
        return []
    if method == "next":
        alphas = alphas[1:]  # row t: the step that has read target piece t
    words = word_attention(alphas, src_words, trg_words)  # (W_trg, W_src)
    if method == "threshold":
        pairs = (words >= threshold).nonzero().tolist()
        return sorted((int(j), int(i)) for i, j in pairs)
    best = words.argmax(dim=1).tolist()
    if method in ("intersect", "gdfa"):
        best_target = words.argmax(dim=0).tolist()  # each source word's most attending word
        if method == "intersect":
            return sorted((int(j), i) for i, j in enumerate(best) if best_target[j] == i)
        forward = {(int(j), i) for i, j in enumerate(best)}
        reverse = {(j, int(i)) for j, i in enumerate(best_target)}
        return sorted(grow_diag_final_and(forward, reverse))
    return sorted((int(j), i) for i, j in enumerate(best))


def grow_diag_final_and(forward: set[Link], reverse: set[Link]) -> set[Link]:
    """Koehn et al.'s symmetrisation: start from the intersection, add union links that touch
    a link already in (diagonal neighbours included) and align a word not yet aligned, until
    nothing changes; then add union links whose source and target words are both unaligned.
    ``forward`` and ``reverse`` are both (source, target) links."""
    union = forward | reverse
    links = forward & reverse
    sources, targets = {i for i, _ in links}, {j for _, j in links}  # the words aligned so far
    neighbours = [(-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)]

    def add(link: Link) -> None:
        links.add(link)
        sources.add(link[0])
        targets.add(link[1])

    grew = True
    while grew:
        grew = False
        for i, j in sorted(links):
            for di, dj in neighbours:
                candidate = (i + di, j + dj)
                if candidate in union and candidate not in links:
                    if candidate[0] not in sources or candidate[1] not in targets:
                        add(candidate)
                        grew = True
    for direction in (forward, reverse):  # final-and
        for i, j in sorted(direction):
            if i not in sources and j not in targets:
                add((i, j))
    return links


def hypothesis_links(
    tokenizer: Any,
    source: str,
    tokens: Sequence[int],
    alphas: Tensor | None,
    method: str = "argmax",
    threshold: float = THRESHOLD,
) -> list[tuple[int, int]]:
    """Links between the source's words and an output's words (``tokens``, its attention
    ``alphas``; the words as ``output_words`` reads them)."""
    if alphas is None:
        return []
    src_words = piece_words(tokenizer.src, source)
    trg_words = output_words(tokenizer, tokens)
    return extract_links(alphas, src_words, trg_words, method, threshold)


def output_words(tokenizer: Any, tokens: Sequence[int]) -> list[int]:
    """The word index of each piece of an output (``tokens``, without EOS): a target piece
    that starts with ``▁`` starts a word, as detokenisation makes it one."""
    words, word = [], -1
    for piece in tokenizer.trg_pieces(tokens):
        word += 1 if piece.startswith("▁") or word < 0 else 0
        words.append(word)
    return words


def attention_links(
    translator: Translator,
    sources: Sequence[str],
    targets: Sequence[str],
    decoding: DecodingConfig,
    method: str = "argmax",
    threshold: float = THRESHOLD,
    progress: Callable[[int], None] | None = None,
    use_attention: bool = False,
) -> tuple[list[list[Link]], list[Scored | None]]:
    """Each pair's word links while the model reads the target (none where either side is
    empty), and the forced results they come from: from the alignment head's weights when
    the model has one (nmt.model.aligner), unless ``use_attention``, else the attention."""
    results = translator.score(sources, targets, decoding, True, progress)
    out: list[list[Link]] = []
    for source, target, result in zip(sources, targets, results, strict=True):
        weights = None if result is None else aligning_weights(result, use_attention)
        if weights is None or not target.strip():
            out.append([])
            continue
        src_words = piece_words(translator.tokenizer.src, source)
        trg_words = piece_words(translator.tokenizer.trg, target)
        out.append(extract_links(weights, src_words, trg_words, method, threshold))
    return out, results


def aligning_weights(result: Scored, use_attention: bool = False) -> Tensor | None:
    """The weights a forced result aligns with: the alignment head's, where there are any
    and ``use_attention`` is off, else the attention's."""
    if result.alignment is not None and not use_attention:
        return result.alignment
    return result.alphas


def content_links(links: set[Link], mask: tuple[Sequence[bool], Sequence[bool]]) -> set[Link]:
    """The links between two content words (``mask``: source and target words' flags)."""
    return {(i, j) for i, j in links if mask[0][i] and mask[1][j]}


def content_reference(
    reference: ReferenceLinks, mask: tuple[Sequence[bool], Sequence[bool]]
) -> ReferenceLinks:
    """A reference's links between two content words."""
    return ReferenceLinks(
        content_links(reference.sure, mask), content_links(reference.possible, mask)
    )


def format_links(links: Sequence[tuple[int, int]]) -> str:
    """Pharaoh format: `i-j` for source word i and target word j, 0-based."""
    return " ".join(f"{i}-{j}" for i, j in links)


@dataclass
class ReferenceLinks:
    """One sentence's reference: sure links (``i-j``) and possible ones (``i?j`` or
    ``i-j`` of a possible-only file), the sure ones included in ``possible``."""

    sure: set[tuple[int, int]]
    possible: set[tuple[int, int]]


def parse_links(line: str, where: str) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """A Pharaoh line -> (sure, possible-only) links; ``i-j`` is sure, ``i?j`` possible."""
    sure: set[tuple[int, int]] = set()
    possible: set[tuple[int, int]] = set()
    for token in line.split():
        separator = "?" if "?" in token else "-"
        left, _, right = token.partition(separator)
        if not (left.isdigit() and right.isdigit()):
            raise ValueError(f"{where}: {token!r} is not a link i-j (or i?j for a possible one)")
        (possible if separator == "?" else sure).add((int(left), int(right)))
    return sure, possible


@dataclass
class AlignmentScores:
    """Corpus-level precision, recall and AER, and the counts behind them."""

    precision: float
    recall: float
    aer: float
    links: int
    sure: int
    possible: int
    sentences: int

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def score_alignments(
    hypotheses: Sequence[set[tuple[int, int]]], references: Sequence[ReferenceLinks]
) -> AlignmentScores:
    """Och & Ney's precision, recall and AER over all sentences."""
    a_and_s = a_and_p = a_total = s_total = p_total = 0
    for links, reference in zip(hypotheses, references, strict=True):
        a_and_s += len(links & reference.sure)
        a_and_p += len(links & reference.possible)
        a_total += len(links)
        s_total += len(reference.sure)
        p_total += len(reference.possible)
    precision = a_and_p / a_total if a_total else 0.0
    recall = a_and_s / s_total if s_total else 0.0
    total = a_total + s_total
    aer = 1.0 - (a_and_s + a_and_p) / total if total else 0.0
    return AlignmentScores(precision, recall, aer, a_total, s_total, p_total, len(references))
