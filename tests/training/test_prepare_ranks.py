"""Under torchrun only rank 0 prepares the corpus; the other ranks wait, then memory-map the
same prepared files (gloo, two processes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nmt.config import from_dict
from nmt.training.distributed import shutdown_distributed
from nmt.training.rundir import load_corpora_in_turn
from tests.synthetic import data_section, write_corpus
from tests.training.test_distributed import free_port, join_group, spawn


def _prepare(rank: int, world: int, port: int, root: Path) -> None:
    place, _ = join_group(rank, world, port)
    try:
        config = from_dict(
            {
                "data": data_section(root),
                "tokenizer": {"vocab_size": 40, "type": "bpe"},
                "run": {"dir": str(root / "run"), "tensorboard": False},
            }
        )
        corpora, tokenizer = load_corpora_in_turn(config, root / "run", None, place)
        report = {
            "built": corpora.built,
            "files": sorted(f["filename"] for f in corpora.train.rows.cache_files),
            "src_lengths": corpora.train.src_lengths.tolist(),
            "tokenizer": tokenizer.src_proto.hex(),
        }
        (root / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        shutdown_distributed(place)


def test_only_rank_0_prepares_and_both_read_the_same_files(tmp_path: Path) -> None:
    write_corpus(tmp_path, {"train": 300, "dev": 8})
    spawn(_prepare, 2, free_port(), tmp_path)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["built"] == ["train", "dev"] and one["built"] == []
    assert zero["files"] == one["files"] and zero["files"][0].startswith(str(tmp_path / "run"))
    assert zero["tokenizer"] == one["tokenizer"]
    assert np.array_equal(zero["src_lengths"], one["src_lengths"])
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "run/cache/prepared").iterdir())
    assert entries == ["dev", "tokenizer", "train"], "one entry each, no temporary left"
