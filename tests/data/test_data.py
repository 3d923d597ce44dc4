"""Corpora, batching and the tokenizer: every format, every failure path, the bucketing
invariants."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nmt.config import DataConfig
from nmt.data.batching import (
    batch_shape,
    bucket_batches,
    length_sorted_batches,
    make_batch,
    pad,
    padding_fraction,
    shape_length,
    shaped_batches,
)
from nmt.data.corpus import read_pairs
from nmt.data.store import Encode, Store, TokenizedCorpus, prepare
from nmt.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    load_model_file,
    train_sentencepiece,
)
from nmt.errors import DataError

# ----------------------------------------------------------------------------- bucketing


def _realistic_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal target lengths (median ~20, tail to 200), source ~1.1x the target."""
    rng = np.random.default_rng(seed)
    trg = np.clip(rng.lognormal(3.0, 0.6, n).astype(np.int64), 1, 200)
    src = np.clip((trg * rng.normal(1.1, 0.15, n)).astype(np.int64), 1, 250)
    return src, trg


def test_bucket_batches_cover_every_index_once_within_budget() -> None:
    src, trg = _realistic_lengths(3000, seed=0)
    src[[5, 77]] = [900, 10]  # over-long items, on either side
    trg[[5, 77]] = [3, 1200]
    batch_tokens = 800
    batches = bucket_batches(src, trg, batch_tokens, seed=1, epoch=0)
    everything = np.concatenate(batches)
    assert sorted(everything.tolist()) == list(range(3000))
    for batch in batches:
        padded = max(int(src[batch].max()), int(trg[batch].max())) * len(batch)
        assert padded <= batch_tokens or len(batch) == 1
    singles = {int(b[0]) for b in batches if len(b) == 1}
    assert {5, 77} <= singles


def test_bucket_batches_are_full() -> None:
    src, trg = _realistic_lengths(5000, seed=2)
    batch_tokens = 2000
    batches = bucket_batches(src, trg, batch_tokens, seed=1, epoch=0)
    used = sum(max(int(src[b].max()), int(trg[b].max())) * len(b) for b in batches)
    assert used / (len(batches) * batch_tokens) > 0.9


def test_bucket_batches_deterministic_per_seed_and_epoch() -> None:
    src, trg = _realistic_lengths(2000, seed=3)

    def run(seed: int, epoch: int) -> list[list[int]]:
        return [b.tolist() for b in bucket_batches(src, trg, 500, seed=seed, epoch=epoch)]

    assert run(1, 0) == run(1, 0)
    assert run(1, 3) == run(1, 3)
    assert run(1, 0) != run(1, 1)
    assert run(1, 0) != run(2, 0)
    # a new epoch reshuffles the batch order, and ties inside equal lengths
    assert [b[0] for b in run(1, 0)] != [b[0] for b in run(1, 1)]


def test_bucket_batches_group_similar_lengths() -> None:
    src, trg = _realistic_lengths(20000, seed=4)
    batches = bucket_batches(src, trg, 4000, seed=1, epoch=0)
    bucketed = padding_fraction(batches, src, trg)
    rng = np.random.default_rng(0)
    shuffled = np.array_split(rng.permutation(len(src)), len(batches))
    random = padding_fraction(shuffled, src, trg)
    assert bucketed < 0.08 and random > 0.5  # sorted by target alone: about 0.10


def test_bucket_batches_cut_along_the_longer_side() -> None:
    # the budget counts sentences x longest side: batches are consecutive runs of that side,
    # so their ranges of it never overlap (sorting by target length alone breaks this)
    src, trg = _realistic_lengths(5000, seed=5)
    batches = bucket_batches(src, trg, 2000, seed=1, epoch=0)
    longer = np.maximum(src, trg)
    ranges = sorted((int(longer[b].min()), int(longer[b].max())) for b in batches)
    assert all(high <= next_low for (_, high), (next_low, _) in itertools.pairwise(ranges))


