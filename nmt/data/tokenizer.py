"""sentencepiece tokenizers: train, load, encode, decode, with nmt's special ids (nmt.vocab)."""

from __future__ import annotations

import functools
import io
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import sentencepiece as spm

from nmt.data.sampling import Sampler, read_model
from nmt.errors import CheckpointError, DataError
from nmt.files import atomic_write_bytes
from nmt.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def train_sentencepiece(
    lines: Iterable[str],
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    max_sentences: int,
    seed: int,
) -> bytes:
    """Train a sentencepiece model in memory; returns the serialized model proto."""
    sample = [line for line in lines if line.strip()]
    if not sample:
        raise DataError("cannot train the tokenizer: the training text is empty")
    if len(sample) > max_sentences:
        sample = random.Random(seed).sample(sample, max_sentences)
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            hard_vocab_limit=False,
            num_threads=2,
            minloglevel=2,
            max_sentence_length=8192,
        )
    except RuntimeError as exc:
        raise DataError(_training_failure(str(exc), vocab_size)) from None
    return model.getvalue()


def _training_failure(message: str, vocab_size: int) -> str:
    """sentencepiece's error in the config's terms."""
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if needed:
        return (
            f"tokenizer.vocab_size: {vocab_size} is too small for the training text, which "
            f"needs at least {needed.group(1)} pieces for its characters and nmt's special "
            f"tokens; raise tokenizer.vocab_size to {needed.group(1)} or more, or lower "
            f"tokenizer.character_coverage"
        )
    if "vocab_size" in message.lower() and "too high" in message.lower():
        return (
            f"tokenizer.vocab_size: {vocab_size} is more pieces than the training text can "
            f"give; lower it"
        )
    return f"tokenizer training failed: {message.splitlines()[0]}"


def _load_proto(proto: bytes) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto)
    if processor.pad_id() != PAD_ID or processor.eos_id() != EOS_ID or processor.bos_id() != BOS_ID:
        raise CheckpointError(
            f"tokenizer special ids are pad={processor.pad_id()} bos={processor.bos_id()} "
            f"eos={processor.eos_id()}; nmt needs pad={PAD_ID} bos={BOS_ID} eos={EOS_ID}"
        )
    return processor


