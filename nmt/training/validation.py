"""Validation on dev: loss and perplexity by teacher forcing, BLEU and chrF of greedy
translations, and the attention heatmap of the first dev sentence for tensorboard. With
``data.dev_alignment`` (a reference word alignment of the dev pairs) also the alignment error
rate of the attention while the model reads each dev reference (``nmt align``'s argmax
extraction), on all words and on content words, and a heatmap of that attention with the
reference links outlined.

Under torchrun every rank validates the same weights on the same data, so every rank computes
the same metrics and takes the same decisions (best checkpoint, plateau, early stopping)
without a broadcast; ``agree`` checks that they did.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nmt import evaluate
from nmt.config import Config, DecodingConfig
from nmt.data.batching import bucket_batches
from nmt.data.prepare import Corpora
from nmt.data.store import TokenizedCorpus
from nmt.data.textfiles import existing
from nmt.data.tokenizer import piece_words
from nmt.decoding.alignment import (
    ReferenceLinks,
    attention_links,
    content_links,
    content_reference,
    link_cells,
    parse_links,
    score_alignments,
)
from nmt.decoding.options import SearchOptions
from nmt.decoding.search_precision import choose_search_precision
from nmt.decoding.translator import Translator
from nmt.errors import DataError
from nmt.files import read_lines
from nmt.function_words import FUNCTION_WORDS, content_mask
from nmt.model import Seq2Seq
from nmt.runtime import autocast, eval_mode
from nmt.training.distributed import Distributed, all_reduce
from nmt.training.tracking import Tracker

if TYPE_CHECKING:
    from nmt.training.run import Run

log = logging.getLogger("nmt")


@torch.no_grad()
def dev_loss(
    model: Seq2Seq, dev: TokenizedCorpus, batch_tokens: int, device: torch.device, precision: str
) -> float:
    """Mean per-token NLL of the dev set under teacher forcing."""
    total, tokens = 0.0, 0
    with eval_mode(model), autocast(device, precision):
        for indices in bucket_batches(dev.src_lengths, dev.trg_lengths, batch_tokens, 0, 0):
            batch = dev.batch(indices).to(device)
            _, nll = model.loss(*batch.tensors())
            total += float(nll)
            tokens += batch.n_target_tokens
    return total / max(tokens, 1)


@dataclass
class DevAlignment:
    """``data.dev_alignment`` for the validation pairs that have reference links: their text,
    links, and content-word flags (None unless both languages have a function-word list)."""

    sources: list[str]
    targets: list[str]
    references: list[ReferenceLinks]
    masks: list[tuple[list[bool], list[bool]]] | None


def load_dev_alignment(config: Config, corpora: Corpora) -> DevAlignment | None:
    """Read and check ``data.dev_alignment`` against the dev pairs, before training starts.

    Raises:
        DataError: the file is missing, has another line count than data.dev has pairs, or
            holds a link that is not ``i-j``/``i?j`` or lies outside its pair's words.
    """
    data = config.data
    if not data.dev_alignment:
        return None
    path = existing(Path(data.dev_alignment), "data.dev_alignment")
    lines = read_lines(path)
    if len(lines) != corpora.dev_pairs:
        raise DataError(
            f"data.dev_alignment: {path} has {len(lines):,} lines but data.dev {data.dev} has "
            f"{corpora.dev_pairs:,} pairs; give the alignment of the dev pairs, a line per pair"
        )
    languages = (data.src_lang, data.trg_lang)
    with_content = all(language in FUNCTION_WORDS for language in languages)
    out = DevAlignment([], [], [], [] if with_content else None)
    rows = corpora.dev.row_ids[: len(corpora.dev_src)].tolist()
    for row, source, target in zip(rows, corpora.dev_src, corpora.dev_trg, strict=True):
        where = f"data.dev_alignment {path} line {row + 1}"
        try:
            sure, possible = parse_links(lines[row], where)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        if not sure and not possible:
            continue  # a pair the reference does not align
        words = (source.split(), target.split())
        for i, j in sorted(sure | possible):
            if i >= len(words[0]) or j >= len(words[1]):
                raise DataError(
                    f"{where}: link {i}-{j} is outside the pair's {len(words[0])} source and "
                    f"{len(words[1])} target words; the alignment is of other text"
                )
        out.sources.append(source)
        out.targets.append(target)
        out.references.append(ReferenceLinks(sure, sure | possible))
        if out.masks is not None:
            masks = (content_mask(words[0], languages[0]), content_mask(words[1], languages[1]))
            out.masks.append(masks)
    aligner = "alignment head" if config.model.alignment_head else "attention"
    log.info("validation: the %s's AER against %d dev pairs of %s", aligner, len(out.sources), path)
    return out


def alignment_metrics(
    translator: Translator, alignment: DevAlignment, tracker: Tracker, step: int
) -> dict[str, float]:
    """AER (percent) of the attention's argmax links on the reference dev pairs, all words
    and content words; the heatmap of the first pair with its reference links outlined."""
    if not alignment.sources:
        return {}
    greedy = translator.config.decoding.model_copy(update={"beam_size": 1})
    found, results = attention_links(translator, alignment.sources, alignment.targets, greedy)
    links = [set(row) for row in found]
    metrics = {"aer": 100 * score_alignments(links, alignment.references).aer}
    if alignment.masks is not None:
        pairs = list(zip(links, alignment.references, alignment.masks, strict=True))
        hyps = [content_links(row, mask) for row, _, mask in pairs]
        refs = [content_reference(reference, mask) for _, reference, mask in pairs]
        metrics["aer_content"] = 100 * score_alignments(hyps, refs).aer
    first = results[0]
    if tracker.images and first is not None and first.alphas is not None:
        _reference_image(translator, alignment, first.alphas, tracker, step)
    return metrics


def _reference_image(
    translator: Translator, alignment: DevAlignment, alphas: Tensor, tracker: Tracker, step: int
) -> None:
    """The first reference pair's attention, its reference links outlined, for tensorboard."""
    from nmt.plots import attention_figure_array

    tokenizer = translator.tokenizer
    source, target = alignment.sources[0], alignment.targets[0]
    reference = alignment.references[0]
    (src_ids,) = tokenizer.encode_src([source])
    (trg_ids,) = tokenizer.encode_trg([target])
    src = tokenizer.src_pieces(src_ids)
    trg = tokenizer.trg_pieces_and_eos(trg_ids)
    src_words = piece_words(tokenizer.src, source)
    trg_words = piece_words(tokenizer.trg, target)
    cells = link_cells(reference.sure, reference.possible, src_words, trg_words)
    image = attention_figure_array(src, trg, alphas.float().numpy(), cells)
    tracker.image(step, "dev/attention_reference", image)


