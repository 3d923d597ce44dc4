"""Validation on dev: loss and perplexity by teacher forcing, BLEU and chrF of greedy
translations, and the attention heatmap of the first dev sentence for tensorboard.

Under torchrun every rank validates the same weights on the same data, so every rank computes
the same metrics and takes the same decisions (best checkpoint, plateau, early stopping)
without a broadcast; ``agree`` checks that they did.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from nmt import evaluate
from nmt.config import Config
from nmt.data.batching import bucket_batches
from nmt.data.prepare import Corpora
from nmt.data.store import TokenizedCorpus
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.translator import Translator
from nmt.model import Seq2Seq
from nmt.runtime import autocast, eval_mode
from nmt.training.distributed import Distributed, all_reduce
from nmt.training.tracking import Tracker

log = logging.getLogger("nmt")

METRICS = ("loss", "ppl", "bleu", "chrf")


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


def validate(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    config: Config,
    corpora: Corpora,
    device: torch.device,
    precision: str,
    tracker: Tracker,
    step: int,
) -> dict[str, float]:
    """Dev loss and perplexity (teacher forcing), BLEU and chrF of greedy translations."""
    started = time.time()
    loss = dev_loss(model, corpora.dev, config.training.batch_tokens, device, precision)
    translator = Translator(model, tokenizer, config, device, precision)
    greedy = config.decoding.model_copy(update={"beam_size": 1})
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
    tracker.scalars(step, metrics, "dev")
    _attention_image(translator, corpora, tracker, step)
    log.info(
        "validation at step %d: dev loss %.3f ppl %.2f BLEU %.2f chrF %.2f (%.1fs) | %s -> %s",
        step,
        metrics["loss"],
        metrics["ppl"],
        metrics["bleu"],
        metrics["chrf"],
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
    values = [metrics[name] for name in METRICS]
    high = all_reduce([*values, *(-v for v in values)], device, op="max")
    top, bottom = high[: len(values)], [-v for v in high[len(values) :]]
    if top == bottom:
        return metrics
    log.warning(
        "validation: the %d ranks disagree on dev metrics by up to %.3g; using the midpoint",
        place.world_size,
        max(t - b for t, b in zip(top, bottom, strict=True)),
    )
    return {name: (t + b) / 2 for name, t, b in zip(METRICS, top, bottom, strict=True)}


def _attention_image(translator: Translator, corpora: Corpora, tracker: Tracker, step: int) -> None:
    if not tracker.enabled:
        return
    from nmt.plots import attention_figure_array

    greedy = translator.config.decoding.model_copy(update={"beam_size": 1})
    hyp = translator.decode_ids(corpora.dev_src_ids[:1], greedy, return_attention=True)[0][0]
    if hyp.alphas is None or not hyp.tokens:
        return
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(corpora.dev_src_ids[0])
    trg = [*tokenizer.trg_pieces(hyp.tokens), "</s>"]
    tracker.image(step, "dev/attention", attention_figure_array(src, trg, hyp.alphas.numpy()))