@dataclass
class Tokenizer:
    """Source and target sentencepiece models (the same object when joint)."""

    src_proto: bytes
    trg_proto: bytes

    def __post_init__(self) -> None:
        self.src = _load_proto(self.src_proto)
        self.trg = self.src if self.joint else _load_proto(self.trg_proto)
        self._samplers: dict[bytes, Sampler] = {}  # by model: made when first sampled

    def __getstate__(self) -> dict[str, bytes]:  # the processors are rebuilt from the bytes
        return self.state_dict()

    def __setstate__(self, state: dict[str, bytes]) -> None:
        self.src_proto, self.trg_proto = state["src"], state["trg"]
        self.__post_init__()

    @property
    def joint(self) -> bool:
        return self.src_proto == self.trg_proto

    @property
    def src_vocab_size(self) -> int:
        return int(self.src.get_piece_size())

    @property
    def trg_vocab_size(self) -> int:
        return int(self.trg.get_piece_size())

    def encode_src(self, lines: Sequence[str]) -> list[list[int]]:
        """Source ids, each ending in EOS."""
        return [ids + [EOS_ID] for ids in self.src.encode(list(lines))]

    def encode_trg(self, lines: Sequence[str]) -> list[list[int]]:
        """Target ids without BOS/EOS (the batcher adds them)."""
        return [list(ids) for ids in self.trg.encode(list(lines))]

    def sample(
        self, side: str, lines: Sequence[str], seeds: Sequence[int], alpha: float, nbest: int
    ) -> list[list[int]]:
        """Sampled segmentations (subword regularisation): unigram sampling for a unigram
        model (``alpha`` smooths, ``nbest`` -1 samples from all segmentations), and
        BPE-dropout for a BPE model (``alpha`` drops merges). Each line's sample is a function
        of the model, the line and its seed alone, in any process (``nmt.data.sampling``:
        sentencepiece's own generator is salted per process); source ids end in EOS like
        ``encode_src``'s."""
        sampler = self._sampler(side)
        out = []
        for line, seed in zip(lines, seeds, strict=True):
            ids = sampler.sample(line, seed, alpha, nbest)
            out.append(ids + [EOS_ID] if side == "src" else ids)
        return out

    def _sampler(self, side: str) -> Sampler:
        """The side's sampler, made on first use (the joint model's one serves both)."""
        proto = self.src_proto if side == "src" else self.trg_proto
        if proto not in self._samplers:
            processor = self.src if side == "src" else self.trg
            self._samplers[proto] = Sampler(read_model(proto), processor.normalize)
        return self._samplers[proto]

    def decode_trg(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.trg.decode([int(i) for i in seq]) for seq in ids]

    def src_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.src.id_to_piece(int(i)) for i in ids]

    def trg_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.trg.id_to_piece(int(i)) for i in ids]

    def trg_pieces_and_eos(self, ids: Sequence[int]) -> list[str]:
        """The target pieces and ``</s>``: the rows of an output's attention, the tokens its
        forced score covers."""
        return [*self.trg_pieces(ids), "</s>"]

    def state_dict(self) -> dict[str, bytes]:
        return {"src": self.src_proto, "trg": self.trg_proto}

    @classmethod
    def from_state_dict(cls, state: dict[str, bytes]) -> Tokenizer:
        return cls(state["src"], state["trg"])

    def save(self, run_dir: Path) -> None:
        """Write the sentencepiece model file(s) for users and other tools (atomically)."""
        if self.joint:
            files = {"spm.model": self.src_proto}
        else:
            files = {"spm.src.model": self.src_proto, "spm.trg.model": self.trg_proto}
        for name, proto in files.items():
            atomic_write_bytes(run_dir / name, functools.partial(_write, proto))


def _write(data: bytes, handle: BinaryIO) -> None:
    handle.write(data)


def checkpoint_tokenizer(state: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer a checkpoint holds; a damaged one is a CheckpointError naming the file."""
    try:
        return Tokenizer.from_state_dict(state["tokenizer"])
    except (RuntimeError, KeyError, TypeError):
        raise CheckpointError(
            f"{path}: the tokenizer inside is not a valid sentencepiece model; the file is "
            f"damaged: use another checkpoint of the run"
        ) from None


def load_model_file(path: Path) -> bytes:
    """Read an existing sentencepiece .model file."""
    if not path.is_file():
        raise DataError(f"{path}: no such sentencepiece model (tokenizer.model)")
    proto = path.read_bytes()
    try:
        _load_proto(proto)
    except (RuntimeError, OSError) as exc:
        raise DataError(f"{path}: not a sentencepiece model ({exc})") from None
    return proto


def piece_words(processor: Any, text: str) -> list[int]:
    """The word index (whitespace token) of each sentencepiece piece of ``text``; a piece of
    whitespace alone (a lone ``▁``) belongs to the next piece's word. sentencepiece gives
    each piece's place in the text as UTF-8 byte offsets."""
    word_of_char = []  # per UTF-8 byte of the text
    word = -1
    previous_space = True
    for char in text:
        space = char.isspace()
        if not space and previous_space:
            word += 1
        word_of_char.extend([-1 if space else word] * len(char.encode("utf-8")))
        previous_space = space
    pieces = processor.encode(text, return_type="proto").pieces
    out: list[int] = []
    pending = 0
    for piece in pieces:
        owner = next(
            (word_of_char[i] for i in range(piece.begin, piece.end) if word_of_char[i] >= 0),
            -1,
        )
        if owner < 0:
            pending += 1
            continue
        out.extend([owner] * (pending + 1))
        pending = 0
    last = out[-1] if out else 0
    return out + [last] * pending
