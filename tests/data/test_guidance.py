"""Guided alignment's data side: word links -> piece cells -> per-batch attention targets,
through the prepared store, with its bad-input paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import nmt, tiny_config, write_config

from nmt.config import from_dict
from nmt.data.guidance import guide_matrix, parse_pharaoh, word_link_cells
from nmt.data.prepare import load_corpora
from nmt.data.tokenizer import piece_words
from nmt.errors import DataError
from tests.synthetic import data_section, write_corpus


def test_parse_pharaoh_takes_sure_and_possible_links() -> None:
    assert parse_pharaoh("0-1 2?2 10-3", "x") == [(0, 1), (2, 2), (10, 3)]
    assert parse_pharaoh("", "x") == []
    with pytest.raises(ValueError, match="here: '1-a'"):
        parse_pharaoh("0-0 1-a", "here")


def test_word_links_become_every_piece_pair_of_the_two_words() -> None:
    """Source pieces [w0, w0, w1], target pieces [w0, w1, w1]: link 0-1 covers target
    pieces 1 and 2 with source pieces 0 and 1; a link to a missing word covers nothing."""
    cells = word_link_cells([(0, 1), (1, 0), (5, 0)], [0, 0, 1], [0, 1, 1])
    assert cells == [(0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_guide_rows_are_distributions_or_zero() -> None:
    """Pair 0: target piece 1 -> source pieces 0 and 2 (1/2 each), target piece 0 -> 1;
    pair 1: no links. Padded to (2, 3, 4)."""
    guide = guide_matrix([[1, 0, 1, 2, 0, 1], []], steps=3, length=4)
    expected = torch.zeros(2, 3, 4)
    expected[0, 1, 0] = expected[0, 1, 2] = 0.5
    expected[0, 0, 1] = 1.0
    assert torch.equal(guide, expected)


def _guided(root: Path, lines: list[str] | None = None, **training: object) -> object:
    write_corpus(root, {"train": 200, "dev": 8})
    src = (root / "train.src").read_text(encoding="utf-8").splitlines()
    if lines is None:
        lines = [
            " ".join(f"{k}-{len(s.split()) - 1 - k}" for k in range(len(s.split()))) for s in src
        ]
    (root / "train.align").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return from_dict(
        {
            "data": data_section(root),
            "tokenizer": {"vocab_size": 40, "type": "bpe"},
            "training": {"guided_alignment": str(root / "train.align"), **training},
        }
    )


def test_batches_carry_the_targets_of_their_pairs(tmp_path: Path) -> None:
    """Each batch's guide, recomputed by hand from the alignment file and the tokenizer:
    the reversal task aligns source word k with target word n-1-k."""
    corpora, tokenizer = load_corpora(_guided(tmp_path), tmp_path / "run", None)
    src = (tmp_path / "train.src").read_text(encoding="utf-8").splitlines()
    trg = (tmp_path / "train.trg").read_text(encoding="utf-8").splitlines()
    indices = np.arange(10)
    batch = corpora.train.batch(indices)
    assert batch.guide is not None
    assert batch.guide.shape == (10, batch.trg_out.size(1), batch.src.size(1))
    for b, i in enumerate(indices):
        row = int(corpora.train.row_ids[i])
        n = len(src[row].split())
        links = [(k, n - 1 - k) for k in range(n)]
        cells = word_link_cells(
            links, piece_words(tokenizer.src, src[row]), piece_words(tokenizer.trg, trg[row])
        )
        flat = [x for cell in cells for x in cell]
        expected = guide_matrix([flat], batch.trg_out.size(1), batch.src.size(1))[0]
        assert torch.equal(batch.guide[b], expected)
        assert batch.guide[b, len(tokenizer.encode_trg([trg[row]])[0])].sum() == 0, "EOS row"


def test_a_link_outside_its_pair_names_the_line(tmp_path: Path) -> None:
    config = _guided(tmp_path)
    path = tmp_path / "train.align"
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[6] = "0-0 0-40"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path} line 7: link 0-40 is outside the pair's"):
        load_corpora(config, tmp_path / "run", None)


def test_an_alignment_of_other_length_is_refused(tmp_path: Path) -> None:
    config = _guided(tmp_path, lines=["0-0"] * 199)
    with pytest.raises(DataError, match="has 199 lines but data.train .* has 200 pairs"):
        load_corpora(config, tmp_path / "run", None)


@pytest.mark.parametrize(
    ("training", "tokenizer", "expected"),
    [
        ({"guided_alignment": "no/such.align"}, {}, "training.guided_alignment: no/such.align"),
        (
            {"guided_alignment": "x.align"},
            {"type": "unigram", "sampling_alpha": 0.2},
            "use one of the two",
        ),
        ({"guided_alignment_weight": -1}, {}, "training.guided_alignment_weight: got -1"),
    ],
)
def test_bad_guided_alignment_settings_are_one_line(
    corpus: Path, tmp_path: Path, training: dict, tokenizer: dict, expected: str
) -> None:
    config = tiny_config(corpus)
    config["training"].update(training)
    config["tokenizer"].update(tokenizer)
    config["run"] = {"dir": str(tmp_path / "run"), "tensorboard": False}
    result = nmt("train", str(write_config(tmp_path / "c.yaml", config)))
    assert result.code == 2 and expected in result.error
    assert not (tmp_path / "run").exists()
