"""Several models decoding as one: what search and forced scoring call instead of a model.

At each target position the members' next-token distributions are averaged:

    linear (default):  p(y_t | y_<t, x) = 1/M sum_m p_m(y_t | y_<t, x)
    log_linear:        p(y_t | y_<t, x) = softmax(1/M sum_m log p_m(y_t | y_<t, x))

``linear`` is the default, as in fairseq and Sockeye: the mixture is a proper distribution
without renormalising, a token that one member rules out keeps the others' mass, and the
sentence scores stay log-probabilities of one model (the mixture), comparable with a single
model's. ``log_linear`` (a product of experts, OpenNMT-py's and Marian's average) is sharper.
The attention an ensemble returns is the mean of the members' weights, itself a distribution
over the source. One member is the member itself: no averaging, bit for bit the model's
outputs.

The members may have different architectures (a Bahdanau and a Luong model); they must
share the tokenizer, which the Translator checks.

Search steps anything that keeps the step contract ``Stepper`` (encode, step, reorder,
select) with a state of its own: an Ensemble, or the exported graphs under onnxruntime
(``nmt.decoding.exported``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from nmt.fast.packed import Product, StepProducts
from nmt.model import Seq2Seq
from nmt.model.attention import Memory
from nmt.model.decoder import DecoderState, Prepared

AVERAGES = ("linear", "log_linear")

State = TypeVar("State")


class Stepper(Protocol[State]):
    """What search calls: the source encoded once (each sentence ``repeat`` times in a row:
    beams), one step of every row, and the rows kept. The state is the stepper's own."""

    def encode(self, src: Tensor, src_lengths: Tensor, repeat: int = 1) -> State:
        """src (B, S), src_lengths (B,) -> the state of B * repeat rows."""
        ...

    def step(self, prev: Tensor, state: State) -> tuple[Tensor, Tensor, State]:
        """prev (N,) -> log-probabilities (N, V) float32, attention (N, S), the next state."""
        ...

    def reorder(self, state: State, index: Tensor) -> State:
        """The state of the rows ``index`` (N',)."""
        ...

    def select(self, state: State, index: Tensor) -> State:
        """The rows ``index`` (N',), their source memory included: what search keeps of
        a batch once some of its sentences are done (their rows are dropped for good)."""
        ...

    @property
    def native_kernels(self) -> bool:
        """Whether search takes its top-k through nmt's compiled kernels
        (``FastPaths.native_kernels``; ``nmt.fast.topk``)."""
        ...


def stepper(model: Seq2Seq | Stepper[Any]) -> Stepper[Any]:
    """What search steps: one model as an ensemble of one, any other stepper as it is."""
    return Ensemble([model]) if isinstance(model, Seq2Seq) else model


@dataclass
class StepTables:
    """What a Translator makes once for a member's search steps, its weights being fixed:
    ``gates``, its decoder's first-layer input gates of every target piece (V, G*H)
    (``Decoder.gate_table``), ``output``, the product by W_o on a CPU (``FastPaths.product``:
    from oneDNN's prepared layout, else by W_o transposed and contiguous), and ``products``,
    the decoder step's own products on a CPU (``Decoder.search_products``), and ``source``,
    the encoder's first-layer input gates of every source piece on a CPU
    (``Encoder.gate_table``); each None where the member multiplies as it is."""

    gates: Tensor | None = None
    output: Product | None = None
    products: StepProducts | None = None
    source: Tensor | None = None

    def weights(self) -> list[Tensor]:
        """Every tensor the tables hold (what a kept captured step reads besides the
        model's parameters: ``decoding.captured.kept_key``)."""
        held = [table for table in (self.gates, self.source) if table is not None]
        products = [self.output] if self.output is not None else []
        if self.products is not None:
            products += self.products.all()
        return held + [product.weight for product in products]


@dataclass
class EnsembleState:
    """Each member's attention memory and decoder state, in member order; restricted to a
    shortlist's columns, which columns each row may take (N, V') bool: its own sentence's."""

    memories: list[Memory]
    states: list[DecoderState]
    allowed: Tensor | None = None


