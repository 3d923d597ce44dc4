"""Attention decoders: Bahdanau (pre-step) and Luong (post-step, optional input feeding).

Both share one interface:
    forward(trg_in, memory, state) -> features (B, T, O), alphas (B, T, S)   teacher forcing
    step(prev, memory, state)      -> features (B, O), alphas (B, S), state   one search step
The generator (output projection to the vocabulary) lives in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nmt.attention import Attention, Memory
from nmt.config import DecoderConfig
from nmt.dropout import Dropout
from nmt.encoder import RNNS
from nmt.rnn import run_rnn
from nmt.runtime import fast_kernels
from nmt.sinks import WeightSink
from nmt.tokenizer import PAD_ID


@dataclass
class DecoderState:
    """hidden/cell: (L, B, H); feed: (B, H) Luong's previous attentional state or None;
    step: the 0-based index of the next target position (attention's ``positions``)."""

    hidden: Tensor
    cell: Tensor | None = None
    feed: Tensor | None = None
    step: int = 0

    def rnn_state(self) -> Tensor | tuple[Tensor, Tensor]:
        return (self.hidden, self.cell) if self.cell is not None else self.hidden

    def index_select(self, index: Tensor) -> DecoderState:
        return DecoderState(
            self.hidden[:, index],
            self.cell[:, index] if self.cell is not None else None,
            self.feed[index] if self.feed is not None else None,
            self.step,
        )


def _state_from_rnn(
    rnn_state: Tensor | tuple[Tensor, Tensor], feed: Tensor | None = None, step: int = 0
) -> DecoderState:
    if isinstance(rnn_state, tuple):
        return DecoderState(rnn_state[0], rnn_state[1], feed, step)
    return DecoderState(rnn_state, None, feed, step)


def _position(state: DecoderState, like: Tensor) -> Tensor:
    """(1,) the target position this step produces, on ``like``'s device."""
    return torch.arange(state.step, state.step + 1, device=like.device)


def _decoder_rnn(cfg: DecoderConfig, input_size: int) -> nn.RNNBase:
    """The decoder's stacked GRU/LSTM, batch first, dropout between layers."""
    return RNNS[cfg.rnn](
        input_size,
        cfg.hidden_size,
        num_layers=cfg.layers,
        batch_first=True,
        dropout=cfg.dropout if cfg.layers > 1 else 0.0,
    )


class BahdanauDecoder(nn.Module):
    """Bahdanau et al. (2015), section 3.1 and appendix A.2.2 (pre-step attention):

        c_i = sum_j alpha_ij h_j,  alpha_ij = softmax_j(score(s_{i-1}, h_j))
        s_i = RNN(s_{i-1}, [E y_{i-1}; c_i])
        t_i = maxout(U_o s_i + V_o E y_{i-1} + C_o c_i)   (or tanh without maxout)

    p(y_i) = softmax(W_o t_i) is the model's generator.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        embedding_dropout: float,
        key_size: int,
        attention: Attention,
        cfg: DecoderConfig,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_size, padding_idx=PAD_ID)
        self.embedding_dropout = Dropout(embedding_dropout)
        self.attention = attention
        self.rnn = _decoder_rnn(cfg, embedding_size + key_size)
        self.output_size = cfg.output_size or embedding_size
        self.maxout = cfg.maxout
        pieces = 2 if cfg.maxout else 1
        self.deep_output = nn.Linear(
            cfg.hidden_size + key_size + embedding_size, pieces * self.output_size
        )
        self.dropout = Dropout(cfg.dropout)

    def _recur(
        self, embedded: Tensor, memory: Memory, state: DecoderState
    ) -> tuple[Tensor, Tensor, Tensor, DecoderState]:
        """embedded: (B, 1, E) -> s_i (B, 1, H), c_i (B, 1, Hk), alphas (B, 1, S), state."""
        query = state.hidden[-1].unsqueeze(1)  # (B, 1, H): s_{i-1}, top layer
        positions = _position(state, query)  # (1,): i, the output being produced
        context, alphas = self.attention(query, memory, positions)  # (B, 1, Hk), (B, 1, S)
        rnn_input = torch.cat([embedded, context], dim=-1)  # (B, 1, E+Hk)
        output, rnn_state = self.rnn(rnn_input, state.rnn_state())  # (B, 1, H)
        return output, context, alphas, _state_from_rnn(rnn_state, step=state.step + 1)

    def _readout(self, states: Tensor, contexts: Tensor, embedded: Tensor) -> Tensor:
        """(B, T, H), (B, T, Hk), (B, T, E) -> t (B, T, O)."""
        pre = self.deep_output(torch.cat([states, contexts, embedded], dim=-1))
        if self.maxout:
            out = pre.view(*pre.shape[:-1], self.output_size, 2).amax(dim=-1)
        else:
            out = torch.tanh(pre)
        return self.dropout(out)

    def forward(self, trg_in: Tensor, memory: Memory, state: DecoderState) -> tuple[Tensor, Tensor]:
        """trg_in: (B, T) -> features (B, T, O), alphas (B, T, S)."""
        embedded = self.embedding_dropout(self.embed(trg_in))  # (B, T, E)
        memory = self.attention.for_steps(memory)
        outputs, contexts, alphas = [], [], []
        for t in range(trg_in.size(1)):
            output, context, alpha, state = self._recur(embedded[:, t : t + 1], memory, state)
            outputs.append(output)
            contexts.append(context)
            alphas.append(alpha)
        features = self._readout(
            torch.cat(outputs, dim=1), torch.cat(contexts, dim=1), embedded
        )  # (B, T, O)
        return features, torch.cat(alphas, dim=1)

    def step(
        self, prev: Tensor, memory: Memory, state: DecoderState
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """prev: (B,) -> features (B, O), alphas (B, S), state."""
        embedded = self.embedding_dropout(self.embed(prev.unsqueeze(1)))  # (B, 1, E)
        output, context, alphas, state = self._recur(embedded, memory, state)
        features = self._readout(output, context, embedded)  # (B, 1, O)
        return features.squeeze(1), alphas.squeeze(1), state


class LuongDecoder(nn.Module):
    """Luong et al. (2015), section 3 (post-step attention):

        h_t = RNN(h_{t-1}, [E y_{t-1}; h~_{t-1}])   (input feeding, section 3.3; or E y_{t-1})
        c_t = sum_s a_t(s) h_s,  a_t(s) = softmax_s(score(h_t, h_s))
        h~_t = tanh(W_c [c_t; h_t])                  (eq. 5)

    p(y_t) = softmax(W_s h~_t) (eq. 6) is the model's generator. Without input feeding the RNN
    does not depend on attention, so teacher forcing runs it over the whole target in one call
    and attends for all steps in one batched matmul.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        embedding_dropout: float,
        key_size: int,
        attention: Attention,
        cfg: DecoderConfig,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_size, padding_idx=PAD_ID)
        self.embedding_dropout = Dropout(embedding_dropout)
        self.attention = attention
        self.input_feeding = cfg.input_feeding
        self.hidden_size = cfg.hidden_size
        feed_size = cfg.hidden_size if cfg.input_feeding else 0
        self.rnn = _decoder_rnn(cfg, embedding_size + feed_size)
        self.combine = nn.Linear(key_size + cfg.hidden_size, cfg.hidden_size, bias=False)
        self.dropout = Dropout(cfg.dropout)
        self.output_size = cfg.hidden_size

    def _attend(
        self, outputs: Tensor, memory: Memory, positions: Tensor, combine: WeightSink | None = None
    ) -> tuple[Tensor, Tensor]:
        """h_t: (B, T, H), positions t: (T,) -> h~_t (B, T, H), alphas (B, T, S); W_c through
        ``combine`` where given (the training loop over steps)."""
        context, alphas = self.attention(outputs, memory, positions)  # (B, T, Hk), (B, T, S)
        joined = torch.cat([context, outputs], dim=-1)  # (B, T, Hk+H)
        attentional = torch.tanh(combine.linear(joined) if combine else self.combine(joined))
        return self.dropout(attentional), alphas

    def _with_feed(self, state: DecoderState, batch: int, like: Tensor) -> DecoderState:
        if self.input_feeding and state.feed is None:
            state = DecoderState(
                state.hidden, state.cell, like.new_zeros(batch, self.hidden_size), state.step
            )
        return state

    def _recur(
        self,
        embedded: Tensor,
        memory: Memory,
        state: DecoderState,
        combine: WeightSink | None = None,
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """embedded: (B, 1, E) -> h~_t (B, 1, H), alphas (B, 1, S), state."""
        rnn_input = embedded
        if self.input_feeding:
            assert state.feed is not None
            feed = state.feed.to(embedded.dtype).unsqueeze(1)  # (B, 1, H)
            rnn_input = torch.cat([embedded, feed], dim=-1)
        output, rnn_state = self.rnn(rnn_input, state.rnn_state())  # (B, 1, H)
        attentional, alphas = self._attend(output, memory, _position(state, output), combine)
        next_feed = attentional.squeeze(1) if self.input_feeding else None
        return attentional, alphas, _state_from_rnn(rnn_state, next_feed, state.step + 1)

    def forward(self, trg_in: Tensor, memory: Memory, state: DecoderState) -> tuple[Tensor, Tensor]:
        """trg_in: (B, T) -> features (B, T, H), alphas (B, T, S)."""
        embedded = self.embedding_dropout(self.embed(trg_in))  # (B, T, E)
        if not self.input_feeding:
            if fast_kernels(embedded.device):
                outputs, _ = run_rnn(self.rnn, embedded, None, state.rnn_state())  # (B, T, H)
            else:
                outputs, _ = self.rnn(embedded, state.rnn_state())  # (B, T, H), one call
            steps = range(state.step, state.step + trg_in.size(1))
            positions = torch.arange(steps.start, steps.stop, device=outputs.device)  # (T,)
            return self._attend(outputs, memory, positions)
        state = self._with_feed(state, trg_in.size(0), embedded)
        memory = self.attention.for_steps(memory)
        combine = WeightSink(self.combine.weight) if torch.is_grad_enabled() else None
        features, alphas = [], []
        for t in range(trg_in.size(1)):
            attentional, alpha, state = self._recur(embedded[:, t : t + 1], memory, state, combine)
            features.append(attentional)
            alphas.append(alpha)
        return torch.cat(features, dim=1), torch.cat(alphas, dim=1)

    def step(
        self, prev: Tensor, memory: Memory, state: DecoderState
    ) -> tuple[Tensor, Tensor, DecoderState]:
        """prev: (B,) -> features (B, H), alphas (B, S), state."""
        embedded = self.embedding_dropout(self.embed(prev.unsqueeze(1)))  # (B, 1, E)
        state = self._with_feed(state, prev.size(0), embedded)
        attentional, alphas, state = self._recur(embedded, memory, state)
        return attentional.squeeze(1), alphas.squeeze(1), state
