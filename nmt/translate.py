"""Checkpoint + tokenizer -> lines in, lines out. Used by `nmt translate`, `nmt eval` and
validation during training."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt import checkpoint
from nmt.config import Config, DecodingConfig, from_dict
from nmt.data import pad
from nmt.errors import CheckpointError, ConfigError, DataError
from nmt.model import Seq2Seq, build_model
from nmt.runtime import autocast, choose_device, choose_precision, eval_mode
from nmt.search import Hypothesis, beam_search
from nmt.tokenizer import Tokenizer


@dataclass
class Translation:
    """One input line's n-best list (empty for an empty line) and its source pieces."""

    hypotheses: list[Hypothesis]
    src_ids: list[int]


def length_sorted_batches(
    lengths: Sequence[int], batch_size: int, batch_tokens: int | None = None
) -> Iterator[np.ndarray]:
    """Indices grouped by similar length: at most ``batch_size`` sentences and, when given,
    ``batch_tokens`` padded source tokens per batch."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and end - start < batch_size:
            if batch_tokens and lengths[order[end]] * (end - start + 1) > batch_tokens:
                break
            end += 1
        yield order[start:end]
        start = end


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
        return cls(model, tokenizer, config, target, choose_precision(precision, target))

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
                    self.model,
                    src,
                    src_lengths,
                    beam_size=decoding.beam_size,
                    alpha=decoding.length_penalty,
                    max_len_ratio=decoding.max_len_ratio,
                    max_len_offset=decoding.max_len_offset,
                    n_best=n_best,
                    return_attention=return_attention,
                    no_repeat_ngram=decoding.no_repeat_ngram,
                )
                for i, hyps in zip(index, results, strict=True):
                    for hyp in hyps:  # drop the batch's padding columns
                        if hyp.alphas is not None:
                            hyp.alphas = hyp.alphas[:, : len(src_ids[i])].float()
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


# ----------------------------------------------------------------------------- commands


def check_output(path: Path, option: str) -> None:
    """Fail before any work if ``path`` cannot be written as a file."""
    parent = path.parent
    if path.is_dir():
        raise DataError(f"{option} {path}: is a directory; give a file name")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise DataError(f"{option} {path}: the folder {parent} {what}; create it first")
    if not os.access(parent, os.W_OK):
        raise DataError(f"{option} {path}: cannot write in {parent} (permission denied)")


def _read_input(path: str) -> list[str]:
    from nmt.evaluate import read_lines

    if path == "-":
        import sys

        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise DataError(
                f"<stdin>:{line}: not valid UTF-8; re-encode the input as UTF-8 "
                f"(e.g. iconv -f latin1 -t utf-8)"
            ) from None
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return [line.removesuffix("\r") for line in lines]
    return read_lines(Path(path))


def _format(
    translator: Translator, index: int, item: Translation, n_best: int, scores: bool
) -> list[str]:
    if n_best > 1:
        rows = [
            f"{index}\t{rank}\t{hyp.score:.4f}\t{translator.detokenize(hyp)}"
            for rank, hyp in enumerate(item.hypotheses, start=1)
        ]
        return rows or [f"{index}\t1\t0.0000\t"]
    text = translator.detokenize(item.hypotheses[0]) if item.hypotheses else ""
    if scores:
        score = item.hypotheses[0].score if item.hypotheses else 0.0
        return [f"{score:.4f}\t{text}"]
    return [text]


def _write_attention(
    translator: Translator, directory: Path, index: int, item: Translation
) -> None:
    from nmt.plots import save_attention

    if not item.hypotheses:
        return
    best = item.hypotheses[0]
    if best.alphas is None:
        return
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(item.src_ids)
    trg = [*tokenizer.trg_pieces(best.tokens), "</s>"]
    save_attention(directory / f"{index:06d}", src, trg, best.alphas.float().numpy())


def translate_command(
    model: Path,
    input_path: str,
    output_path: str,
    decoding_overrides: dict[str, Any],
    n_best: int = 1,
    scores: bool = False,
    batch_tokens: int | None = None,
    device: str = "auto",
    attention_dir: Path | None = None,
    show_progress: bool = True,
    precision: str = "auto",
) -> int:
    """`nmt translate`: read lines, write exactly one output line (or n-best block) per line.

    Every user error (input, output path, checkpoint, options) is raised before the output is
    touched; a file output is replaced atomically, so a failed run leaves an existing file as
    it was.
    """
    if output_path != "-":
        check_output(Path(output_path), "--output")
    if attention_dir is not None and attention_dir.exists() and not attention_dir.is_dir():
        raise DataError(f"--attention-dir {attention_dir}: is a file; give a directory")
    lines = _read_input(input_path)
    translator = Translator.from_checkpoint(model, device, precision)
    decoding = translator.config.decoding.model_copy(
        update={k: v for k, v in decoding_overrides.items() if v is not None}
    )
    if n_best > decoding.beam_size:
        beam = f"--beam {decoding.beam_size}" + (
            "" if decoding_overrides.get("beam_size") else " (the run's decoding.beam_size)"
        )
        raise ConfigError(
            f"--n-best {n_best} is larger than {beam}; a beam keeps at most that many "
            f"hypotheses: raise --beam or lower --n-best"
        )
    with _progress_bar(len(lines), show_progress and input_path != "-") as advance:
        results = translator.translate(
            lines, decoding, n_best, attention_dir is not None, batch_tokens, advance
        )
    out_lines = []
    for index, item in enumerate(results):
        out_lines.extend(_format(translator, index, item, n_best, scores))
        if attention_dir is not None:
            _write_attention(translator, attention_dir, index, item)
    text = "".join(line + "\n" for line in out_lines)
    if output_path == "-":
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        checkpoint.atomic_write_text(Path(output_path), text)
    return len(lines)


@contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled or total == 0:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("translating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("translate", total=total)
        yield lambda n: bar.advance(task, n)


def evaluate_split(
    model: Path,
    split: str,
    decoding_overrides: dict[str, Any],
    device: str = "auto",
    hypotheses_out: Path | None = None,
    show_progress: bool = True,
) -> Any:
    """Translate a split (dev or test) of the run's own data and score it."""
    from nmt import evaluate
    from nmt.data import read_pairs

    if split not in ("dev", "test", "train"):
        raise ConfigError(f"--split {split!r}: expected dev, test or train")
    if hypotheses_out is not None:
        check_output(hypotheses_out, "--save-hypotheses")
    translator = Translator.from_checkpoint(model, device)
    data = translator.config.data
    where = {"dev": data.dev, "test": data.test, "train": data.train}[split]
    if where is None:
        raise ConfigError(
            f"--split {split}: the run's config has no data.{split}; use --split dev, or "
            f"score your own files: nmt eval HYP --ref REF"
        )
    try:
        rows = read_pairs(data, where)
    except DataError as exc:
        advice = f"; fix data.{split} in the config"
        if not str(exc).endswith(advice):
            raise
        raise DataError(
            str(exc).removesuffix(advice) + "; the path is from the run's config: run nmt eval "
            "from the folder nmt train ran in"
        ) from None
    sources, references = list(rows["src"]), list(rows["trg"])
    decoding = translator.config.decoding.model_copy(
        update={k: v for k, v in decoding_overrides.items() if v is not None}
    )
    with _progress_bar(len(sources), show_progress) as advance:
        results = translator.translate(sources, decoding, progress=advance)
    hyps = [translator.detokenize(r.hypotheses[0]) if r.hypotheses else "" for r in results]
    if hypotheses_out is not None:
        checkpoint.atomic_write_text(hypotheses_out, "".join(h + "\n" for h in hyps))
    name = f"{Path(model).name}:{split} (beam {decoding.beam_size})"
    return evaluate.score({name: hyps}, [references])
