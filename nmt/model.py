"""The encoder-decoder assembled from config; the training loss over all target steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.attention import Memory, build_attention
from nmt.config import ModelConfig
from nmt.data import Batch
from nmt.decoder import BahdanauDecoder, DecoderState, LuongDecoder
from nmt.encoder import Bridge, Encoder
from nmt.errors import ConfigError
from nmt.tokenizer import PAD_ID

DECODERS = {"bahdanau": BahdanauDecoder, "luong": LuongDecoder}

# Rows of logits computed at once in the loss, so that a (B*T, V) float32 tensor is never
# materialised whole for large batches and vocabularies.
LOSS_CHUNK_ELEMENTS = 1 << 24


class Seq2Seq(nn.Module):
    """Attention-based RNN encoder-decoder (Bahdanau et al. 2015; Luong et al. 2015)."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int):
        super().__init__()
        self.encoder = Encoder(src_vocab_size, cfg.embedding_size, cfg.embedding_dropout, cfg.encoder)
        self.bridge = Bridge(self.encoder, cfg.decoder)
        attention = build_attention(
            cfg.attention.score,
            query_size=cfg.decoder.hidden_size,
            key_size=self.encoder.output_size,
            hidden_size=cfg.attention.hidden_size,
        )
        self.decoder = DECODERS[cfg.decoder.style](
            trg_vocab_size,
            cfg.embedding_size,
            cfg.embedding_dropout,
            self.encoder.output_size,
            attention,
            cfg.decoder,
        )
        self.generator = nn.Linear(self.decoder.output_size, trg_vocab_size, bias=False)
        if cfg.tie_embeddings:
            if self.decoder.output_size != cfg.embedding_size:
                raise ConfigError(
                    f"model.tie_embeddings: output size {self.decoder.output_size} differs "
                    f"from model.embedding_size {cfg.embedding_size}"
                )
            self.generator.weight = self.decoder.embed.weight
        self.trg_vocab_size = trg_vocab_size

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Memory, DecoderState]:
        """src: (B, S) -> attention memory and the decoder's initial state."""
        enc = self.encoder(src, src_lengths)
        memory = self.decoder.attention.prepare(enc.outputs, enc.mask)
        hidden, cell = self.bridge(enc)
        return memory, DecoderState(hidden, cell)

    def forward(self, src: Tensor, src_lengths: Tensor, trg_in: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: -> features (B, T, O), alphas (B, T, S)."""
        memory, state = self.encode(src, src_lengths)
        return self.decoder(trg_in, memory, state)

    def log_probs(self, features: Tensor) -> Tensor:
        """(..., O) -> (..., V) float32 log-probabilities."""
        return F.log_softmax(self.generator(features).float(), dim=-1)

    def loss(self, batch: Batch, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """Summed label-smoothed cross-entropy and summed plain NLL over target tokens.

        Returns (loss_sum, nll_sum); divide by ``batch.n_target_tokens`` for per-token means.
        The output layer runs over all steps at once, in row chunks.
        """
        features, _ = self(batch.src, batch.src_lengths, batch.trg_in)
        flat = features.reshape(-1, features.size(-1))  # (B*T, O)
        gold = batch.trg_out.reshape(-1)  # (B*T,)
        keep = gold != PAD_ID
        flat, gold = flat[keep], gold[keep]  # padding never reaches the output layer
        rows = max(1, LOSS_CHUNK_ELEMENTS // self.trg_vocab_size)
        loss_sum = flat.new_zeros((), dtype=torch.float32)
        nll_sum = flat.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.size(0), rows):
            log_probs = self.log_probs(flat[start : start + rows])  # (N, V) float32
            nll = -log_probs.gather(1, gold[start : start + rows, None]).squeeze(1)  # (N,)
            smooth = -log_probs.mean(dim=-1)  # (N,): uniform share eps/V over the vocabulary
            loss_sum = loss_sum + ((1 - label_smoothing) * nll + label_smoothing * smooth).sum()
            nll_sum = nll_sum + nll.detach().sum()
        return loss_sum, nll_sum


def build_model(cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int) -> Seq2Seq:
    return Seq2Seq(cfg, src_vocab_size, trg_vocab_size)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
