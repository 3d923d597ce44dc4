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

# Logits rows handled at once in the loss, so that a (B*T, V) float32 tensor is never
# materialised whole (and the float32 temporaries stay cache-sized).
LOSS_CHUNK_ELEMENTS = 1 << 21


def _at_least_float32(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy summed over rows, fused with its gradient.

    loss = sum_n (1 - eps) * (-log p_n[y_n]) + eps * mean_v(-log p_n[v]), the same as
    ``F.cross_entropy(..., label_smoothing=eps, reduction="sum")``. The gradient with respect
    to the logits is softmax - (1 - eps) * onehot(y) - eps / V, computed directly in backward
    from the saved (possibly bf16) logits and the log-partition, which avoids the separate
    log-softmax, gather and mean passes of the composed version. Also returns the plain NLL sum
    (not differentiable) for perplexity.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        x = _at_least_float32(logits)  # (N, V)
        log_z = torch.logsumexp(x, dim=-1)  # (N,)
        nll = log_z - x.gather(1, target[:, None]).squeeze(1)  # (N,)
        smooth = log_z - x.mean(dim=-1)  # (N,)
        ctx.save_for_backward(logits, target, log_z)
        ctx.eps = eps
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return ((1.0 - eps) * nll + eps * smooth).sum(), nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, target, log_z = ctx.saved_tensors
        eps = ctx.eps
        # (softmax - eps/V) * g, then - (1 - eps) * g at the targets; the subtraction of
        # log Z promotes (b)f16 logits to float32 in the same pass
        grad = torch.sub(logits, log_z[:, None]).exp_()  # (N, V) softmax
        grad.mul_(grad_loss).sub_(grad_loss * (eps / logits.size(-1)))
        at_target = (grad_loss * (eps - 1.0)).to(grad.dtype).expand(target.size(0), 1)
        grad.scatter_add_(1, target[:, None], at_target)
        return grad.to(logits.dtype), None, None


class Seq2Seq(nn.Module):
    """Attention-based RNN encoder-decoder (Bahdanau et al. 2015; Luong et al. 2015)."""

    def __init__(self, cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int):
        super().__init__()
        self.encoder = Encoder(
            src_vocab_size, cfg.embedding_size, cfg.embedding_dropout, cfg.encoder
        )
        self.bridge = Bridge(self.encoder, cfg.decoder)
        attention = build_attention(
            cfg.attention, query_size=cfg.decoder.hidden_size, key_size=self.encoder.output_size
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
            logits = self.generator(flat[start : start + rows])  # (N, V)
            loss, nll = SmoothedCrossEntropy.apply(
                logits, gold[start : start + rows], label_smoothing
            )
            loss_sum = loss_sum + loss
            nll_sum = nll_sum + nll
        return loss_sum, nll_sum


class TrainingLoss(nn.Module):
    """The model's training loss as a module whose forward returns it, so that
    DistributedDataParallel (which hooks ``forward``) can wrap it; the weights stay those of
    ``model``."""

    def __init__(self, model: Seq2Seq, label_smoothing: float):
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """-> (loss_sum, nll_sum), scalars summed over the batch's target tokens."""
        return self.model.loss(batch, self.label_smoothing)


def build_model(cfg: ModelConfig, src_vocab_size: int, trg_vocab_size: int) -> Seq2Seq:
    return Seq2Seq(cfg, src_vocab_size, trg_vocab_size)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
