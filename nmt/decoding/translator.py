"""A trained model with its tokenizer: checkpoint in, lines in, hypotheses out. Used by the
commands (`nmt translate`, `nmt eval`) and by validation during training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmt import checkpoint
from nmt.config import Config, DecodingConfig, from_dict
from nmt.data.batching import length_sorted_batches, pad
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.search import Hypothesis, beam_search
from nmt.errors import CheckpointError
from nmt.model import Seq2Seq, build_model
from nmt.runtime import allow_tf32, autocast, choose_device, choose_precision, eval_mode


@dataclass
class Translation:
    """One input line's n-best list (empty for an empty line) and its source pieces."""

    hypotheses: list[Hypothesis]
    src_ids: list[int]


class Translator:
    """A trained model with its tokenizer, ready to decode."""

    def __init__(
        self,
        model: Seq2Seq,
        tokenizer: Tokenizer,
        config: Config,
        device: torch.device,
        precision: str = "fp32",
    ):
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.precision = precision

    @classmethod
    def from_checkpoint(
        cls, path: Path, device: str = "auto", precision: str = "fp32"
    ) -> Translator:
        target = choose_device(device)
        path = checkpoint.resolve(Path(path))
        state = checkpoint.load(path)
        config = from_dict(state["config"], f"{path} (saved config)")
        try:
            tokenizer = Tokenizer.from_state_dict(state["tokenizer"])
        except (RuntimeError, KeyError, TypeError):
            raise CheckpointError(
                f"{path}: the tokenizer inside is not a valid sentencepiece model; the file is "
                f"damaged: use another checkpoint of the run"
            ) from None
        model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
        _check_weights(model, state["model"], tokenizer, path)
        model.load_state_dict(state["model"])
        model.eval()
        chosen = choose_precision(precision, target)
        allow_tf32(target, chosen)
        return cls(model, tokenizer, config, target, chosen)

    def decode_ids(
        self,
        src_ids: Sequence[list[int]],
        decoding: DecodingConfig,
        n_best: int = 1,
        return_attention: bool = False,
        batch_tokens: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Hypothesis]]:
        """Beam-search every id sequence (non-empty), in length-sorted batches."""
        out: list[list[Hypothesis]] = [[] for _ in src_ids]
        lengths = [len(s) for s in src_ids]
        with eval_mode(self.model), autocast(self.device, self.precision):
            for index in length_sorted_batches(lengths, decoding.batch_size, batch_tokens):
                chunk = [src_ids[i] for i in index]
                src = pad(chunk).to(self.device)
                src_lengths = torch.tensor([len(s) for s in chunk], device=self.device)
                results = beam_search(
                    self.model, src, src_lengths, decoding, n_best, return_attention
                )
                for i, hyps in zip(index, results, strict=True):
                    for hyp in hyps:  # on the host, without the batch's padding columns
                        if hyp.alphas is not None:
                            hyp.alphas = hyp.alphas[:, : len(src_ids[i])].float().cpu()
                    out[int(i)] = hyps
                if progress is not None:
                    progress(len(index))
        return out

    def translate(
        self,
        lines: Sequence[str],
        decoding: DecodingConfig,
        n_best: int = 1,
        return_attention: bool = False,
        batch_tokens: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[Translation]:
        """Exactly one Translation per input line; empty lines give empty n-best lists."""
        keep = [i for i, line in enumerate(lines) if line.strip()]
        src_ids = self.tokenizer.encode_src([lines[i] for i in keep])
        if progress is not None and len(keep) < len(lines):
            progress(len(lines) - len(keep))
        hyps = self.decode_ids(src_ids, decoding, n_best, return_attention, batch_tokens, progress)
        out = [Translation([], []) for _ in lines]
        for i, ids, h in zip(keep, src_ids, hyps, strict=True):
            out[i] = Translation(h, ids)
        return out

    def detokenize(self, hypothesis: Hypothesis) -> str:
        return self.tokenizer.decode_trg([hypothesis.tokens])[0]


def _check_weights(
    model: Seq2Seq, weights: dict[str, Any], tokenizer: Tokenizer, path: Path
) -> None:
    """The saved weights have the names and shapes of the model that the saved config and
    tokenizer build; a vocabulary size that differs means the tokenizer is not the model's."""
    expected = model.state_dict()
    names = set(expected) ^ set(weights)
    if names:
        raise CheckpointError(
            f"{path}: the weights do not fit the model of the saved config (parameters "
            f"{', '.join(sorted(names)[:3])} differ); the checkpoint was written by another nmt "
            f"version or edited"
        )
    vocab = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    for name, tensor in weights.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) == want:
            continue
        if want and want[0] in vocab and tensor.shape[0] != want[0]:
            raise CheckpointError(
                f"{path}: its tokenizer has {vocab[0]} source / {vocab[1]} target pieces but "
                f"{name} has {tensor.shape[0]} rows; the tokenizer does not belong to this "
                f"model: use the checkpoint as nmt train wrote it"
            )
        raise CheckpointError(
            f"{path}: {name} has shape {tuple(tensor.shape)} but the saved config builds "
            f"{want}; the checkpoint was written by another nmt version or edited"
        )