def search_precision(run: Run, greedy: DecodingConfig) -> str:
    """The precision of validation's greedy search: training's, except where training's
    auto chose bf16 on a CPU; there the faster of fp32 and bf16 in the model's own greedy
    search (``nmt.decoding.search_precision``), logged once."""
    config, updater = run.config, run.updater
    cpu_auto = config.training.precision == "auto" and updater.device.type == "cpu"
    if not cpu_auto or updater.precision != "bf16":
        return updater.precision
    searched = config.model_copy(update={"decoding": greedy})
    tokenizer, model, device = run.tokenizer, updater.model, updater.device

    def make(name: str) -> Translator:
        return Translator(model, tokenizer, searched, device, name)

    chosen = choose_search_precision(make, searched, 1, tokenizer.src_vocab_size)
    log.info("validation's search precision: %s", chosen)
    return chosen.name


def validate(run: Run) -> dict[str, float]:
    """Dev loss and perplexity (teacher forcing), BLEU and chrF of greedy translations, and
    with ``data.dev_alignment`` the attention's dev AER."""
    started = time.time()
    config, corpora, tracker, step = run.config, run.corpora, run.tracker, run.progress.step
    model, device, precision = run.updater.model, run.updater.device, run.updater.precision
    tokenizer, alignment = run.tokenizer, run.dev_alignment
    loss = dev_loss(model, corpora.dev, config.training.batch_tokens, device, precision)
    greedy = config.decoding.model_copy(update={"beam_size": 1})
    if run.search_precision is None:
        run.search_precision = search_precision(run, greedy)
    translator = Translator(model, tokenizer, config, device, run.search_precision)
    hyps = translator.decode_ids(corpora.dev_src_ids, greedy)
    hyp_lines = [translator.detokenize(h[0]) for h in hyps]
    report = evaluate.score({"dev": hyp_lines}, [corpora.dev_trg], metrics=("bleu", "chrf"))
    scores = report.systems[0]
    metrics = {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "bleu": float(scores.bleu or 0.0),
        "chrf": float(scores.chrf or 0.0),
    }
    aligned = alignment_metrics(translator, alignment, tracker, step) if alignment else {}
    metrics.update(aligned)
    tracker.scalars(step, metrics, "dev")
    _attention_image(translator, corpora, tracker, step)
    labels = {"aer": "AER", "aer_content": "AER (content words)"}
    aer = "".join(f" {labels[name]} {value:.1f}" for name, value in aligned.items())
    log.info(
        "validation at step %d: dev loss %.3f ppl %.2f BLEU %.2f chrF %.2f%s (%.1fs) | %s -> %s",
        step,
        metrics["loss"],
        metrics["ppl"],
        metrics["bleu"],
        metrics["chrf"],
        aer,
        time.time() - started,
        corpora.dev_src[0][:60],
        hyp_lines[0][:60],
    )
    return metrics


def agree(metrics: dict[str, float], place: Distributed, device: torch.device) -> dict[str, float]:
    """The metrics every rank decides on: the same on all ranks by construction.

    The ranks should have computed identical numbers, and then they keep them. Should they
    differ (the replicas drifted apart, or GPUs differ in a last bit), each rank logs it and
    takes the midpoint of the ranks' range, so no rank can stop while another trains on (and
    hangs).
    """
    if not place.enabled:
        return metrics
    names = list(metrics)  # every rank has the same names: the same config
    values = [metrics[name] for name in names]
    high = all_reduce([*values, *(-v for v in values)], device, op="max")
    top, bottom = high[: len(values)], [-v for v in high[len(values) :]]
    if top == bottom:
        return metrics
    log.warning(
        "validation: the %d ranks disagree on dev metrics by up to %.3g; using the midpoint",
        place.world_size,
        max(t - b for t, b in zip(top, bottom, strict=True)),
    )
    return {name: (t + b) / 2 for name, t, b in zip(names, top, bottom, strict=True)}


def _attention_image(translator: Translator, corpora: Corpora, tracker: Tracker, step: int) -> None:
    if not tracker.images:
        return
    from nmt.plots import attention_figure_array

    greedy = translator.config.decoding.model_copy(update={"beam_size": 1})
    search = SearchOptions(attention=True)
    hyp = translator.decode_ids(corpora.dev_src_ids[:1], greedy, search)[0][0]
    if hyp.alphas is None or not hyp.tokens:
        return
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(corpora.dev_src_ids[0])
    trg = tokenizer.trg_pieces_and_eos(hyp.tokens)
    tracker.image(step, "dev/attention", attention_figure_array(src, trg, hyp.alphas.numpy()))
