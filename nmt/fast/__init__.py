"""nmt's speed paths, each behind one seam of ``FastPaths``, each beside its plain PyTorch path.

A model is built with one ``FastPaths``
(``nmt.model.build_model(..., fast=...)``); its modules keep it and call its seams, never a
global switch. It is a few named choices, made once when the model is built; each seam
reads the choice it belongs to and what it is given (the device, training or search, the
dtype), and ``FastPaths.plain()`` turns every one off for the reference:

- ``cpu_kernels`` (the config's ``run.fast_kernels``): training's CPU paths. They run for
  CPU tensors in a module's training mode, where their gain is (the backward pass);
  evaluation and search take the plain path.
- ``native_kernels``: whether nmt's compiled C kernels (``fast.compiled``) run training's
  recurrence and the loss's softmax, and search's log-softmax, top-k, decoder RNN's gates
  and dot-product attention; where no C compiler works, the module's own RNN and torch's
  ops run instead. Its default is on
  unless the environment says ``NMT_NATIVE_KERNELS=0``, read when the ``FastPaths`` is made,
  i.e. when the model is built; no other code decides by that variable
  (``compiled.status()`` reports the default for the run's record; a search's decoding plan,
  ``nmt.decoding.plan``, says whether they ran).
- ``fused``: autograd rearranged so that a step-by-step decoder's shared tensors get their
  gradient once per batch, and the output layer's loss never holds a float32 (N, V) tensor.
  On every device.
- ``search_tables``: what search makes once per model instead of at every step. The
  embedding's part of a step-by-step decoder's first RNN gates is looked up in a table
  (``fast.cells.input_gate_table``), on every device; so is the encoder's first RNN layer's
  on a CPU, whose loop over time search then runs as training's recurrence does
  (``fast.recurrence.gate_table``). A beam search with a Luong decoder over a memory its beams share
  multiplies W_c's context half into the values once per batch
  (``LuongDecoder.for_search``). Search's products by fixed weights on a CPU (the output
  layer's W_o, the decoder's W_hh and Luong's W_c) multiply from layouts prepared once for
  oneDNN (``fast.packed.Product``) where torch has oneDNN. A Translator makes the tables
  once for its models, in float32; a shortlist takes its rows of W_o.
- ``graphs``: ``"off"``, or training's CUDA graphs on a GPU (``training.cuda_graphs``):
  the teacher-forced unroll of a step-by-step decoder is graph-ready (its RNN steps through
  matmuls, ``fast.cells``) and the model captures it (``fast.graphs``): ``"loss"``, the
  whole training loss where the encoder is a GRU (``Seq2Seq.static_loss``), else the
  unroll; ``"unroll"``, the unroll alone (``training.cuda_graphs_scope``).

| seam | fast path | plain path | when |
| --- | --- | --- | --- |
| ``recurrence`` | ``fast.recurrence.run_rnn`` (compiled step kernels: native_kernels, float32 weights) | the module, packed; for a static batch (a captured training step) ``fast.recurrence.unpacked_rnn``, each direction over the padded rows | cpu_kernels, training, CPU |
| ``dropout`` | ``fast.dropout.FastDropout`` (16-bit masks) | ``nn.Dropout`` | cpu_kernels, training, CPU |
| ``additive_energies`` | ``fast.additive.RecomputedEnergies`` | broadcast v^T tanh(q + k) | cpu_kernels, training, CPU |
| ``step_products`` | ``fast.sinks.SinkProducts`` (with graphs on, a step's ``linear`` too: Bahdanau's W_q) | ``fast.sinks.Products`` | fused, training |
| ``search_products`` | ``fast.attend.KernelProducts``: a dot-product score's energies, mask, softmax and context as ``fast.compiled.attend`` | ``fast.sinks.Products`` | native_kernels, search without gradients, CPU, float32 |
| ``step_linear`` | ``fast.sinks.WeightSink`` | the ``nn.Linear`` | fused, training |
| ``step_rnn`` | ``fast.cells.rnn_step`` (capturable; each layer's gates as torch's fused cell on a GPU) | the module's call | graphs on, training |
| ``teacher_steps`` | ``fast.cells.teacher_steps``: the embedding's first-layer input gates of every position in one product, each step's W_ih and W_hh (with their biases) behind ``fast.sinks.WeightSink`` | each step multiplies its whole input | graphs on, fused, training |
| ``input_gate_table`` | ``fast.cells.input_gate_table``, then ``step_rnn``'s ``rnn_step`` (each layer's gates as ``fast.compiled.rnn_cell``: native_kernels, evaluation without gradients, CPU, float32) | the module's call | search_tables, a Translator's search in float32 |
| ``source_rnn`` | ``fast.recurrence.run_rnn`` with the encoder's first-layer input gates looked up (``source_gates``: ``fast.recurrence.gate_table``; native_kernels) | the module, packed | search_tables, a Translator's search in float32 on a CPU |
| ``output_loss`` | ``fast.loss.OutputLayerLoss`` (compiled kernel: cpu_kernels, native_kernels, training, CPU) | ``F.cross_entropy`` | fused |
| ``product`` | ``fast.packed.Product`` from oneDNN's prepared layout (two rows or more) | the weight transposed, contiguous | search_tables, a Translator's search in float32 on a CPU |
| ``log_softmax`` | ``fast.compiled.log_softmax_`` (in place, the mask inside) | ``masked_fill``, ``F.log_softmax`` | native_kernels, evaluation, CPU, float32 |

Search's top-k (``fast.topk``) takes the compiled kernel too where the stepper's
``native_kernels`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.fast import (
    additive,
    attend,
    cells,
    compiled,
    loss,
    packed,
    recurrence,
    sinks,
)
from nmt.fast.dropout import FastDropout

Graphs = Literal["off", "unroll", "loss"]


@dataclass(frozen=True)
class FastPaths:
    """Which speed paths a model takes; see the module docstring."""

    cpu_kernels: bool = True
    native_kernels: bool = field(default_factory=compiled.enabled_by_default)
    fused: bool = True
    search_tables: bool = True
    graphs: Graphs = "off"

    @classmethod
    def plain(cls) -> FastPaths:
        """Plain PyTorch everywhere: the reference the fast paths are tested against."""
        return cls(cpu_kernels=False, native_kernels=False, fused=False, search_tables=False)

    def _cpu(self, tensor: Tensor, training: bool) -> bool:
        return self.cpu_kernels and training and tensor.device.type == "cpu"

    def recurrence(
        self,
        rnn: nn.RNNBase,
        inputs: Tensor,
        lengths: Tensor | None,
        state: recurrence.RNNState | None,
        training: bool,
        static: bool = False,
    ) -> tuple[Tensor, recurrence.RNNState]:
        """A batch-first GRU/LSTM over inputs (B, T, I); lengths (B,), or None when every
        position is real -> outputs (B, T, D*H), zero past each end, and the final state (at
        each sentence's last token) in the module's layout. ``static``: the lengths are on
        the inputs' device and read nowhere on the host, and no shape depends on them (a
        captured training step, ``Seq2Seq.static_loss``; a GRU)."""
        if static and lengths is not None and not self._cpu(inputs, training):
            assert not isinstance(state, tuple), "the static path runs a GRU"
            return recurrence.unpacked_rnn(rnn, inputs, lengths, state, training)
        if (
            self._cpu(inputs, training)
            and self.native_kernels
            and recurrence.runs_here(rnn, inputs)
        ):
            mask = (
                None
                if lengths is None
                else recurrence.real_positions(lengths, inputs.size(1), inputs.device)
            )
            return recurrence.run_rnn(rnn, inputs, mask, state)
        return recurrence.plain_rnn(rnn, inputs, lengths, state)

    def step_rnn(
        self,
        rnn: nn.RNNBase,
        inputs: Tensor | None,
        state: cells.RNNState,
        training: bool,
        first_gates: Tensor | None = None,
        hidden: Sequence[Callable[[Tensor], Tensor]] | None = None,
        input_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
    ) -> tuple[Tensor, cells.RNNState]:
        """One step of a decoder's RNN: inputs (B, 1, I), state (L, B, H) -> output
        (B, 1, H), the next state. With ``first_gates`` (search: ``input_gate_table``;
        teacher forcing: ``teacher_steps``), the first layer's gates of the embedding, and
        inputs the rest (B, 1, I - E) or None; then ``hidden``, each layer's
        h W_hh^T + b_hh (``StepProducts``, ``TeacherSteps``), and ``input_products``, each
        layer's product by W_ih (``TeacherSteps``), if given."""
        if first_gates is not None:
            native = self.native_kernels and not training and not torch.is_grad_enabled()
            return cells.rnn_step(
                rnn,
                inputs,
                state,
                first_gates,
                native=native,
                hidden_products=hidden,
                input_products=input_products,
            )
        assert inputs is not None
        if self.graphs != "off" and training:
            return cells.rnn_step(rnn, inputs, state)
        return recurrence.plain_rnn(rnn, inputs, None, state)

    def teacher_steps(
        self, rnn: nn.RNNBase, embedded: Tensor, training: bool
    ) -> cells.TeacherSteps | None:
        """A step-by-step decoder's teacher-forced unroll on the graph-ready path (graphs,
        fused, training): its RNN's first-layer input gates of every position's embedding
        (B, T, E) in one product, and each layer's other products behind weight sinks
        (``cells.teacher_steps``); None: each step multiplies its whole input."""
        if not (self.graphs != "off" and self.fused and training):
            return None
        return cells.teacher_steps(rnn, embedded)

    def input_gate_table(self, embed: nn.Embedding, rnn: nn.RNNBase) -> Tensor | None:
        """A step-by-step decoder's first-layer input gates of every target piece's
        embedding (V, G*H), for search to look up (``cells.input_gate_table``), or None."""
        return cells.input_gate_table(embed, rnn) if self.search_tables else None

    def source_gates(self, embed: nn.Embedding, rnn: nn.RNNBase) -> Tensor | None:
        """An encoder's first RNN layer's input gates of every source piece (D, V, G*H), for
        search on a CPU to look up (``recurrence.gate_table``, ``source_rnn``), or None."""
        if not (self.search_tables and self.native_kernels):
            return None
        return recurrence.gate_table(embed, rnn)

    def source_rnn(
        self, rnn: nn.RNNBase, table: Tensor, src: Tensor, lengths: Tensor
    ) -> tuple[Tensor, cells.RNNState]:
        """Search's encoder RNN over source ids src (B, S) with lengths (B,), without
        gradient: the first layer's input gates looked up in ``table`` (``source_gates``), the
        recurrence as training's (``recurrence.run_rnn``) -> as ``recurrence``'s."""
        mask = recurrence.real_positions(lengths, src.size(1), src.device)
        return recurrence.run_rnn(rnn, None, mask, None, recurrence.looked_up(table, src))

    def product(self, weight: Tensor, bias: Tensor | None = None) -> packed.Product:
        """Search's product x W^T + b by a fixed float32 weight W (O, I) on a CPU
        (``fast.packed``): from oneDNN's prepared layout where ``search_tables`` and
        oneDNN are there, else by W transposed."""
        return packed.Product(weight, self.search_tables and packed.available(), bias)

    def dropout(self, p: float) -> nn.Module:
        """A dropout module with probability p."""
        return FastDropout(p) if self.cpu_kernels else nn.Dropout(p)

    def additive_energies(self, q: Tensor, keys: Tensor, v: Tensor, training: bool) -> Tensor:
        """v^T tanh(q_t + k_s): q (B, T, A), keys (B, S, A), v (1, A) -> (B, T, S)."""
        return additive.additive_energies(q, keys, v, recompute=self._cpu(q, training))

    def step_products(self, training: bool) -> sinks.Products:
        """How the attention memory is multiplied at every step of a teacher-forced
        step-by-step decoder."""
        if not (self.fused and training):
            return sinks.PLAIN_PRODUCTS
        return sinks.SinkProducts(weights=self.graphs != "off")

    def search_products(self) -> sinks.Products:
        """How a search's steps multiply the attention memory: a dot-product score's whole
        step in one compiled kernel where ``native_kernels`` (``fast.attend``; on a CPU, in
        float32, without gradients), else the plain products."""
        return attend.KERNEL_PRODUCTS if self.native_kernels else sinks.PLAIN_PRODUCTS

    def step_linear(self, linear: nn.Linear, training: bool) -> Callable[[Tensor], Tensor]:
        """x -> x W^T for a bias-free layer applied at every step of a teacher-forced
        step-by-step decoder."""
        if self.fused and training:
            return sinks.WeightSink(linear.weight).linear
        return linear  # type: ignore[no-any-return]

    def output_loss(
        self,
        features: Tensor,
        weight: Tensor,
        target: Tensor,
        eps: float,
        training: bool,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Label-smoothed cross-entropy of softmax(features W^T) summed over rows, and the
        plain NLL sum: features (N, O), W (V, O), target (N,); ``rows`` (N,) bool, where
        given: over those rows alone."""
        native = self._cpu(features, training) and self.native_kernels
        return loss.output_layer_loss(features, weight, target, eps, self.fused, native, rows)

    def log_softmax(self, logits: Tensor, allowed: Tensor | None, training: bool) -> Tensor:
        """log softmax(logits) over the last dimension, float32; with ``allowed`` (N, V) bool,
        over each row's allowed columns alone, the others -inf: logits (N, V). The compiled
        kernel works in place on a float32 CPU tensor in evaluation (search and scoring,
        where the logits are the matmul's own output), except under a tracer (export)."""
        logits = logits.float()
        flat = logits.view(-1, logits.size(-1)) if logits.is_contiguous() else logits
        native = self.native_kernels and not training and logits.device.type == "cpu"
        native = native and not torch.jit.is_tracing()  # the ONNX exporter records torch ops
        if native and compiled.log_softmax_(flat, allowed):
            return logits
        if allowed is not None:
            logits = logits.masked_fill(~allowed, -math.inf)
        return F.log_softmax(logits, dim=-1)