class Ensemble:
    """Models decoding in step, combined per token (see the module docstring)."""

    def __init__(
        self,
        models: Sequence[Seq2Seq],
        average: str = "linear",
        tables: Sequence[StepTables] | None = None,
    ):
        if not models:
            raise ValueError("an ensemble needs at least one model")
        if average not in AVERAGES:
            raise ValueError(f"average {average!r}: expected one of {', '.join(AVERAGES)}")
        self.models = list(models)
        self.average = average
        # what each member's steps look up instead of multiplying (StepTables): made for
        # fixed weights (Translator)
        self.tables = list(tables) if tables else [StepTables() for _ in self.models]
        self.columns: Tensor | None = None  # (V',) target ids: see ``restricted``
        self.rows: list[Product] | None = None  # each member's product by its W_o rows
        self.allowed: Tensor | None = None  # (B, V') each sentence's own columns

    @property
    def native_kernels(self) -> bool:
        return all(model.fast.native_kernels for model in self.models)

    def restricted(self, columns: Tensor, allowed: Tensor) -> Ensemble:
        """The ensemble stepped over the target ids ``columns`` (V',) alone (a shortlist,
        ``nmt.decoding.shortlist``): ``step`` takes and gives column indices, and the
        log-probabilities (N, V') of a row of sentence b are normalised over the columns
        ``allowed`` (B, V') gives b, the others -inf."""
        ensemble = Ensemble(self.models, self.average, self.tables)
        ensemble.columns = columns
        ensemble.rows = [
            table.output.columns(columns)
            if table.output is not None
            else Product(model.generator.weight[columns], prepared=False)
            for model, table in zip(self.models, self.tables, strict=True)
        ]
        ensemble.allowed = allowed
        return ensemble

    def encode(self, src: Tensor, src_lengths: Tensor, repeat: int = 1) -> EnsembleState:
        """src (B, S) -> every member's memory and first state, each sentence ``repeat``
        times in a row (beams: B*K rows)."""
        memories, states = [], []
        index = None
        if repeat > 1:
            index = torch.arange(src.size(0), device=src.device).repeat_interleave(repeat)
        for model, tables in zip(self.models, self.tables, strict=True):
            memory, state = model.encode(src, src_lengths, tables.source)
            if index is not None:  # the beams' states; their memory once per sentence where
                # the score allows (Memory.shared), else a copy per beam
                state = model.decoder.reorder(state, index)
                shared = model.decoder.attention.shares_beams
                memory = memory.shared(repeat) if shared else memory.index_select(index)
                memory = model.decoder.for_search(memory)  # e.g. Luong's folded W_c
            else:
                memory = model.decoder.for_search(memory, greedy=True)
            memories.append(memory)
            states.append(state)
        allowed = None
        if self.allowed is not None:  # (B*repeat, V')
            allowed = self.allowed.to(src.device).repeat_interleave(repeat, dim=0)
        return EnsembleState(memories, states, allowed)

    def step(self, prev: Tensor, state: EnsembleState) -> tuple[Tensor, Tensor, EnsembleState]:
        """prev (N,) -> log-probabilities (N, V) float32, attention (N, S), the next state
        (restricted: prev and the log-probabilities over the columns, (N, V'))."""
        log_probs, alphas, states = [], [], []
        if self.columns is not None:
            prev = self.columns.index_select(0, prev)  # (N,) the pieces of the columns chosen
        rows: list[Product | None] = [*self.rows] if self.rows else [None] * len(self.models)
        members = zip(self.models, state.memories, state.states, rows, self.tables, strict=True)
        for model, memory, member, product, tables in members:
            gates = tables.gates.index_select(0, prev) if tables.gates is not None else None
            features, alphas_t, next_state = model.decoder.step(
                prev, memory, member, Prepared(gates, tables.products)
            )
            product = product if product is not None else tables.output
            log_probs.append(model.log_probs(features, product, state.allowed))
            alphas.append(alphas_t)
            states.append(next_state)
        return (
            self.combine(log_probs),
            self.mean_attention(alphas),
            EnsembleState(state.memories, states, state.allowed),
        )

    def reorder(self, state: EnsembleState, index: Tensor) -> EnsembleState:
        """The state of the hypotheses ``index`` (N',); the memories are fixed per sentence
        row and stay as they are (search keeps K rows per sentence throughout)."""
        states = [
            model.decoder.reorder(member, index)
            for model, member in zip(self.models, state.states, strict=True)
        ]  # the allowed columns too stay: a row's sentence is the same
        return EnsembleState(state.memories, states, state.allowed)

    def select(self, state: EnsembleState, index: Tensor) -> EnsembleState:
        """The rows ``index`` (N',), memories included (finished sentences dropped)."""
        memories = [memory.index_select(index) for memory in state.memories]
        allowed = state.allowed[index] if state.allowed is not None else None
        return EnsembleState(memories, self.reorder(state, index).states, allowed)

    def teacher_forced(
        self, src: Tensor, src_lengths: Tensor, trg_in: Tensor, trg_out: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Forced decoding of trg_in (B, T) = BOS y: log-probabilities (B, T, V) float32 of
        each next token, the attention (B, T, S) and, given trg_out = y EOS and when every
        member has an alignment head, the mean of the heads' weights (B, T, S), else None."""
        log_probs, alphas, heads = [], [], []  # heads: list[Tensor]
        for model in self.models:
            if trg_out is not None and model.aligner is not None:
                features, alphas_m, head = model.read(src, src_lengths, trg_in, trg_out)
                assert head is not None  # the model has an aligner
                heads.append(head)
            else:
                features, alphas_m = model(src, src_lengths, trg_in)
            log_probs.append(model.log_probs(features))
            alphas.append(alphas_m)
        aligned = self.mean_attention(heads) if len(heads) == len(self.models) else None
        return self.combine(log_probs), self.mean_attention(alphas), aligned

    def combine(self, log_probs: list[Tensor]) -> Tensor:
        """The members' log-probabilities (each (..., V)) -> the ensemble's (..., V)."""
        if len(log_probs) == 1:
            return log_probs[0]
        stacked = torch.stack(log_probs)  # (M, ..., V)
        if self.average == "linear":
            return torch.logsumexp(stacked, dim=0) - math.log(len(log_probs))
        return torch.log_softmax(stacked.mean(dim=0), dim=-1)

    @staticmethod
    def mean_attention(alphas: list[Tensor]) -> Tensor:
        if len(alphas) == 1:
            return alphas[0]
        return torch.stack([a.float() for a in alphas]).mean(dim=0)

    def eval(self) -> Ensemble:
        for model in self.models:
            model.eval()
        return self
