"""The encoder-decoder assembled from config; the training loss over all target steps."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt import native
from nmt.attention import Memory, build_attention
from nmt.config import ModelConfig
from nmt.data import Batch
from nmt.decoder import BahdanauDecoder, DecoderState, LuongDecoder
from nmt.encoder import Bridge, Encoder
from nmt.errors import ConfigError
from nmt.runtime import compute_dtype, fast_kernels
from nmt.tokenizer import PAD_ID

DECODERS: dict[str, type[BahdanauDecoder] | type[LuongDecoder]] = {
    "bahdanau": BahdanauDecoder,
    "luong": LuongDecoder,
}

# Logit rows whose softmax statistics are computed at once in float32: a (rows, V) float32
# temporary of about 4 MiB, so that the passes over it stay in cache and a (B*T, V) float32
# tensor is never materialised. The output layer's matmul covers LOSS_MATMUL_CHUNKS of them.
LOSS_CHUNK_ELEMENTS = 1 << 20
LOSS_MATMUL_CHUNKS = 8
LOG2_E = math.log2(math.e)


class OutputLayerLoss(torch.autograd.Function):
    """The output layer and its label-smoothed cross-entropy summed over rows, fused with the
    gradient.

    logits = features W^T (N, V); loss = sum_n (1 - eps) * (-log p_n[y_n]) + eps * mean_v(-log
    p_n[v]), the same as ``F.cross_entropy(logits, y, label_smoothing=eps, reduction="sum")``.
    Also returns the plain NLL sum (not differentiable) for perplexity.

    The loss's gradient at the logits, G = softmax - (1 - eps) * onehot(y) - eps / V, does not
    depend on the incoming gradient g (a scalar), so forward computes it chunk by chunk in
    float32 and stores it in the logits' own buffer, in the matmul dtype (bf16 under autocast,
    as the logits were). Backward is two matmuls with no pass over (N, V): d features = g G W
    and d W = g G^T features. With ``compiled`` (CPU training), nmt.native's kernel computes a
    whole matmul block's statistics and G in three passes instead of the chunked torch ops.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        features: Tensor,
        weight: Tensor,
        target: Tensor,
        eps: float,
        dtype: torch.dtype,
        keep_grad: bool,
        compiled: bool,
    ) -> tuple[Tensor, Tensor]:
        rows, vocab = features.size(0), weight.size(0)
        chunk = max(1, LOSS_CHUNK_ELEMENTS // vocab)
        block = chunk * LOSS_MATMUL_CHUNKS
        stats = features.new_empty(3, rows, dtype=torch.promote_types(dtype, torch.float32))
        with torch.autocast(features.device.type, enabled=False):
            x, w = features.to(dtype), weight.to(dtype)  # (N, O), (V, O)
            # G for every row when it is needed, else one block's logits at a time
            buffer = x.new_empty(rows if keep_grad else min(rows, block), vocab)  # (N, V)
            for start in range(0, rows, block):
                stop = min(rows, start + block)
                logits = buffer[start:stop] if keep_grad else buffer[: stop - start]
                torch.mm(x[start:stop], w.t(), out=logits)  # (n, V)
                compiled = compiled and native.softmax_xent(
                    logits, target[start:stop], stats[:, start:stop], eps, keep_grad
                )
                for first in range(start, stop, chunk) if not compiled else ():
                    last = min(stop, first + chunk)
                    _softmax_rows(
                        logits[first - start : last - start],
                        target[first:last, None],
                        stats[:, first:last],
                        eps if keep_grad else None,
                    )
            nll, smooth, p_target = stats  # (N,) each
            if keep_grad and not compiled:  # G at the targets, in float32 before the rounding
                positions = torch.arange(rows, device=x.device) * vocab + target
                at_target = p_target - (1.0 - eps) - eps / vocab
                buffer.view(-1)[positions] = at_target.to(dtype)
            if keep_grad:
                ctx.save_for_backward(buffer, x, w)
        ctx.dtypes = features.dtype, weight.dtype
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return ((1.0 - eps) * nll + eps * smooth).sum(), nll_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: Tensor, grad_nll: Tensor
    ) -> tuple[Tensor | None, ...]:
        grad, x, w = ctx.saved_tensors  # (N, V), (N, O), (V, O)
        grad_features = grad_weight = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_features = torch.mm(grad, w).to(ctx.dtypes[0]).mul_(grad_loss)
            if ctx.needs_input_grad[1]:
                grad_weight = torch.mm(grad.t(), x).to(ctx.dtypes[1]).mul_(grad_loss)
        return grad_features, grad_weight, None, None, None, None, None


def _softmax_rows(logits: Tensor, target: Tensor, stats: Tensor, eps: float | None) -> None:
    """One chunk of logits (n, V) and targets (n, 1) -> -log p[y], -mean_v log p[v] and p[y]
    into stats (3, n); with eps, also overwrites the logits with softmax - eps / V.

    The exponential is evaluated as 2^(x log2 e): torch's CPU float32 ``exp`` is several times
    slower than its ``exp2``.
    """
    z = logits.to(stats.dtype)  # (n, V); the logits themselves when already float32
    top = z.amax(-1, keepdim=True)  # (n, 1)
    mean = z.mean(-1)  # (n,)
    at_target = z.gather(1, target).squeeze(1)  # (n,)
    z.sub_(top).mul_(LOG2_E).exp2_()  # exp(logit - max)
    total = z.sum(-1, keepdim=True)  # (n, 1)
    log_z = total.log().add_(top).squeeze(1)  # log partition
    torch.sub(log_z, at_target, out=stats[0])
    torch.sub(log_z, mean, out=stats[1])
    if eps is None:
        return
    z.mul_(total.reciprocal_())  # softmax
    stats[2].copy_(z.gather(1, target).squeeze(1))
    if eps:
        z.sub_(eps / z.size(-1))
    logits.copy_(z)


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
        self.decoder: BahdanauDecoder | LuongDecoder = DECODERS[cfg.decoder.style](
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
        weight = self.generator.weight  # (V, O)
        dtype = compute_dtype(flat.device, torch.promote_types(flat.dtype, weight.dtype))
        keep_grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
        compiled = fast_kernels(flat.device)  # training on a CPU: the compiled kernel, if any
        return OutputLayerLoss.apply(
            flat, weight, gold, label_smoothing, dtype, keep_grad, compiled
        )


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
