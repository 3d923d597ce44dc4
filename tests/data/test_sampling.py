"""Subword regularisation: sampled segmentations of the training pairs, new every epoch, a
function of (seed, epoch, pair) alone; dev, test and translation stay deterministic."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from clirun import nmt, tiny_config, write_config

from nmt import checkpoint
from nmt.config import Config, from_dict
from nmt.data.prepare import load_corpora
from nmt.data.tokenizer import Tokenizer, train_sentencepiece
from nmt.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from tests.synthetic import data_section, write_corpus


def _lines() -> list[str]:
    """Pseudo-words of 1-4 syllables: enough ways to segment them for sampling to vary."""
    rng = random.Random(0)
    syllables = [c + v for c in "bdfklmnprst" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) for _ in range(400)]


LINES = _lines()
ROOT = Path(__file__).resolve().parents[2]
UNIGRAM_PROTO = train_sentencepiece(LINES, 150, "unigram", 1.0, 1000, seed=1)


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    proto = UNIGRAM_PROTO if request.param == "unigram" else None
    proto = proto or train_sentencepiece(LINES, 150, request.param, 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def test_a_sample_spells_the_same_text_and_depends_on_its_seed(tokenizer: Tokenizer) -> None:
    lines = LINES[:50]
    seeds = list(range(100, 150))
    first = tokenizer.sample("trg", lines, seeds, 0.1, -1)
    assert tokenizer.sample("trg", lines, seeds, 0.1, -1) == first
    assert tokenizer.decode_trg(first) == lines, "sampling changes the pieces, not the text"
    plain = tokenizer.encode_trg(lines)
    assert sum(a != b for a, b in zip(first, plain, strict=True)) > 10
    other = tokenizer.sample("trg", lines, [s + 1000 for s in seeds], 0.1, -1)
    assert other != first
    src = tokenizer.sample("src", lines[:3], seeds[:3], 0.1, -1)
    assert all(ids[-1] == EOS_ID and EOS_ID not in ids[:-1] for ids in src), "ends in EOS"


# Samples the test's lines in a new process: the sample of a seed must not depend on it.
SAMPLE_ELSEWHERE = """
import json, sys
from pathlib import Path
from nmt.data.tokenizer import Tokenizer
proto = Path(sys.argv[1]).read_bytes()
lines = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
print(json.dumps(Tokenizer(proto, proto).sample("trg", lines, list(range(len(lines))), 0.1, -1)))
"""


def test_a_seed_gives_the_same_sample_in_another_process(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """What a resumed run, another rank and a worker of the parallel map rely on.
    sentencepiece's own generator salts every seed with 4 bytes of entropy per process."""
    lines = LINES[:60]
    (tmp_path / "m.model").write_bytes(tokenizer.trg_proto)
    (tmp_path / "lines.json").write_text(json.dumps(lines), encoding="utf-8")
    here = tokenizer.sample("trg", lines, list(range(len(lines))), 0.1, -1)
    args = [str(tmp_path / "m.model"), str(tmp_path / "lines.json")]
    for _ in range(2):
        child = subprocess.run(
            [sys.executable, "-c", SAMPLE_ELSEWHERE, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        assert json.loads(child.stdout) == here


def _distribution(samples: list[list[int]]) -> dict[tuple[int, ...], float]:
    counts = Counter(tuple(ids) for ids in samples)
    return {ids: count / len(samples) for ids, count in counts.items()}


@pytest.mark.parametrize("nbest", [-1, 8])
def test_the_samples_follow_sentencepieces_distribution(tokenizer: Tokenizer, nbest: int) -> None:
    """The same algorithm on the same model: over 10,000 seeds each segmentation of a line
    comes up as often as under sentencepiece's own sampling (total variation under 0.05;
    two such samples of sentencepiece's differ by 0.02 at most)."""
    if nbest > 0 and tokenizer.trg_proto != UNIGRAM_PROTO:
        pytest.skip("n-best sampling is the unigram model's")
    line, draws, alpha = "nerebo na", 10_000, 0.1
    ours = tokenizer.sample("trg", [line] * draws, list(range(draws)), alpha, nbest)
    theirs = []
    for seed in range(draws):
        spm.set_random_generator_seed(seed)
        theirs.append(
            tokenizer.trg.encode(line, enable_sampling=True, alpha=alpha, nbest_size=nbest)
        )
    a, b = _distribution(ours), _distribution(theirs)
    assert len(a) > 5, "the line has several segmentations"
    assert sum(abs(a.get(k, 0) - b.get(k, 0)) for k in a.keys() | b.keys()) / 2 < 0.05


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_without_randomness_the_sample_is_sentencepieces_segmentation(
    tmp_path: Path, kind: str
) -> None:
    """One best path (unigram) or no merge dropped (BPE) is sentencepiece's deterministic
    encoding, on a model with user-defined pieces and byte fallback, of text with characters
    it has never seen: the lattice, the scores and the unknown characters as it has them."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES),
        model_prefix=str(tmp_path / "m"),
        vocab_size=400,
        model_type=kind,
        user_defined_symbols=["<sep>", "kala"],
        byte_fallback=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        minloglevel=2,
    )
    proto = (tmp_path / "m.model").read_bytes()
    tokenizer = Tokenizer(proto, proto)
    lines = [*LINES[:100], "kalakala <sep>bedu ŋ東京 ñandú", "  spaced   out  ", "", "Zürich"]
    deterministic = [tokenizer.trg.encode(line) for line in lines]
    nbest = 1 if kind == "unigram" else -1
    assert tokenizer.sample("trg", lines, list(range(len(lines))), 0.0, nbest) == deterministic
    assert any(tokenizer.trg.is_byte(i) for ids in deterministic for i in ids)


def _config(root: Path, **tokenizer: object) -> Config:
    root.mkdir(parents=True, exist_ok=True)
    write_corpus(root, {"train": 300, "dev": 8})
    return from_dict(
        {
            "data": data_section(root),
            "tokenizer": {"vocab_size": 40, "type": "unigram", **tokenizer},
            "run": {"dir": str(root / "run"), "tensorboard": False},
        }
    )


def _ids(corpus: object, count: int = 300) -> list[list[int]]:
    every = np.arange(min(count, len(corpus)))  # type: ignore[arg-type]
    batch = corpus.batch(every)  # type: ignore[attr-defined]
    return [row[row != 0].tolist() for row in batch.trg_out]


def test_every_epoch_is_sampled_anew_and_the_same_on_every_call(tmp_path: Path) -> None:
    config = _config(tmp_path, sampling_alpha=0.3)
    corpora, _ = load_corpora(config, tmp_path / "run", None)
    assert corpora.sampler is not None
    zero, one = corpora.for_epoch(0), corpora.for_epoch(1)
    assert _ids(zero) != _ids(one)
    assert _ids(corpora.for_epoch(0)) == _ids(zero), "an epoch's sample is reproducible"
    assert _ids(zero) != _ids(corpora.train) and len(zero) == len(corpora.train)
    entries = [p.name for p in (tmp_path / "run/cache/prepared").glob("sampled*")]
    assert len(entries) == 1 and entries[0].startswith("sampled0-"), "only the latest kept"


def test_the_sample_does_not_depend_on_processes(tmp_path: Path) -> None:
    one = _config(tmp_path / "a", sampling_alpha=0.3)
    two = from_dict({**one.model_dump(), "data": {**one.data.model_dump(), "num_proc": 2}})
    a, _ = load_corpora(one, tmp_path / "a/run", None)
    b, _ = load_corpora(two, tmp_path / "b/run", None)
    assert _ids(a.for_epoch(3)) == _ids(b.for_epoch(3))


def test_dev_and_the_deterministic_split_are_not_sampled(tmp_path: Path) -> None:
    plain, _ = load_corpora(_config(tmp_path / "p"), tmp_path / "p/run", None)
    sampled, _ = load_corpora(_config(tmp_path / "s", sampling_alpha=0.3), tmp_path / "s/run", None)
    assert sampled.dev_src_ids == plain.dev_src_ids
    assert _ids(sampled.dev) == _ids(plain.dev) and _ids(sampled.train) == _ids(plain.train)
    assert plain.sampler is None and plain.for_epoch(5) is plain.train


@pytest.mark.parametrize(
    ("tokenizer", "expected"),
    [
        ({"sampling_alpha": 0}, "tokenizer.sampling_alpha: got 0"),
        ({"sampling_alpha": 1.5}, "tokenizer.sampling_alpha: got 1.5"),
        ({"sampling_alpha": 0.1, "sampling_nbest": 1}, "tokenizer.sampling_nbest: 1 would not"),
        ({"type": "bpe", "sampling_alpha": 1.0}, "tokenizer.sampling_alpha: 1 would drop"),
        ({"type": "bpe", "sampling_alpha": 0.1, "sampling_nbest": 8}, "only unigram"),
    ],
)
def test_bad_sampling_settings_are_one_line(
    corpus: Path, tmp_path: Path, tokenizer: dict, expected: str
) -> None:
    config = tiny_config(corpus)
    config["tokenizer"].update(tokenizer)
    config["run"] = {"dir": str(tmp_path / "run"), "tensorboard": False}
    result = nmt("train", str(write_config(tmp_path / "c.yaml", config)))
    assert result.code == 2 and expected in result.error and "\n" not in result.error.strip()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "alpha"), [("unigram", 0.3), ("bpe", 0.1)])
def test_a_tiny_model_still_learns_with_sampled_segmentations(
    tmp_path: Path, kind: str, alpha: float
) -> None:
    """The reverse-and-upper-case task with subword regularisation on: dev BLEU (greedy,
    deterministic segmentation) climbs past 90 (97.8 and 98.2 without it)."""
    write_corpus(tmp_path, {"train": 1500, "dev": 60})
    config = {
        "data": data_section(tmp_path),
        "tokenizer": {"vocab_size": 60, "type": kind, "sampling_alpha": alpha},
        "model": {
            "embedding_size": 32,
            "embedding_dropout": 0.0,
            "encoder": {"hidden_size": 32, "dropout": 0.0},
            "decoder": {"style": "luong", "hidden_size": 32, "input_feeding": False, "dropout": 0},
            "attention": {"score": "general"},
        },
        "training": {"epochs": 12, "batch_tokens": 600, "learning_rate": 0.005, "seed": 3},
        "run": {"dir": str(tmp_path / "run"), "tensorboard": False},
    }
    result = nmt("train", str(write_config(tmp_path / "c.yaml", config)), "--quiet")
    assert result.code == 0, result.error
    log = (tmp_path / "run/train.log").read_text(encoding="utf-8")
    assert log.count("subword segmentations sampled") == 12
    best = checkpoint.load(tmp_path / "run/best.pt")["progress"]["best_score"]
    assert best > 90, log[-2000:]
