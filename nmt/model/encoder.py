"""The RNN encoder (GRU/LSTM, uni- or bidirectional, stacked, packed) and the bridge that
initialises the decoder from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from nmt.fast import FastPaths
from nmt.vocab import PAD_ID

if TYPE_CHECKING:
    from nmt.config import DecoderConfig, EncoderConfig, ModelConfig

RNNS: dict[str, type[nn.GRU] | type[nn.LSTM]] = {"gru": nn.GRU, "lstm": nn.LSTM}


def embedding(vocab_size: int, cfg: ModelConfig, fast: FastPaths) -> tuple[nn.Embedding, nn.Module]:
    """A side's word embedding (PAD_ID's row stays zero) and the dropout on its output."""
    embed = nn.Embedding(vocab_size, cfg.embedding_size, padding_idx=PAD_ID)
    return embed, fast.dropout(cfg.embedding_dropout)


def stacked_rnn(
    cfg: EncoderConfig | DecoderConfig, input_size: int, bidirectional: bool = False
) -> nn.RNNBase:
    """A stacked GRU/LSTM, batch first, dropout between layers."""
    return RNNS[cfg.rnn](
        input_size,
        cfg.hidden_size,
        num_layers=cfg.layers,
        batch_first=True,
        bidirectional=bidirectional,
        dropout=cfg.dropout if cfg.layers > 1 else 0.0,
    )


@dataclass
class EncoderOutput:
    """outputs: (B, S, Ho); mask: (B, S) True at real positions;
    hidden/cell: (L, D, B, H) final states per layer and direction (cell only for LSTM)."""

    outputs: Tensor
    mask: Tensor
    hidden: Tensor
    cell: Tensor | None


class Encoder(nn.Module):
    """Bahdanau et al. (2015), section 3.2: a bidirectional RNN whose annotation of word j is
    [h_forward_j; h_backward_j]. Padding never enters the recurrence (``FastPaths.recurrence``
    honours the lengths)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, fast: FastPaths):
        super().__init__()
        self.embed, self.embedding_dropout = embedding(vocab_size, cfg, fast)
        enc = cfg.encoder
        self.directions = 2 if enc.bidirectional else 1
        self.layers = enc.layers
        self.hidden_size = enc.hidden_size
        self.rnn = stacked_rnn(enc, cfg.embedding_size, enc.bidirectional)
        self.output_dropout = fast.dropout(enc.dropout)
        self.output_size = enc.hidden_size * self.directions
        self.fast = fast

    def forward(
        self,
        src: Tensor,
        src_lengths: Tensor,
        table: Tensor | None = None,
        static: bool = False,
    ) -> EncoderOutput:
        """src: (B, S) ids; src_lengths: (B,) -> EncoderOutput. ``table``: this encoder's
        ``gate_table``, for a search's fixed weights (evaluation mode, without gradient).
        ``static``: the lengths on src's device, never read on the host
        (``FastPaths.recurrence``)."""
        mask = src != PAD_ID  # (B, S)
        # annotations (B, S, D*H), padding never entering the recurrence
        if table is not None:
            assert not self.training, "the gate table is for search"
            outputs, final = self.fast.source_rnn(self.rnn, table, src, src_lengths)
        else:
            embedded = self.embedding_dropout(self.embed(src))  # (B, S, E)
            outputs, final = self.fast.recurrence(
                self.rnn, embedded, src_lengths, None, self.training, static
            )
        hidden, cell = final if isinstance(final, tuple) else (final, None)
        batch = src.size(0)
        shape = (self.layers, self.directions, batch, self.hidden_size)
        return EncoderOutput(
            outputs=self.output_dropout(outputs),  # (B, S, D*H)
            mask=mask,
            hidden=hidden.view(shape),
            cell=cell.view(shape) if cell is not None else None,
        )

    def gate_table(self) -> Tensor | None:
        """The first RNN layer's input gates of every source piece (D, V, G*H), made once for
        search (``FastPaths.source_gates``: a CPU, float32), or None: what ``forward`` takes
        as ``table``, valid until the weights change."""
        return self.fast.source_gates(self.embed, self.rnn)


class Bridge(nn.Module):
    """Initial decoder state from the encoder.

    ``bridge``: s_0 = tanh(W_s h_backward_1) (Bahdanau et al. 2015, appendix A.2.2), the
    backward RNN's state after reading the whole sentence, for each decoder layer (the forward
    final state when the encoder is unidirectional). ``final``: the encoder's final states
    per layer, directions concatenated (Luong et al. 2015, Sutskever et al. 2014). ``zeros``.
    """

    def __init__(self, encoder: Encoder, cfg: DecoderConfig):
        super().__init__()  # the config schema checked that init: final's sizes match
        self.kind = cfg.init
        self.layers = cfg.layers
        self.hidden_size = cfg.hidden_size
        self.lstm = cfg.rnn == "lstm"
        if self.kind == "bridge":
            parts = 2 if self.lstm else 1
            self.proj = nn.Linear(encoder.hidden_size, parts * cfg.layers * cfg.hidden_size)

    def forward(self, enc: EncoderOutput) -> tuple[Tensor, Tensor | None]:
        """-> hidden (L, B, Hd), cell (L, B, Hd) or None (GRU)."""
        batch = enc.outputs.size(0)
        shape = (self.layers, batch, self.hidden_size)
        if self.kind == "zeros":
            zeros = enc.outputs.new_zeros(shape)
            return zeros, (zeros.clone() if self.lstm else None)
        if self.kind == "final":
            hidden = enc.hidden.permute(0, 2, 1, 3).reshape(shape)  # (L, B, D*H)
            cell = None
            if self.lstm:
                cell = (
                    enc.cell.permute(0, 2, 1, 3).reshape(shape)
                    if enc.cell is not None
                    else torch.zeros_like(hidden)
                )
            return hidden, cell
        top = enc.hidden[-1, -1]  # (B, H): backward direction when bidirectional
        states = torch.tanh(self.proj(top))  # (B, parts*L*Hd)
        states = states.view(batch, -1, self.layers, self.hidden_size).permute(1, 2, 0, 3)
        hidden = states[0].contiguous()  # (L, B, Hd)
        cell = states[1].contiguous() if self.lstm else None
        return hidden, cell
