"""Attention score functions behind one call signature.

Every module turns queries (decoder states) and the encoder states into weights over source
positions and a context vector:

    alphas = softmax_s(score(q_t, k_s)) over real (non-padded) positions s
    context_t = sum_s alphas[t, s] * h_s

Keys are projected once per batch in ``prepare`` (not once per decoder step); ``forward``
takes any number of query steps T at once, so a decoder that does not need step-by-step
attention can attend for the whole target in one batched matmul. ``positions`` are the target
step indices of the T queries (0-based); only Luong's local-m attention reads them.

The weights are computed in (at least) float32 whatever the autocast dtype, and a float64
module stays float64 end to end, so references can be checked to round-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt.config import CONTENT_SCORES, SCORES, AttentionConfig
from nmt.errors import ConfigError
from nmt.runtime import compute_dtype, fast_kernels
from nmt.sinks import SinkCast


class GradientSink:
    """A memory tensor (B, S, F) that every step of a step-by-step decoder multiplies with
    during training, whose gradient is formed once instead of step by step.

    Through plain autograd each step would add a (B, S, F) product to the tensor's gradient,
    and under autocast also cast the tensor and each step's gradient between float32 and the
    autocast dtype: at the benchmark sizes a fifth of a Bahdanau training step. Here ``tensor``
    is a copy in the compute dtype, made once per batch; each step's product (``product``)
    records its other factor and its output gradient in backward, and when the backward pass
    reaches the copy, its gradient is one batched matmul over all recorded steps.
    """

    def __init__(self, tensor: Tensor):
        self.records: list[tuple[Tensor, Tensor, bool]] = []  # (factor, gradient, transposed)
        dtype = compute_dtype(tensor.device, tensor.dtype)
        self.tensor: Tensor = SinkCast.apply(tensor, self, dtype)

    def gradient(self) -> Tensor | None:
        """sum over steps of a^T g (out = a M) or g^T a (out = a M^T): (B, S, F)."""
        total = None
        for transposed in (False, True):
            factors = [(a, g) for a, g, t in self.records if t == transposed]
            if not factors:
                continue
            a = torch.cat([f[0] for f in factors], dim=1)  # (B, T, S) or (B, T, F)
            g = torch.cat([f[1] for f in factors], dim=1)  # (B, T, F) or (B, T, S)
            part = (
                torch.bmm(g.transpose(1, 2), a) if transposed else torch.bmm(a.transpose(1, 2), g)
            )
            total = part if total is None else total + part
        self.records.clear()
        return total


class _SinkProduct(torch.autograd.Function):
    """a @ M (or a @ M^T) for M a sink's tensor: the gradient of a now, M's recorded."""

    @staticmethod
    def forward(ctx, a: Tensor, m: Tensor, sink: GradientSink, transposed: bool) -> Tensor:  # type: ignore[override]
        a_cast = a.to(m.dtype)
        ctx.save_for_backward(a_cast, m)
        ctx.sink, ctx.transposed, ctx.dtype = sink, transposed, a.dtype
        return torch.bmm(a_cast, m.transpose(1, 2) if transposed else m)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        a, m = ctx.saved_tensors
        grad = grad.to(m.dtype)
        ctx.sink.records.append((a, grad, ctx.transposed))
        grad_a = torch.bmm(grad, m if ctx.transposed else m.transpose(1, 2))
        return grad_a.to(ctx.dtype), None, None, None


def product(a: Tensor, m: Tensor, sink: GradientSink | None, transposed: bool = False) -> Tensor:
    """(B, T, X) @ m (B, X, F), or @ m^T for m (B, S, X) when ``transposed``; through ``sink``
    when m is its tensor."""
    if sink is not None:
        return _SinkProduct.apply(a, m, sink, transposed)
    return torch.bmm(a.to(m.dtype), m.transpose(1, 2) if transposed else m)


@dataclass
class Memory:
    """Encoder states prepared for attention.

    values: (B, S, Hk) encoder outputs; keys: (B, S, A) projected keys ((B, h, S, Hk/h) for
    multihead); mask: (B, S) True at real positions; projected_values: multihead's per-head
    values (B, h, S, Hk/h), else None; value_sink/key_sink: set when ``values``/``keys`` are
    a ``GradientSink``'s tensor (``Attention.for_steps``).
    """

    values: Tensor
    keys: Tensor
    mask: Tensor
    projected_values: Tensor | None = None
    value_sink: GradientSink | None = None
    key_sink: GradientSink | None = None

    def index_select(self, index: Tensor) -> Memory:
        assert self.value_sink is None and self.key_sink is None, "a training-only memory"
        projected = self.projected_values
        return Memory(
            self.values[index],
            self.keys[index],
            self.mask[index],
            projected[index] if projected is not None else None,
        )


def _wide(x: Tensor) -> Tensor:
    """x in float32, or in float64 if it already is (never narrower than float32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_softmax(energies: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis in float32 (float64 stays float64); masked positions get
    exactly zero weight.

    energies: (B, ..., S); mask: (B, S), or the full shape of ``energies``, True where real.
    The fill value is the minimum of the dtype the softmax runs in, so no mask constant can
    overflow in fp16/bf16. Every row must keep at least one real position.
    """
    energies = _wide(energies)
    if mask.dim() < energies.dim():
        mask = mask.view(mask.size(0), *[1] * (energies.dim() - mask.dim()), mask.size(-1))
    energies = energies.masked_fill(~mask, torch.finfo(energies.dtype).min)
    return torch.softmax(energies, dim=-1)


class Attention(nn.Module):
    """Base class: subclasses define ``project_keys`` and ``energies`` (content scores) or
    override ``alphas`` / ``forward`` (location, local, multihead)."""

    keys_in_product = False  # energies are query @ keys^T (dot, general, cosine)
    context_in_product = True  # context is alphas @ values (all but multihead)

    def __init__(self, query_size: int, key_size: int):
        super().__init__()
        self.query_size = query_size
        self.key_size = key_size

    def for_steps(self, memory: Memory) -> Memory:
        """The memory a step-by-step decoder attends to in training: values (and keys, where
        the energies are a product with them) behind a ``GradientSink`` each."""
        if not torch.is_grad_enabled():
            return memory
        values, keys = memory.values, memory.keys
        value_sink = key_sink = None
        if self.context_in_product and values.requires_grad:
            value_sink = GradientSink(values)
            values = value_sink.tensor
        if self.keys_in_product and keys.requires_grad:
            key_sink = GradientSink(keys)
            keys = key_sink.tensor
        return Memory(values, keys, memory.mask, memory.projected_values, value_sink, key_sink)

    def project_keys(self, values: Tensor) -> Tensor:
        """(B, S, Hk) -> (B, S, A); once per batch."""
        return values

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        return Memory(values, self.project_keys(values), mask)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        """(B, T, Hq) -> (B, T, S) unnormalised scores."""
        raise NotImplementedError

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        """(B, T, Hq) -> (B, T, S) float32 weights, zero at padding."""
        return masked_softmax(self.energies(query, memory), memory.mask)

    def forward(
        self, query: Tensor, memory: Memory, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """query: (B, T, Hq); positions: (T,) target steps or None (0..T-1)
        -> context (B, T, Hk), alphas (B, T, S) float32."""
        alphas = self.alphas(query, memory, positions)  # (B, T, S)
        context = product(alphas, memory.values, memory.value_sink)  # (B, T, Hk)
        return context, alphas


class AdditiveAttention(Attention):
    """Bahdanau et al. (2015), eq. 6 / appendix A.1.2: e = v^T tanh(W_q q + W_k k); Luong
    et al. (2015), eq. 8 'concat'."""

    def __init__(self, query_size: int, key_size: int, hidden_size: int):
        super().__init__(query_size, key_size)
        self.query_proj = nn.Linear(query_size, hidden_size, bias=False)
        self.key_proj = nn.Linear(key_size, hidden_size, bias=True)
        self.v = nn.Linear(hidden_size, 1, bias=False)

    def project_keys(self, values: Tensor) -> Tensor:
        return self.key_proj(values)  # (B, S, A)

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        q = self.query_proj(query)  # (B, T, A)
        if fast_kernels(query.device):
            return _AdditiveEnergies.apply(q, memory.keys, self.v.weight)
        hidden = torch.tanh(q[:, :, None, :] + memory.keys[:, None, :, :])  # (B, T, S, A)
        return self.v(hidden).squeeze(-1)  # (B, T, S)


class _AdditiveEnergies(torch.autograd.Function):
    """e = v^T tanh(q + k) for every (query, key) pair, as ``AdditiveAttention.energies``,
    keeping only q, k and v for the backward pass, which recomputes the (B, T, S, A) layer.
    Kept, that layer was a fifth of a Bahdanau training step's peak memory (one per decoder
    step); recomputed, it costs an add and a sigmoid per step (docs/benchmarks.md).

    The layer is formed as s = sigmoid(2 (q + k)), since tanh(x) = 2 sigmoid(2x) - 1 and
    torch's CPU sigmoid is three times faster than its tanh: e = (2 v)^T s - sum(v), and in
    backward 1 - tanh^2 = 4 s (1 - s), so no pass over the layer is added. Runs in the
    autocast dtype when autocast is on, like the modules it replaces."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.dtypes = (q.dtype, keys.dtype, v.dtype)  # of the gradients backward returns
        dtype = compute_dtype(q.device, v.dtype)
        q, keys, v_cast = q.to(dtype), keys.to(dtype), v.to(dtype)
        ctx.save_for_backward(q, keys, v_cast)
        with torch.autocast(q.device.type, enabled=False):
            layer = _sigmoid_layer(q, keys)  # (B, T, S, A)
            energies = torch.matmul(layer, 2 * v_cast.squeeze(0))  # (B, T, S)
            return energies.sub_(v_cast.sum())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        q, keys, v = ctx.saved_tensors
        q_dtype, keys_dtype, v_dtype = ctx.dtypes
        grad = grad.to(v.dtype)
        layer = _sigmoid_layer(q, keys)  # (B, T, S, A)
        size = layer.size(-1)
        # d e / d v = tanh = 2 s - 1
        grad_v = grad.reshape(1, -1).mm(layer.view(-1, size)).mul_(2).sub_(grad.sum())  # (1, A)
        grad_layer = grad.reshape(-1, 1).mm(4 * v).view_as(layer)  # 4 g v^T at every (t, s)
        grad_pre = torch.ops.aten.sigmoid_backward(grad_layer, layer)  # * s (1 - s)
        # a step-by-step decoder has T = 1, where sum(1) would copy the whole layer
        grad_keys = grad_pre.squeeze(1) if grad_pre.size(1) == 1 else grad_pre.sum(1)
        return grad_pre.sum(2).to(q_dtype), grad_keys.to(keys_dtype), grad_v.to(v_dtype)


def _sigmoid_layer(q: Tensor, keys: Tensor) -> Tensor:
    """sigmoid(2 (q_t + k_s)): (B, T, A), (B, S, A) -> (B, T, S, A)."""
    return torch.add(2 * q[:, :, None, :], keys[:, None, :, :], alpha=2).sigmoid_()


class DotAttention(Attention):
    """Luong et al. (2015), eq. 8 'dot': e = g q^T k.

    ``scale``: none (g = 1); fixed (g = 1/sqrt(d), Vaswani et al. 2017, eq. 1; the
    ``scaled_dot`` score); learned (a scalar g initialised to 1, as Keras' ``use_scale``).
    A fixed scale is folded into the keys once per batch.
    """

    keys_in_product = True

    def __init__(self, query_size: int, key_size: int, scale: str = "none"):
        super().__init__(query_size, key_size)
        self.fixed_scale = 1.0 / math.sqrt(query_size) if scale == "fixed" else 1.0
        self.scale = nn.Parameter(torch.ones(())) if scale == "learned" else None

    def project_keys(self, values: Tensor) -> Tensor:
        return values * self.fixed_scale if self.fixed_scale != 1.0 else values

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        energies = product(query, memory.keys, memory.key_sink, transposed=True)  # (B, T, S)
        return energies * self.scale if self.scale is not None else energies


class GeneralAttention(Attention):
    """Luong et al. (2015), eq. 8 'general' (bilinear): e = g q^T W_a k, W_a k precomputed.

    ``scale`` as for :class:`DotAttention`, with d the query size.
    """

    keys_in_product = True

    def __init__(self, query_size: int, key_size: int, scale: str = "none"):
        super().__init__(query_size, key_size)
        self.key_proj = nn.Linear(key_size, query_size, bias=False)
        self.fixed_scale = 1.0 / math.sqrt(query_size) if scale == "fixed" else 1.0
        self.scale = nn.Parameter(torch.ones(())) if scale == "learned" else None

    def project_keys(self, values: Tensor) -> Tensor:
        keys = self.key_proj(values)  # (B, S, Hq)
        return keys * self.fixed_scale if self.fixed_scale != 1.0 else keys

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        energies = product(query, memory.keys, memory.key_sink, transposed=True)  # (B, T, S)
        return energies * self.scale if self.scale is not None else energies


def _unit(x: Tensor, eps: float) -> Tensor:
    """x / max(||x||, eps) along the last axis, the norm in float32 (fp16 would underflow)."""
    wide = _wide(x)
    return (wide / torch.linalg.vector_norm(wide, dim=-1, keepdim=True).clamp(min=eps)).to(x.dtype)


class CosineAttention(Attention):
    """Content-based addressing of Neural Turing Machines (Graves et al. 2014, eq. 5-6):
    e = beta * cos(q, k) = beta * q^T k / (||q|| ||k||), each norm clamped below at ``eps``
    so that a zero vector scores 0 instead of NaN.

    cos is bounded by 1, so beta sets how peaked the weights can get; it is fixed or, with
    ``learn_beta``, a scalar parameter initialised to ``beta``. Keys are normalised once per
    batch.
    """

    keys_in_product = True

    def __init__(
        self,
        query_size: int,
        key_size: int,
        beta: float = 5.0,
        learn_beta: bool = False,
        eps: float = 1e-8,
    ):
        super().__init__(query_size, key_size)
        self.beta: Tensor | float = nn.Parameter(torch.tensor(float(beta))) if learn_beta else beta
        self.eps = eps

    def project_keys(self, values: Tensor) -> Tensor:
        return _unit(values, self.eps)  # (B, S, Hk) unit rows

    def energies(self, query: Tensor, memory: Memory) -> Tensor:
        unit = _unit(query, self.eps)
        cosines = product(unit, memory.keys, memory.key_sink, transposed=True)  # (B, T, S)
        return self.beta * cosines


class LocationAttention(Attention):
    """Luong et al. (2015), eq. 8 'location': a_t = softmax(W_a h_t), W_a with one row per
    source position up to ``max_source_length``, truncated to each sentence's length (the
    softmax runs over its real positions only). Positions at or beyond ``max_source_length``
    get no weight: the model cannot address them.
    """

    def __init__(self, query_size: int, key_size: int, max_source_length: int):
        super().__init__(query_size, key_size)
        self.max_source_length = max_source_length
        self.location_proj = nn.Linear(query_size, max_source_length, bias=False)  # W_a

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        width = memory.mask.size(1)
        energies = self.location_proj(query)  # (B, T, L)
        mask = memory.mask  # (B, S)
        if width <= self.max_source_length:
            energies = energies[..., :width]  # (B, T, S)
        else:
            energies = nn.functional.pad(energies, (0, width - self.max_source_length))
            reachable = torch.arange(width, device=mask.device) < self.max_source_length
            mask = mask & reachable  # (B, S)
        return masked_softmax(energies, mask)


class MultiHeadAttention(Attention):
    """Vaswani et al. (2017), section 3.2.2: head_i = softmax(Q W^Q_i (K W^K_i)^T / sqrt(d_k))
    V W^V_i, output Concat(head_1..head_h) W^O; here K = V = the encoder states, Q the decoder
    state, d_k = key size / h, and W^O maps back to the key size so decoders keep their shapes.
    Keys and values are projected once per batch. The returned alphas (for plots) are the
    mean of the heads' weights; the context is not sum_s alphas h_s.
    """

    context_in_product = False

    def __init__(self, query_size: int, key_size: int, heads: int):
        super().__init__(query_size, key_size)
        if key_size % heads:
            raise ConfigError(
                f"model.attention.heads: {heads} heads do not divide the key size {key_size}; "
                f"use one of {', '.join(map(str, _divisors(key_size)))}"
            )
        self.heads = heads
        self.head_size = key_size // heads
        self.query_proj = nn.Linear(query_size, key_size, bias=False)  # W^Q_1..h stacked
        self.key_proj = nn.Linear(key_size, key_size, bias=False)  # W^K_1..h
        self.value_proj = nn.Linear(key_size, key_size, bias=False)  # W^V_1..h
        self.output_proj = nn.Linear(key_size, key_size, bias=False)  # W^O

    def _split(self, x: Tensor) -> Tensor:
        """(B, L, h*d) -> (B, h, L, d)."""
        return x.view(x.size(0), x.size(1), self.heads, self.head_size).transpose(1, 2)

    def prepare(self, values: Tensor, mask: Tensor) -> Memory:
        keys = self._split(self.key_proj(values)) / math.sqrt(self.head_size)  # (B, h, S, d)
        return Memory(values, keys, mask, self._split(self.value_proj(values)))

    def forward(
        self, query: Tensor, memory: Memory, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """query: (B, T, Hq) -> context (B, T, Hk), alphas (B, T, S) mean over heads."""
        assert memory.projected_values is not None
        batch, steps = query.size(0), query.size(1)
        q = self._split(self.query_proj(query))  # (B, h, T, d)
        weights = masked_softmax(q @ memory.keys.transpose(2, 3), memory.mask)  # (B, h, T, S)
        heads = weights.to(memory.projected_values.dtype) @ memory.projected_values  # (B, h, T, d)
        concat = heads.transpose(1, 2).reshape(batch, steps, self.key_size)  # (B, T, Hk)
        return self.output_proj(concat), weights.mean(dim=1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class LocalAttention(Attention):
    """Luong et al. (2015), section 3.2: attend only inside the window [p_t - D, p_t + D].

    The alignment is the softmax of an inner content score over the real source positions s
    with |s - p_t| <= D (eq. 7 restricted to the window); outside it the weight is exactly 0.

    - ``local-m`` (monotonic): p_t = t, the target step, clamped to the last source word so that
      a target longer than its source keeps a non-empty window.
    - ``local-p`` (predictive): p_t = S * sigmoid(v_p^T tanh(W_p h_t)) (eq. 9), S the length of
      each sentence, and a_t(s) = align(h_t, h_s) exp(-(s - p_t)^2 / (2 sigma^2)), sigma = D/2
      (eq. 10). As in the paper the Gaussian is not renormalised: rows sum to at most 1.

    Source positions s are 0-based. The inner energies are computed for all S positions and
    masked, which is cheaper than gathering windows for the sentence lengths NMT sees.
    """

    def __init__(
        self, inner: Attention, query_size: int, window: int, predictive: bool, hidden_size: int
    ):
        super().__init__(query_size, inner.key_size)
        self.inner = inner
        self.keys_in_product = inner.keys_in_product
        self.window = window
        self.predictive = predictive
        if predictive:
            self.position_proj = nn.Linear(query_size, hidden_size, bias=False)  # W_p
            self.position_v = nn.Linear(hidden_size, 1, bias=False)  # v_p

    def project_keys(self, values: Tensor) -> Tensor:
        return self.inner.project_keys(values)

    def centres(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        """p_t: (B, T), in float32 (float64 for a float64 query)."""
        lengths = memory.mask.sum(dim=1)  # (B,)
        dtype = torch.promote_types(query.dtype, torch.float32)
        if self.predictive:
            logits = self.position_v(torch.tanh(self.position_proj(query))).squeeze(-1)  # (B, T)
            return lengths[:, None].to(dtype) * torch.sigmoid(logits.to(dtype))
        if positions is None:
            positions = torch.arange(query.size(1), device=query.device)
        steps = positions.to(query.device)[None, :]  # (1, T)
        return torch.minimum(steps, lengths[:, None] - 1).to(dtype)  # (B, T)

    def alignment(
        self, query: Tensor, memory: Memory, positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """-> window softmax align(h_t, h_s) (B, T, S), and s - p_t (B, T, S)."""
        centres = self.centres(query, memory, positions)  # (B, T)
        source = torch.arange(memory.mask.size(1), device=query.device)  # (S,)
        distance = source.to(centres.dtype) - centres[..., None]  # (B, T, S)
        inside = memory.mask[:, None, :] & (distance.abs() <= self.window)  # (B, T, S)
        return masked_softmax(self.inner.energies(query, memory), inside), distance

    def alphas(self, query: Tensor, memory: Memory, positions: Tensor | None) -> Tensor:
        align, distance = self.alignment(query, memory, positions)  # (B, T, S) each
        if not self.predictive:
            return align
        sigma = self.window / 2
        return align * torch.exp(-distance.square() / (2 * sigma**2)).to(align.dtype)


def _check_equal(score: str, key: str, query_size: int, key_size: int) -> None:
    if query_size != key_size:
        raise ConfigError(
            f"{key}: {score!r} needs equal query ({query_size}) and key ({key_size}) sizes; "
            f"use 'general' or 'additive'"
        )


def _content_attention(
    score: str, cfg: AttentionConfig, query_size: int, key_size: int, key: str
) -> Attention:
    """The scores of one query and one key; ``key`` names the config key in errors."""
    if score in ("additive", "concat", "mlp"):
        return AdditiveAttention(query_size, key_size, cfg.hidden_size or query_size)
    if score in ("dot", "scaled_dot"):
        _check_equal(score, key, query_size, key_size)
        scale = "fixed" if score == "scaled_dot" else cfg.scale
        return DotAttention(query_size, key_size, scale)
    if score in ("general", "bilinear", "multiplicative"):
        return GeneralAttention(query_size, key_size, cfg.scale)
    if score == "cosine":
        _check_equal(score, key, query_size, key_size)
        return CosineAttention(query_size, key_size, cfg.beta, cfg.learn_beta)
    names = SCORES if key.endswith(".score") else CONTENT_SCORES
    raise ConfigError(f"{key}: {score!r} is not available; expected one of {', '.join(names)}")


def build_attention(
    cfg: AttentionConfig | str, query_size: int, key_size: int, hidden_size: int | None = None
) -> Attention:
    """Map the attention config (or a bare score name, with every other key at its default) to
    its module; list the valid names on error."""
    if isinstance(cfg, str):  # unvalidated on purpose: a bad name gets the ConfigError below
        cfg = AttentionConfig.model_construct(score=cfg, hidden_size=hidden_size)
    if cfg.score == "location":
        return LocationAttention(query_size, key_size, cfg.max_source_length)
    if cfg.score == "multihead":
        return MultiHeadAttention(query_size, key_size, cfg.heads)
    if cfg.score in ("local-m", "local-p"):
        inner = _content_attention(
            cfg.local_score, cfg, query_size, key_size, "model.attention.local_score"
        )
        hidden = cfg.hidden_size or query_size
        return LocalAttention(inner, query_size, cfg.window, cfg.score == "local-p", hidden)
    return _content_attention(cfg.score, cfg, query_size, key_size, "model.attention.score")
