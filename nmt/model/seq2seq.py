"""The encoder-decoder assembled from config, and its training loss over all target steps."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.fast import FastPaths
from nmt.fast.graphs import CaptureError, StepGraphs
from nmt.model.aligner import AlignmentHead
from nmt.model.attention import Memory
from nmt.model.decoder import Decoder, DecoderState
from nmt.model.encoder import Bridge, Encoder
from nmt.model.registry import build_attention, build_decoder
from nmt.vocab import PAD_ID

if TYPE_CHECKING:
    from nmt.config import ModelConfig

log = logging.getLogger("nmt")


class Seq2Seq(nn.Module):
    """Attention-based RNN encoder-decoder (Bahdanau et al. 2015; Luong et al. 2015):
    p(y_t | y_<t, x) = softmax(W_o f_t), f_t the decoder's features at step t. The sizes
    were checked by the config schema."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int, fast: FastPaths):
        super().__init__()
        self.encoder = Encoder(cfg, src_vocab_size, fast)
        self.bridge = Bridge(self.encoder, cfg.decoder)
        key_size = self.encoder.output_size
        attention = build_attention(cfg.attention, cfg.decoder.hidden_size, key_size, fast)
        self.decoder: Decoder = build_decoder(cfg, trg_vocab_size, attention, fast)
        self.generator = nn.Linear(self.decoder.output_size, trg_vocab_size, bias=False)  # W_o
        if cfg.tie_embeddings:
            self.generator.weight = self.decoder.embed.weight
        self.aligner: AlignmentHead | None = None  # model.alignment_head
        if cfg.alignment_head:  # drawn aside: the rest of the run's random numbers stay
            with torch.random.fork_rng(devices=[]):
                self.aligner = AlignmentHead(
                    self.decoder.output_size,
                    cfg.embedding_size,
                    key_size,
                    cfg.alignment_head_joint,
                    cfg.alignment_head_context,
                )
        self.trg_vocab_size = trg_vocab_size
        self.fast = fast
        # CUDA graphs in training (FastPaths.graphs): of the whole loss, forward and backward,
        # for a GRU encoder (``static_loss``), else of a step-by-step decoder's unroll
        self.whole_graphs = fast.graphs == "loss" and isinstance(self.encoder.rnn, nn.GRU)
        captured = self.whole_graphs or self.decoder.stepwise
        self.graphs = StepGraphs() if fast.graphs != "off" and captured else None

    def encode(
        self,
        src: Tensor,
        src_lengths: Tensor,
        table: Tensor | None = None,
        static: bool = False,
    ) -> tuple[Memory, DecoderState]:
        """src: (B, S) -> attention memory and the decoder's initial state; ``table``: the
        encoder's for search (``Encoder.gate_table``); ``static``: the lengths on the
        device, never read on the host (``static_loss``)."""
        enc = self.encoder(src, src_lengths, table, static)
        memory = self.decoder.attention.prepare(enc.outputs, enc.mask)
        hidden, cell = self.bridge(enc)
        return memory, self.decoder.initial_state(hidden, cell)

    def forward(self, src: Tensor, src_lengths: Tensor, trg_in: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: -> features (B, T, O), alphas (B, T, S)."""
        memory, state = self.encode(src, src_lengths)
        return self.decoder(trg_in, memory, state)

    def read(
        self, src: Tensor, src_lengths: Tensor, trg_in: Tensor, trg_out: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Teacher forcing that also aligns: -> features (B, T, O), the attention alphas
        (B, T, S) and the alignment head's weights beta (B, T, S), None without a head.
        trg_out (B, T) = y EOS: row t of beta aligns trg_out[:, t]."""
        memory, state = self.encode(src, src_lengths)
        features, alphas = self.decoder(trg_in, memory, state)
        return features, alphas, self._head(features, trg_out, memory)

    def _head(self, features: Tensor, trg_out: Tensor, memory: Memory) -> Tensor | None:
        if self.aligner is None:
            return None
        embedded = F.embedding(trg_out, self.decoder.embed.weight)  # e(y_t), (B, T, E)
        lengths = (trg_out != PAD_ID).sum(dim=1)
        return self.aligner(features, embedded, memory.values, memory.mask, lengths)

    def _teacher_forced(
        self, trg_in: Tensor, memory: Memory, state: DecoderState
    ) -> tuple[Tensor, Tensor]:
        """The decoder over trg_in: captured as CUDA graphs where ``self.graphs`` is set, in
        training, for a step-by-step decoder on a GPU; else its plain call."""
        graphed = (
            self.graphs is not None and self.training and trg_in.is_cuda and torch.is_grad_enabled()
        )
        if not graphed:
            return self.decoder(trg_in, memory, state)  # type: ignore[no-any-return]
        assert self.graphs is not None
        return self.graphs(self.decoder, self.decoder, trg_in, memory, state)  # type: ignore[no-any-return]

    def log_probs(
        self,
        features: Tensor,
        product: Callable[[Tensor], Tensor] | None = None,
        allowed: Tensor | None = None,
    ) -> Tensor:
        """(..., O) -> (..., V) float32 log-probabilities; given ``product`` (features (N, O)
        -> logits (N, V'): W_o's, or a shortlist's rows of it, ``fast.packed.Product``),
        the log-softmax over those V' outputs, and given ``allowed`` (N, V') bool too, over
        each row's allowed ones, the others -inf."""
        logits = self.generator(features) if product is None else product(features)
        return self.fast.log_softmax(logits, allowed, self.training)

    def loss(
        self,
        src: Tensor,
        src_lengths: Tensor,
        trg_in: Tensor,
        trg_out: Tensor,
        label_smoothing: float = 0.0,
        guide: Guide | None = None,
        target_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Summed label-smoothed cross-entropy and summed plain NLL over the target tokens.

        src (B, S), src_lengths (B,), trg_in (B, T) = BOS y, trg_out (B, T) = y EOS, padded
        with PAD_ID. Divide by the number of target tokens for per-token means. With a
        ``guide`` (``Guide``: attention targets and a weight), the loss adds the weight times
        the targets' cross-entropy with the attention (``guided_alignment_loss``), or with
        the alignment head's weights when the model has one; the NLL does not. ``target_rows``: the
        positions of trg_out.view(-1) that are not padding, where the caller knows them
        (``Batch.target_rows``): then finding them costs no wait on a GPU.
        """
        if self._captures_whole(src):
            whole = self._captured_loss(src, trg_in, trg_out, label_smoothing, guide)
            if whole is not None:
                return whole
        memory, state = self.encode(src, src_lengths)
        features, alphas = self._teacher_forced(trg_in, memory, state)
        flat = features.reshape(-1, features.size(-1))  # (B*T, O)
        gold = trg_out.reshape(-1)  # (B*T,)
        if target_rows is None:
            keep = gold != PAD_ID
            flat, gold = flat[keep], gold[keep]  # padding never reaches the output layer
        else:
            flat, gold = flat.index_select(0, target_rows), gold.index_select(0, target_rows)
        weight = self.generator.weight  # (V, O)
        loss, nll = self.fast.output_loss(flat, weight, gold, label_smoothing, self.training)
        return self._guided(loss, nll, features, alphas, trg_out, memory, guide)

    def static_loss(
        self,
        src: Tensor,
        trg_in: Tensor,
        trg_out: Tensor,
        label_smoothing: float = 0.0,
        guide: Guide | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``loss`` of a batch of static shape as one CUDA graph holds it: nothing read on
        the host and no shape taken from the data. The source lengths are counted on the
        device (a source has no padding before its end), the encoder runs unpacked
        (``FastPaths.recurrence``'s static path; a GRU encoder), the decoder eagerly (no
        graph of its own inside this one), and every target position reaches the output
        layer, padding's rows counting nothing (``FastPaths.output_loss``'s rows)."""
        lengths = (src != PAD_ID).sum(dim=1)
        memory, state = self.encode(src, lengths, static=True)
        features, alphas = self.decoder(trg_in, memory, state)
        gold = trg_out.reshape(-1)  # (B*T,)
        loss, nll = self.fast.output_loss(
            features.reshape(-1, features.size(-1)),
            self.generator.weight,
            gold,
            label_smoothing,
            self.training,
            rows=gold != PAD_ID,
        )
        return self._guided(loss, nll, features, alphas, trg_out, memory, guide)

    def _guided(
        self,
        loss: Tensor,
        nll: Tensor,
        features: Tensor,
        alphas: Tensor,
        trg_out: Tensor,
        memory: Memory,
        guide: Guide | None,
    ) -> tuple[Tensor, Tensor]:
        """The loss with guided alignment's term where ``guide`` is given, and the NLL."""
        if guide is not None and guide.weight > 0:
            head = self._head(features, trg_out, memory)
            guided = alphas if head is None else head
            loss = loss + guide.weight * guided_alignment_loss(guided, guide.targets)
        return loss, nll

    def _captures_whole(self, src: Tensor) -> bool:
        """Whether this training loss runs as a CUDA graph of the whole loss: graphs of it
        (``whole_graphs``), not paused (the loop's batches have static shapes), training with
        gradients, on a GPU."""
        graphs = self.graphs
        return (
            graphs is not None
            and self.whole_graphs
            and not graphs.paused
            and self.training
            and src.is_cuda
            and torch.is_grad_enabled()
        )

    def _captured_loss(
        self,
        src: Tensor,
        trg_in: Tensor,
        trg_out: Tensor,
        label_smoothing: float,
        guide: Guide | None,
    ) -> tuple[Tensor, Tensor] | None:
        """``static_loss`` through its CUDA graph (captured now if this shape is new); None
        where the capture failed: then the model captures a step-by-step decoder's unroll
        alone from here on, as it does for an LSTM encoder (another decoder runs eagerly)."""
        assert self.graphs is not None
        try:
            return self.graphs(  # type: ignore[no-any-return]
                self,
                self.static_loss,
                src,
                trg_in,
                trg_out,
                label_smoothing,
                guide,
                what="the whole training loss",
            )
        except CaptureError as exc:
            rest = "its decoder's unroll alone" if self.decoder.stepwise else "nothing"
            log.warning(
                "training.cuda_graphs: the whole training loss could not be captured (%s); "
                "capturing %s from here on",
                exc.reason,
                rest,
            )
            self.whole_graphs = False
            return None


@dataclass(frozen=True)
class Guide:
    """Guided alignment in a training loss: the batch's attention targets (B, T, S) and the
    weight of their cross-entropy (``training.guided_alignment_weight``)."""

    targets: Tensor
    weight: float


def guided_alignment_loss(alphas: Tensor, guide: Tensor) -> Tensor:
    """Guided alignment (Chen et al. 2016; Garg et al. 2019): the cross-entropy
    -sum_{b,t} sum_s G[b,t,s] log alpha[b,t,s] between the attention alphas (B, T, S) and the
    targets G (B, T, S), each row of G a distribution over source pieces or zero (a target
    piece without links, EOS, padding: no term). Multi-head attention contributes the mean
    of its heads' weights, the alphas every decoder returns. A weight of exactly 0 where G
    is not (a local window's outside) counts as the smallest float32, not as -inf."""
    tiny = torch.finfo(torch.float32).tiny
    log_alphas = alphas.float().clamp_min(tiny).log()
    return -(guide.to(log_alphas.dtype) * log_alphas).sum()


def build_model(
    cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int, fast: FastPaths | None = None
) -> Seq2Seq:
    """The model of a validated ``model`` config section, with the speed paths ``fast``
    (default: all of them)."""
    return Seq2Seq(cfg, src_vocab_size, trg_vocab_size, fast or FastPaths())


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