def test_padding_fraction_by_hand() -> None:
    src, trg = np.array([3, 5, 2]), np.array([4, 4, 1])
    # real 3+5+2 + 4+4+1 = 19; padded (5*2 + 2*1) + (4*2 + 1*1) = 21
    assert padding_fraction([np.array([0, 1]), np.array([2])], src, trg) == pytest.approx(
        1 - 19 / 21
    )
    assert padding_fraction([np.array([0]), np.array([1]), np.array([2])], src, trg) == 0.0


# ----------------------------------------------------------------------------- batches


def test_make_batch_layout() -> None:
    src_ids = [[7, 8, 9, EOS_ID], [5, EOS_ID]]
    trg_ids = [[11], [12, 13, 14]]
    batch = make_batch(src_ids, trg_ids, np.array([4, 9]))
    assert batch.src.tolist() == [[7, 8, 9, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.src_lengths.tolist() == [4, 2]
    assert batch.trg_in.tolist() == [[BOS_ID, 11, PAD_ID, PAD_ID], [BOS_ID, 12, 13, 14]]
    assert batch.trg_out.tolist() == [[11, EOS_ID, PAD_ID, PAD_ID], [12, 13, 14, EOS_ID]]
    assert batch.n_target_tokens == 2 + 4
    assert batch.indices.tolist() == [4, 9]


# ----------------------------------------------------------------------------- corpora


def _lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


ES = ["hola mundo", "buenos días", "adiós"]
EN = ["hello world", "good morning", "goodbye"]


def _pairs(rows) -> list[tuple[str, str]]:
    return list(zip(rows["src"], rows["trg"], strict=True))


def test_read_text_pair(tmp_path: Path) -> None:
    _lines(tmp_path / "train.es", ES)
    _lines(tmp_path / "train.en", EN)
    rows = read_pairs(DataConfig(format="text"), str(tmp_path / "train"), tmp_path / "cache")
    assert _pairs(rows) == list(zip(ES, EN, strict=True))


def test_read_text_pair_gzip(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "train.es.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in ES))
    _lines(tmp_path / "train.en", EN)  # one side compressed, the other not
    rows = read_pairs(DataConfig(format="text"), str(tmp_path / "train"), tmp_path / "cache")
    assert _pairs(rows) == list(zip(ES, EN, strict=True))


def test_read_text_keeps_unicode_line_separators_in_the_line(tmp_path: Path) -> None:
    (tmp_path / "c.es").write_bytes("a\u2028b\r\nc\u0085d\x0ce\r\n".encode())
    (tmp_path / "c.en").write_bytes(b"one\ntwo")  # no final newline
    rows = read_pairs(DataConfig(format="text"), str(tmp_path / "c"), tmp_path / "cache")
    assert _pairs(rows) == [("a\u2028b", "one"), ("c\u0085d\x0ce", "two")]


def test_mismatched_line_counts_name_both_files(tmp_path: Path) -> None:
    _lines(tmp_path / "train.es", ES)
    _lines(tmp_path / "train.en", EN[:2])
    with pytest.raises(DataError) as info:
        read_pairs(DataConfig(format="text"), str(tmp_path / "train"), tmp_path / "cache")
    message = str(info.value)
    assert "train.es" in message and "train.en" in message
    assert message.startswith(f"{tmp_path / 'train.es'}:3: no partner line")
    assert "train.en ends after line 2 but" in message


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_missing_file(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(DataError, match="no such file") as info:
        read_pairs(DataConfig(format=fmt), str(tmp_path / "absent"), tmp_path / "cache")
    assert "absent" in str(info.value)


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.es").write_bytes(
        b"hola\nbuenos d\xedas\nadi\xc3\xb3s\n"
    )  # latin-1 on line 2
    _lines(tmp_path / "train.en", EN)
    with pytest.raises(DataError) as info:
        read_pairs(DataConfig(format="text"), str(tmp_path / "train"), tmp_path / "cache")
    assert f"{tmp_path / 'train.es'}:2" in str(info.value)


def test_invalid_utf8_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "train.es").write_bytes(b"hola\nbuenos d\xedas\n")
    _lines(tmp_path / "train.en", EN[:2])
    with pytest.raises(DataError, match="train.es"):
        read_pairs(DataConfig(format="text"), str(tmp_path / "train"), tmp_path / "cache")


def test_read_tsv(tmp_path: Path) -> None:
    path = _lines(tmp_path / "c.tsv", [f"{s}\t{t}" for s, t in zip(ES, EN, strict=True)])
    rows = read_pairs(DataConfig(format="tsv"), str(path), tmp_path / "cache")
    assert _pairs(rows) == list(zip(ES, EN, strict=True))


def test_bad_tsv_line_names_file_and_line(tmp_path: Path) -> None:
    path = _lines(tmp_path / "c.tsv", ["a\tb", "c\td", "only one field", "e\tf"])
    with pytest.raises(DataError) as info:
        read_pairs(DataConfig(format="tsv"), str(path), tmp_path / "cache")
    assert f"{path}:3" in str(info.value)
    path = _lines(tmp_path / "d.tsv", ["a\tb", "x\ty\tz"])
    with pytest.raises(DataError, match=f"{path}:2"):
        read_pairs(DataConfig(format="tsv"), str(path), tmp_path / "cache")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def test_read_jsonl_flat_fields(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "c.jsonl",
        [{"es": s, "en": t, "id": i} for i, (s, t) in enumerate(zip(ES, EN, strict=True))],
    )
    rows = read_pairs(DataConfig(format="jsonl"), str(path), tmp_path / "cache")
    assert _pairs(rows) == list(zip(ES, EN, strict=True))
    named = _jsonl(
        tmp_path / "d.jsonl", [{"source": s, "target": t} for s, t in zip(ES, EN, strict=True)]
    )
    cfg = DataConfig(format="jsonl", src_field="source", trg_field="target")
    assert _pairs(read_pairs(cfg, str(named), tmp_path / "cache")) == list(zip(ES, EN, strict=True))


def test_read_jsonl_translation_style(tmp_path: Path) -> None:
    rows = [{"translation": {"en": t, "es": s}} for s, t in zip(ES, EN, strict=True)]
    path = _jsonl(tmp_path / "c.jsonl", rows)
    pairs = read_pairs(DataConfig(format="jsonl"), str(path), tmp_path / "cache")
    assert _pairs(pairs) == list(zip(ES, EN, strict=True))
    reverse = DataConfig(format="jsonl", src_lang="en", trg_lang="es")
    assert _pairs(read_pairs(reverse, str(path), tmp_path / "cache")) == list(
        zip(EN, ES, strict=True)
    )


def test_jsonl_without_the_fields_lists_what_it_found(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "c.jsonl", [{"de": "hallo", "fr": "salut"}])
    with pytest.raises(DataError) as info:
        read_pairs(DataConfig(format="jsonl"), str(path), tmp_path / "cache")
    message = str(info.value)
    assert "'es'" in message and "de" in message and "fr" in message and "src_field" in message


def _prepare(rows, tokenizer, tmp_path, max_length=None, keep_text=False):  # type: ignore[no-untyped-def]
    encode = Encode(tokenizer, max_length, keep_text)
    return prepare(Store(tmp_path / "store"), "split", {}, lambda: rows, encode, 1, False)


def test_empty_pairs_are_dropped_and_counted(tmp_path: Path, tokenizer: Tokenizer) -> None:
    _lines(tmp_path / "c.es", ["uno", "", "tres", "  ", "cinco"])
    _lines(tmp_path / "c.en", ["one", "two", "", "four", "five"])
    rows = read_pairs(DataConfig(format="text"), str(tmp_path / "c"), tmp_path / "cache")
    prepared, built = _prepare(rows, tokenizer, tmp_path, keep_text=True)
    assert built
    assert prepared.counts == {"pairs": 5, "kept": 2, "empty": 3, "long": 0}
    assert prepared.text(10) == (["uno", "cinco"], ["one", "five"])


# ----------------------------------------------------------------------------- tokenizer

WORDS = (
    "el la los gato perro casa sol luna agua fuego the a cat dog house sun moon water fire".split()
)


def _synthetic_text(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, 9))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    proto = train_sentencepiece(_synthetic_text(), 40, "unigram", 1.0, 1000, seed=1)
    return Tokenizer(proto, proto)


def test_special_ids(tokenizer: Tokenizer) -> None:
    sp = tokenizer.src
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert len({PAD_ID, UNK_ID, BOS_ID, EOS_ID}) == 4
    assert tokenizer.joint and tokenizer.src_vocab_size == tokenizer.trg_vocab_size
    assert 20 <= tokenizer.src_vocab_size <= 40


def test_encode_decode_round_trip(tokenizer: Tokenizer) -> None:
    lines = ["el gato la luna", "the dog house", "agua fuego sol"]
    src = tokenizer.encode_src(lines)
    trg = tokenizer.encode_trg(lines)
    for s, t in zip(src, trg, strict=True):
        assert s[-1] == EOS_ID and s[:-1] == t
        assert not {PAD_ID, BOS_ID, EOS_ID} & set(t)
    assert tokenizer.decode_trg(trg) == lines
    assert UNK_ID in tokenizer.encode_trg(["el ñu"])[0]  # a character never seen in training


def test_state_dict_round_trip(tokenizer: Tokenizer, tmp_path: Path) -> None:
    copy = Tokenizer.from_state_dict(tokenizer.state_dict())
    lines = ["los perros", "the sun and the moon"]
    assert copy.encode_src(lines) == tokenizer.encode_src(lines)
    assert copy.joint
    tokenizer.save(tmp_path)
    assert load_model_file(tmp_path / "spm.model") == tokenizer.src_proto


def test_separate_vocabularies(tmp_path: Path) -> None:
    text = _synthetic_text(200)
    src = train_sentencepiece([t for t in text if "el" in t], 30, "bpe", 1.0, 1000, seed=1)
    trg = train_sentencepiece(text, 40, "unigram", 1.0, 1000, seed=1)
    tok = Tokenizer(src, trg)
    assert not tok.joint and tok.trg.eos_id() == EOS_ID
    again = Tokenizer.from_state_dict(tok.state_dict())
    assert again.encode_trg(["the cat"]) == tok.encode_trg(["the cat"])
    tok.save(tmp_path)
    assert (tmp_path / "spm.src.model").read_bytes() == src
    assert (tmp_path / "spm.trg.model").read_bytes() == trg


def test_training_is_deterministic() -> None:
    text = _synthetic_text(150)
    assert train_sentencepiece(text, 30, "unigram", 1.0, 100, seed=3) == train_sentencepiece(
        text, 30, "unigram", 1.0, 100, seed=3
    )


def test_empty_training_text_is_a_data_error() -> None:
    with pytest.raises(DataError, match="empty"):
        train_sentencepiece(["", "   "], 30, "unigram", 1.0, 100, seed=1)


def test_not_a_sentencepiece_model(tmp_path: Path) -> None:
    with pytest.raises(DataError):
        load_model_file(tmp_path / "absent.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="junk.model"):
        load_model_file(tmp_path / "junk.model")


def test_corpus_to_batches(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """read -> tokenise, dropping empty and long pairs -> bucket -> batch, ids decoding back."""
    es = ["el gato", "", "la casa del sol y la luna y el agua", "los perros"]
    en = ["the cat", "x", "the house of the sun and the moon and the water", "the dogs"]
    _lines(tmp_path / "c.es", es)
    _lines(tmp_path / "c.en", en)
    rows = read_pairs(DataConfig(format="text"), str(tmp_path / "c"), tmp_path / "cache")
    long_trg = len(tokenizer.encode_trg([en[2]])[0])
    prepared, _ = _prepare(rows, tokenizer, tmp_path, max_length=long_trg - 1)
    assert prepared.counts == {"pairs": 4, "kept": 2, "empty": 1, "long": 1}
    prepared, _ = _prepare(rows, tokenizer, tmp_path / "all")
    assert prepared.counts == {"pairs": 4, "kept": 3, "empty": 1, "long": 0}
    corpus = TokenizedCorpus(prepared)
    assert corpus.src_lengths.tolist() == [
        len(s) for s in tokenizer.encode_src([es[0], es[2], es[3]])
    ]
    batches = bucket_batches(corpus.src_lengths, corpus.trg_lengths, 10_000, seed=1, epoch=0)
    (only,) = batches
    batch = corpus.batch(np.sort(only))
    assert batch.src.shape == (3, int(corpus.src_lengths.max()))
    assert batch.trg_in.shape == batch.trg_out.shape == (3, int(corpus.trg_lengths.max()))
    targets = [row[row != PAD_ID][:-1].tolist() for row in batch.trg_out]
    assert tokenizer.decode_trg(targets) == [en[0], en[2], en[3]]


def test_a_missing_line_a_million_lines_in_names_file_and_line(tmp_path: Path) -> None:
    """At scale too: the error points at the first line without a partner."""
    lines = b"".join(b"frase %d\n" % i for i in range(1_000_000))
    (tmp_path / "big.es").write_bytes(lines + b"frase extra\n")
    (tmp_path / "big.en").write_bytes(lines)
    with pytest.raises(DataError) as info:
        read_pairs(DataConfig(format="text"), str(tmp_path / "big"), tmp_path / "cache")
    assert str(info.value).startswith(f"{tmp_path / 'big.es'}:1000001: no partner line: ")
    assert "big.en ends after line 1,000,000" in str(info.value)


def _cut_walk(
    order: np.ndarray, sizes: np.ndarray, max_tokens: int | None, max_sentences: int | None
) -> list[np.ndarray]:
    """The reference cut: walk ``order`` one position at a time, closing the batch when the
    next sentence would take it over ``max_sentences`` or its padded size over ``max_tokens``."""
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for position, index in enumerate(order):
        count = position - start + 1
        longest_if_added = max(longest, int(sizes[index]))
        full = (max_sentences is not None and count > max_sentences) or bool(
            max_tokens and longest_if_added * count > max_tokens
        )
        if position > start and full:
            batches.append(order[start:position])
            longest_if_added = int(sizes[index])
            start = position
        longest = longest_if_added
    if start < len(order):
        batches.append(order[start:])
    return batches


def test_the_vectorised_cut_gives_the_plain_walks_batches() -> None:
    """``_cut`` (a vectorised look ahead over sorted sizes) against the plain walk."""
    from nmt.data.batching import _cut

    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        sizes = rng.integers(1, int(rng.integers(2, 250)), n)
        order = np.argsort(sizes, kind="stable")
        tokens = int(rng.integers(1, 2500)) if trial % 4 else None
        sentences = int(rng.integers(1, 40)) if trial % 3 == 0 or tokens is None else None
        fast = _cut(order, sizes, tokens, sentences)
        plain = _cut_walk(order, sizes, tokens, sentences)
        assert [b.tolist() for b in fast] == [b.tolist() for b in plain], (tokens, sentences)


def test_shape_lengths_by_hand() -> None:
    got = [shape_length(n) for n in (1, 8, 9, 64, 65, 128, 129, 256, 257, 900)]
    assert got == [8, 8, 16, 64, 80, 128, 160, 256, 320, 960]


def test_shaped_batches_cover_every_index_once_with_one_shape_per_length_class() -> None:
    src, trg = _realistic_lengths(4000, seed=3)
    src[5], trg[77] = 900, 1200  # over the budget alone: a batch of one row
    batch_tokens = 1000
    batches = shaped_batches(src, trg, batch_tokens, seed=1, epoch=0)
    assert sorted(np.concatenate(batches).tolist()) == list(range(4000))
    shapes: dict[int, set[tuple[int, int]]] = {}
    for batch in batches:
        rows, length = batch_shape(src[batch], trg[batch], batch_tokens)
        assert len(batch) <= rows
        assert max(src[batch].max(), trg[batch].max()) <= length
        assert rows * length <= batch_tokens or rows == 1
        shapes.setdefault(length, set()).add((rows, length))
    assert all(len(s) == 1 for s in shapes.values())
    assert len(shapes) <= 20  # few graphs to capture
    # every class but its last batch is full
    full = [len(b) == batch_shape(src[b], trg[b], batch_tokens)[0] for b in batches]
    assert sum(not f for f in full) <= len(shapes)
    again = shaped_batches(src, trg, batch_tokens, seed=1, epoch=0)
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]
    other = shaped_batches(src, trg, batch_tokens, seed=1, epoch=1)
    assert [b.tolist() for b in other] != [b.tolist() for b in batches]
    # the padding cost, against the bucketed batches'
    shaped = padding_fraction(batches, src, trg, batch_tokens)
    bucketed = padding_fraction(bucket_batches(src, trg, batch_tokens, 1, 0), src, trg)
    assert bucketed < shaped < bucketed + 0.25


def test_a_padded_batch_keeps_its_rows_and_adds_empty_ones() -> None:
    batch = make_batch([[5, 6, 2], [7, 2]], [[8], [9, 10, 11]], np.array([3, 4]))
    padded = batch.padded(3, 8)
    assert padded.src.shape == padded.trg_in.shape == padded.trg_out.shape == (3, 8)
    assert padded.src[:2, :3].tolist() == batch.src.tolist()
    assert padded.src[2].tolist() == [EOS_ID] + [PAD_ID] * 7
    assert padded.src_lengths.tolist() == [3, 2, 1]
    assert padded.trg_in[2].tolist() == [BOS_ID] + [PAD_ID] * 7
    assert padded.trg_out[:2, :4].tolist() == batch.trg_out.tolist()
    assert not padded.trg_out[2].ne(PAD_ID).any() and not padded.trg_out[:, 4:].ne(PAD_ID).any()
    assert padded.n_target_tokens == batch.n_target_tokens
    assert padded.indices.tolist() == [3, 4]
    with pytest.raises(ValueError, match="exceeds"):
        batch.padded(1, 8)


def _pad_reference(sequences: list[list[int]], length: int) -> torch.Tensor:
    out = torch.full((len(sequences), length), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def test_pad_and_make_batch_equal_a_copy_per_sentence() -> None:
    rng = np.random.default_rng(4)
    for _ in range(20):
        count = int(rng.integers(1, 9))
        src = [rng.integers(4, 90, int(rng.integers(1, 12))).tolist() for _ in range(count)]
        trg = [rng.integers(4, 90, int(rng.integers(0, 12))).tolist() for _ in range(count)]
        longest = max(len(s) for s in src)
        assert torch.equal(pad(src), _pad_reference(src, longest))
        assert torch.equal(pad(src, longest + 3), _pad_reference(src, longest + 3))
        batch = make_batch(src, trg, np.arange(count))
        width = max(len(t) for t in trg) + 1
        assert torch.equal(batch.src, _pad_reference(src, longest))
        assert batch.src_lengths.tolist() == [len(s) for s in src]
        assert batch.src_lengths.dtype == torch.long
        assert torch.equal(batch.trg_in, _pad_reference([[BOS_ID, *t] for t in trg], width))
        assert torch.equal(batch.trg_out, _pad_reference([[*t, EOS_ID] for t in trg], width))


@pytest.mark.parametrize(("count", "batch_size"), [(200, 64), (993, 64), (64, 64), (5, 64), (7, 1)])
def test_decoding_batches_share_the_sentences_evenly(count: int, batch_size: int) -> None:
    """Without a token budget: the fewest batches of at most batch_size, sizes one apart at
    most, every index once, shortest sentences first."""
    lengths = np.random.default_rng(count).integers(1, 40, size=count)
    batches = length_sorted_batches(lengths.tolist(), batch_size)
    assert len(batches) == -(-count // batch_size)
    sizes = [len(b) for b in batches]
    assert max(sizes) <= batch_size and max(sizes) - min(sizes) <= 1
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(count))
    assert np.all(np.diff(lengths[flat]) >= 0)
    assert length_sorted_batches([], batch_size) == []


def test_decoding_batches_keep_a_token_budget() -> None:
    """With batch_tokens, each batch's padded tokens stay within it (a longer sentence alone)."""
    lengths = [3, 9, 4, 30, 8, 8, 2, 5]
    batches = length_sorted_batches(lengths, 4, batch_tokens=20)
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= 4 and (len(batch) * longest <= 20 or len(batch) == 1)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
