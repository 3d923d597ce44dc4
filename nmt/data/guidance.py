"""Word alignments as attention targets (guided alignment, Chen et al. 2016): Pharaoh links
between words -> the attention cells of their sentencepiece pieces -> per batch, a target
distribution over the source pieces for each target piece that has links.

A target piece's row of the target matrix G is uniform over the source pieces of the words
its word is linked to; the rows of target pieces without links, of EOS and of padding are
zero and take no part in the loss (nmt.model.seq2seq.guided_alignment_loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def parse_pharaoh(line: str, where: str) -> list[tuple[int, int]]:
    """``"0-1 2-2 3?4"`` -> [(0, 1), (2, 2), (3, 4)]: (source word, target word) links;
    a possible link (``?``) guides like a sure one."""
    links = []
    for token in line.split():
        separator = "?" if "?" in token else "-"
        left, _, right = token.partition(separator)
        if not (left.isdigit() and right.isdigit()):
            raise ValueError(f"{where}: {token!r} is not a link i-j (or i?j)")
        links.append((int(left), int(right)))
    return links


def word_link_cells(
    links: Sequence[tuple[int, int]], src_words: Sequence[int], trg_words: Sequence[int]
) -> list[tuple[int, int]]:
    """(source word, target word) links -> sorted (target piece, source piece) cells: every
    piece of the target word with every piece of the source word. ``src_words[s]`` and
    ``trg_words[t]`` are the words of pieces s and t (nmt.data.tokenizer.piece_words)."""
    src_pieces: dict[int, list[int]] = {}
    for piece, word in enumerate(src_words):
        src_pieces.setdefault(word, []).append(piece)
    trg_pieces: dict[int, list[int]] = {}
    for piece, word in enumerate(trg_words):
        trg_pieces.setdefault(word, []).append(piece)
    cells = {
        (row, column)
        for i, j in links
        for row in trg_pieces.get(j, [])
        for column in src_pieces.get(i, [])
    }
    return sorted(cells)


def guide_matrix(cells: Sequence[Sequence[int]], steps: int, length: int) -> Tensor:
    """A batch's target distributions (B, T, S): ``cells[b]`` is pair b's flat list
    (t0, s0, t1, s1, ...); rows normalised to sum 1, rows without cells stay 0."""
    guide = torch.zeros(len(cells), steps, length)
    for b, flat in enumerate(cells):
        if len(flat):
            pairs = torch.as_tensor(flat, dtype=torch.long).view(-1, 2)
            guide[b, pairs[:, 0], pairs[:, 1]] = 1.0
    total = guide.sum(dim=-1, keepdim=True)
    return guide / total.clamp(min=1.0)
