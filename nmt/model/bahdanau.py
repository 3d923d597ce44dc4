"""Bahdanau et al.'s decoder (RNNsearch): attention before the step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from nmt.fast import FastPaths
from nmt.model.attention import Attention, Memory
from nmt.model.decoder import UNPREPARED, Decoder, DecoderState, Prepared, split_rnn_state
from nmt.model.encoder import stacked_rnn

if TYPE_CHECKING:
    from nmt.config import ModelConfig


class BahdanauDecoder(Decoder):
    """Bahdanau et al. (2015), section 3.1 and appendix A.2.2 (pre-step attention):

        c_i = sum_j alpha_ij h_j,  alpha_ij = softmax_j(score(s_{i-1}, h_j))
        s_i = RNN(s_{i-1}, [E y_{i-1}; c_i])
        t_i = maxout(U_o s_i + V_o E y_{i-1} + C_o c_i)   (or tanh without maxout)

    p(y_i) = softmax(W_o t_i) is the model's output layer.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, attention: Attention, fast: FastPaths):
        super().__init__(cfg, vocab_size, attention, fast)
        dec, embedding_size, key_size = cfg.decoder, cfg.embedding_size, attention.key_size
        self.rnn = stacked_rnn(dec, embedding_size + key_size)
        self.output_size = dec.output_size or embedding_size
        self.maxout = dec.maxout
        pieces = 2 if dec.maxout else 1
        self.deep_output = nn.Linear(
            dec.hidden_size + key_size + embedding_size, pieces * self.output_size
        )
        self.dropout = fast.dropout(dec.dropout)

    def _recur(
        self,
        embedded: Tensor | None,
        memory: Memory,
        state: DecoderState,
        gates: Tensor | None = None,
        hidden_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
        input_products: Sequence[Callable[[Tensor], Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, DecoderState]:
        """embedded: (B, 1, E) -> s_i (B, 1, H), c_i (B, 1, Hk), alphas (B, 1, S), state;
        or, with ``gates`` (search: looked up; teacher forcing: ``FastPaths.teacher_steps``),
        embedded unused and the embedding's first-layer gates (B, G*H); then
        ``hidden_products`` and ``input_products``: the RNN's W_hh and W_ih products, if
        given."""
        hidden = state.hidden  # (L, B, H); the top layer's s_{i-1} as (B, 1, H), a view
        query = hidden.transpose(0, 1) if hidden.size(0) == 1 else hidden[-1].unsqueeze(1)
        context, alphas, coverage = self.attention.attend(
            query, memory, state.position(query), state.coverage
        )  # c_i, alpha_i, C_i
        if gates is not None:
            rnn_input = context
        else:
            assert embedded is not None
            rnn_input = torch.cat([embedded, context], dim=-1)
        output, rnn_state = self.step_rnn(
            rnn_input, state, gates, hidden_products, input_products
        )  # (B, 1, H)
        hidden, cell = split_rnn_state(rnn_state)
        return output, context, alphas, DecoderState(hidden, cell, state.step + 1, coverage)

    def _readout(self, states: Tensor, contexts: Tensor, embedded: Tensor) -> Tensor:
        """(B, T, H), (B, T, Hk), (B, T, E) -> t (B, T, O)."""
        pre = self.deep_output(torch.cat([states, contexts, embedded], dim=-1))
        if self.maxout:
            out = pre.view(*pre.shape[:-1], self.output_size, 2).amax(dim=-1)
        else:
            out = torch.tanh(pre)
        return self.dropout(out) if self.training else out

    def forward(self, trg_in: Tensor, memory: Memory, state: DecoderState) -> tuple[Tensor, Tensor]:
        """trg_in: (B, T) -> features (B, T, O), alphas (B, T, S)."""
        embedded = self.embedding_dropout(self.embed(trg_in))  # (B, T, E)
        memory = memory.for_steps(self.fast.step_products(self.training))
        steps = self.fast.teacher_steps(self.rnn, embedded, self.training)
        outputs, contexts, alphas = [], [], []
        for t in range(trg_in.size(1)):
            if steps is None:
                output, context, alpha, state = self._recur(embedded[:, t : t + 1], memory, state)
            else:
                output, context, alpha, state = self._recur(
                    None, memory, state, steps.gates[t], steps.hidden, steps.inputs
                )
            outputs.append(output)
            contexts.append(context)
            alphas.append(alpha)
        features = self._readout(
            torch.cat(outputs, dim=1), torch.cat(contexts, dim=1), embedded
        )  # (B, T, O)
        return features, torch.cat(alphas, dim=1)

    def step(
        self, prev: Tensor, memory: Memory, state: DecoderState, prepared: Prepared = UNPREPARED
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """prev: (B,) -> features (B, O), alphas (B, S), state; ``prepared``: prev's
        first-layer gates and the RNN's W_hh products, where search made them (``Prepared``)."""
        embedded = self.embed(prev.unsqueeze(1))  # (B, 1, E)
        if self.training:
            embedded = self.embedding_dropout(embedded)
        products = prepared.products
        hidden = products.hidden if products is not None else None
        output, context, alphas, state = self._recur(
            embedded, memory, state, prepared.gates, hidden
        )
        features = self._readout(output, context, embedded)  # (B, 1, O)
        return features.squeeze(1), alphas.squeeze(1), state
