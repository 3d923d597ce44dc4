"""Luong et al.'s decoder: attention after the step, with or without input feeding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from nmt.fast import FastPaths
from nmt.fast.packed import StepProducts
from nmt.model.attention import Attention, Memory
from nmt.model.decoder import UNPREPARED, Decoder, DecoderState, Prepared, split_rnn_state
from nmt.model.encoder import stacked_rnn

if TYPE_CHECKING:
    from nmt.config import ModelConfig


@dataclass
class LuongState(DecoderState):
    """DecoderState with feed: (B, H), the previous attentional state h~_{t-1} (input
    feeding), or None."""

    feed: Tensor | None = None

    def index_select(self, index: Tensor) -> LuongState:
        base = super().index_select(index)
        feed = self.feed[index] if self.feed is not None else None
        return LuongState(base.hidden, base.cell, base.step, base.coverage, feed=feed)


class LuongDecoder(Decoder):
    """Luong et al. (2015), section 3 (post-step attention):

        h_t = RNN(h_{t-1}, [E y_{t-1}; h~_{t-1}])   (input feeding, section 3.3; or E y_{t-1})
        c_t = sum_s a_t(s) h_s,  a_t(s) = softmax_s(score(h_t, h_s))
        h~_t = tanh(W_c [c_t; h_t])                  (eq. 5)

    p(y_t) = softmax(W_s h~_t) (eq. 6) is the model's output layer. Without input feeding the
    RNN does not depend on attention, so teacher forcing runs it over the whole target in one
    call and attends for all steps in one batched matmul.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, attention: Attention, fast: FastPaths):
        super().__init__(cfg, vocab_size, attention, fast)
        dec = cfg.decoder
        self.input_feeding = dec.input_feeding
        self.stepwise = dec.input_feeding
        self.hidden_size = dec.hidden_size
        feed_size = dec.hidden_size if dec.input_feeding else 0
        self.rnn = stacked_rnn(dec, cfg.embedding_size + feed_size)
        key_size = attention.key_size
        self.combine = nn.Linear(key_size + dec.hidden_size, dec.hidden_size, bias=False)  # W_c
        self.dropout = fast.dropout(dec.dropout)
        self.output_size = dec.hidden_size

    def initial_state(self, hidden: Tensor, cell: Tensor | None) -> LuongState:
        """h~_0 = 0 with input feeding."""
        feed = hidden.new_zeros(hidden.size(1), self.hidden_size) if self.input_feeding else None
        return LuongState(hidden, cell, 0, feed=feed)

    def for_search(self, memory: Memory, greedy: bool = False) -> Memory:
        """With W_c = [W_cc W_ch] split at the context's width, W_c [c_t; h_t] = sum_s a_t(s)
        (W_cc h_s) + W_ch h_t, so W_cc multiplies each sentence's values once here
        (``Memory.folded``), not each row's context at every step
        (``FastPaths.search_tables``): over a memory a beam search's beams share, and for a
        greedy search (``greedy``) on a CPU (one row per sentence: the fold costs about what
        the steps save in FLOPs, and the steps read a memory a third smaller). Not over a
        memory copied per beam.

        Past the fold a search reads no other values, so the folded ones stand in for them
        (``values`` is ``folded``): dropping finished sentences then copies a memory half
        as wide (``Memory.index_select``)."""
        memory = super().for_search(memory, greedy)
        if not self.fast.search_tables or memory.projected_values is not None:
            return memory
        if memory.beams == 1 and not (greedy and memory.values.device.type == "cpu"):
            return memory
        width = memory.values.size(-1)
        w_cc = self.combine.weight[:, :width]  # (H, Hk)
        folded = memory.values @ w_cc.t()  # (B, S, H)
        return replace(memory, values=folded, folded=folded)

    def _attend(
        self,
        outputs: Tensor,
        memory: Memory,
        positions: Tensor,
        combine: Callable[[Tensor], Tensor],
        coverage: Tensor | None,
        combine_hidden: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """h_t: (B, T, H), positions t: (T,), coverage -> h~_t (B, T, H), alphas (B, T, S),
        coverage. Over a folded memory (``for_search``) the context is W_cc c_t already, and
        ``combine_hidden`` multiplies h_t by W_ch where given."""
        context, alphas, coverage = self.attention.attend(outputs, memory, positions, coverage)
        if memory.folded is None:
            attentional = torch.tanh(combine(torch.cat([context, outputs], dim=-1)))  # (B, T, H)
        else:  # whose values are the folded ones (``for_search``): context is W_cc c_t
            if combine_hidden is not None:
                hidden = combine_hidden(outputs)
            else:
                hidden = outputs @ self.combine.weight[:, -self.hidden_size :].t()  # W_ch h_t
            attentional = torch.tanh_(hidden.add_(context))  # (B, T, H)
        return self.dropout(attentional) if self.training else attentional, alphas, coverage

    def _recur(
        self,
        embedded: Tensor | None,
        memory: Memory,
        state: LuongState,
        combine: Callable[[Tensor], Tensor],
        gates: Tensor | None = None,
        hidden_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
        combine_hidden: Callable[[Tensor], Tensor] | None = None,
        input_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, LuongState]:
        """embedded: (B, 1, E) -> h~_t (B, 1, H), alphas (B, 1, S), state; or, with
        ``gates`` (search: looked up; teacher forcing: ``FastPaths.teacher_steps``), embedded
        None and the embedding's first-layer gates (B, G*H); ``hidden_products`` and
        ``combine_hidden``: search's products (``search_products``); ``hidden_products``
        and ``input_products``: teacher forcing's (``TeacherSteps``)."""
        rnn_input = embedded
        if self.input_feeding:
            assert state.feed is not None
            feed = state.feed.unsqueeze(1)  # (B, 1, H)
            if input_products is None:  # else its product casts it to the compute dtype
                feed = feed.to(self.embed.weight.dtype)
            rnn_input = feed if embedded is None else torch.cat([embedded, feed], dim=-1)
        output, rnn_state = self.step_rnn(
            rnn_input, state, gates, hidden_products, input_products
        )  # (B, 1, H)
        attentional, alphas, coverage = self._attend(
            output, memory, state.position(output), combine, state.coverage, combine_hidden
        )
        hidden, cell = split_rnn_state(rnn_state)
        next_feed = attentional.squeeze(1) if self.input_feeding else None
        return attentional, alphas, LuongState(hidden, cell, state.step + 1, coverage, next_feed)

    def forward(self, trg_in: Tensor, memory: Memory, state: DecoderState) -> tuple[Tensor, Tensor]:
        """trg_in: (B, T) -> features (B, T, H), alphas (B, T, S)."""
        assert isinstance(state, LuongState)
        embedded = self.embedding_dropout(self.embed(trg_in))  # (B, T, E)
        if not self.input_feeding:  # h_t for every t in one call
            outputs, _ = self.fast.recurrence(
                self.rnn, embedded, None, state.rnn_state(), self.training
            )  # (B, T, H)
            positions = torch.arange(trg_in.size(1), device=outputs.device) + state.step  # (T,)
            attentional, alphas, _ = self._attend(
                outputs, memory, positions, self.combine, state.coverage
            )
            return attentional, alphas
        memory = memory.for_steps(self.fast.step_products(self.training))
        combine = self.fast.step_linear(self.combine, self.training)
        steps = self.fast.teacher_steps(self.rnn, embedded, self.training)
        features: list[Tensor] = []
        weights: list[Tensor] = []
        for t in range(trg_in.size(1)):
            if steps is None:
                attentional, alpha, state = self._recur(
                    embedded[:, t : t + 1], memory, state, combine
                )
            else:
                attentional, alpha, state = self._recur(
                    None,
                    memory,
                    state,
                    combine,
                    steps.gates[t],
                    steps.hidden,
                    input_products=steps.inputs,
                )
            features.append(attentional)
            weights.append(alpha)
        return torch.cat(features, dim=1), torch.cat(weights, dim=1)

    def step(
        self, prev: Tensor, memory: Memory, state: DecoderState, prepared: Prepared = UNPREPARED
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """prev: (B,) -> features (B, H), alphas (B, S), state; ``prepared``: prev's
        first-layer gates and the step's products (``search_products``), where search made
        them (``Prepared``), else the modules' own."""
        assert isinstance(state, LuongState)
        gates, products = prepared.gates, prepared.products
        embedded = None
        if gates is None:
            embedded = self.embedding_dropout(self.embed(prev.unsqueeze(1)))  # (B, 1, E)
        if products is None:
            attentional, alphas, state = self._recur(embedded, memory, state, self.combine, gates)
        else:
            assert products.combine is not None and products.combine_hidden is not None
            attentional, alphas, state = self._recur(
                embedded,
                memory,
                state,
                products.combine,
                gates,
                products.hidden,
                products.combine_hidden,
            )
        return attentional.squeeze(1), alphas.squeeze(1), state

    def search_products(self) -> StepProducts | None:
        """The RNN's W_hh products (``Decoder.search_products``), W_c's, and W_ch's alone
        (the hidden half, for a folded memory)."""
        products = super().search_products()
        if products is None:
            return None
        weight = self.combine.weight  # (H, Hk + H)
        products.combine = self.fast.product(weight)
        products.combine_hidden = self.fast.product(weight[:, weight.size(1) - self.hidden_size :])
        return products
