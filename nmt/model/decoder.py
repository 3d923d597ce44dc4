"""The decoder contract: what the model and search may call on any decoder, and its state.

A decoder reads the target one token after another while attending to the encoder states.
Both nmt decoders (``bahdanau``, ``luong``) implement ``Decoder``; search calls nothing else,
so a new decoder is one module implementing it plus one line in ``registry``.
The output layer (projection to the vocabulary) lives in the model, not here.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from nmt.fast.packed import StepProducts
from nmt.model.attention import Attention, Memory
from nmt.model.encoder import embedding

if TYPE_CHECKING:
    from nmt.config import ModelConfig
    from nmt.fast import FastPaths


@dataclass
class DecoderState:
    """hidden/cell: (L, B, H) the RNN's state (cell only for an LSTM); step: the 0-based index
    of the next target position (attention's ``positions``; a 0-d tensor, the graph's input,
    in an exported decoder step, nmt.decoding.onnx); coverage: (B, S, d_c) the
    attention's coverage vector (``nmt.model.coverage``), None before the first step or
    without coverage. A decoder may extend it."""

    hidden: Tensor
    cell: Tensor | None = None
    step: int | Tensor = 0
    coverage: Tensor | None = None

    def rnn_state(self) -> Tensor | tuple[Tensor, Tensor]:
        return (self.hidden, self.cell) if self.cell is not None else self.hidden

    def index_select(self, index: Tensor) -> DecoderState:
        """The state of the sentences (or beams) ``index`` (B',)."""
        return DecoderState(
            self.hidden[:, index],
            self.cell[:, index] if self.cell is not None else None,
            self.step,
            self.coverage[index] if self.coverage is not None else None,
        )

    def position(self, like: Tensor) -> Tensor:
        """(1,) the target position this step produces, on ``like``'s device."""
        if isinstance(self.step, Tensor):  # an exported step's input
            return self.step.view(1)
        return _position(self.step, like.device)


@functools.lru_cache(maxsize=4096)
def _position(step: int, device: torch.device) -> Tensor:
    """(1,) ``step`` on ``device``: made once, read at every search step that reaches it
    (no score writes its positions)."""
    return torch.arange(step, step + 1, device=device)


@dataclass(frozen=True)
class Prepared:
    """What search prepared for a decoder step while the weights stay fixed: ``gates``,
    prev's rows of ``Decoder.gate_table()`` (B, G*H), looked up by the caller, or None to
    multiply the embedding; ``products``, ``Decoder.search_products()``, or None to multiply
    by the modules' weights."""

    gates: Tensor | None = None
    products: StepProducts | None = None


UNPREPARED = Prepared()  # a step that multiplies everything itself


def split_rnn_state(rnn_state: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """An RNN module's state -> (hidden, cell or None)."""
    if isinstance(rnn_state, tuple):
        return rnn_state[0], rnn_state[1]
    return rnn_state, None


class Decoder(nn.Module, ABC):
    """What every decoder provides.

    Attributes: ``embed`` (the target embedding, which the output layer may share),
    ``rnn`` (its recurrent network, stepped through ``step_rnn``), ``attention`` (its score
    function, which prepares the memory), ``output_size`` (the width
    of the features the output layer reads), ``stepwise`` (whether teacher forcing runs one
    target position after another: what a CUDA graph of the unroll speeds up).
    """

    embed: nn.Embedding
    rnn: nn.RNNBase
    attention: Attention
    output_size: int
    stepwise: bool = True

    def __init__(self, cfg: ModelConfig, vocab_size: int, attention: Attention, fast: FastPaths):
        """The target embedding and ``attention``; a decoder adds its RNN and output layers."""
        super().__init__()
        self.embed, self.embedding_dropout = embedding(vocab_size, cfg, fast)
        self.attention = attention
        self.fast = fast

    def initial_state(self, hidden: Tensor, cell: Tensor | None) -> DecoderState:
        """The state before the first target token from the bridge's hidden (and cell)
        states (L, B, H)."""
        return DecoderState(hidden, cell)

    @abstractmethod
    def forward(self, trg_in: Tensor, memory: Memory, state: DecoderState) -> tuple[Tensor, Tensor]:
        """Teacher forcing: trg_in (B, T) -> features (B, T, O), alphas (B, T, S)."""

    @abstractmethod
    def step(
        self, prev: Tensor, memory: Memory, state: DecoderState, prepared: Prepared = UNPREPARED
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """One search step: prev (B,) -> features (B, O), alphas (B, S), the next state;
        ``prepared``: what search made for it (``Prepared``), by default nothing."""

    def step_rnn(
        self,
        rnn_input: Tensor | None,
        state: DecoderState,
        gates: Tensor | None = None,
        hidden_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
        input_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        """One step of the decoder's RNN (``self.rnn``) from ``state`` through
        ``FastPaths.step_rnn``: output (B, 1, H) and the RNN's next state."""
        return self.fast.step_rnn(
            self.rnn,
            rnn_input,
            state.rnn_state(),
            self.training,
            gates,
            hidden_products,
            input_products,
        )

    def search_products(self) -> StepProducts | None:
        """The step's products by its fixed weights, each made once for search
        (``FastPaths.product``: prepared for oneDNN on a CPU), valid until the weights
        change: each RNN layer's W_hh with b_hh (a decoder's ``rnn``), and a subclass's own
        (``LuongDecoder``); None without an RNN module."""
        rnn = getattr(self, "rnn", None)
        if not isinstance(rnn, nn.RNNBase):
            return None
        hidden = [
            self.fast.product(
                getattr(rnn, f"weight_hh_l{layer}"), getattr(rnn, f"bias_hh_l{layer}", None)
            )
            for layer in range(rnn.num_layers)
        ]
        return StepProducts(hidden)

    def gate_table(self) -> Tensor | None:
        """The first RNN layer's input gates of every target piece's embedding (V, G*H)
        (``FastPaths.input_gate_table``) for search to look up, or None: what ``step`` takes
        as ``gates``, valid until the weights change."""
        rnn = getattr(self, "rnn", None)
        if not isinstance(rnn, nn.RNNBase):
            return None
        return self.fast.input_gate_table(self.embed, rnn)

    def for_search(self, memory: Memory, greedy: bool = False) -> Memory:
        """The memory a search steps over, once per batch (``greedy``: a greedy search's,
        one row per sentence), multiplied through ``FastPaths.search_products``; a decoder
        may prepare more of it (``LuongDecoder.for_search``)."""
        return memory.for_steps(self.fast.search_products())

    def reorder(self, state: DecoderState, index: Tensor) -> DecoderState:
        """The state of the hypotheses ``index`` (B',): beams kept and repeated in search."""
        return state.index_select(index)
