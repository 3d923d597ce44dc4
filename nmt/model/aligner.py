"""The alignment head: a second attention that reads each target word once it is known.

The decoder's attention at step t is computed before y_t is chosen: it is the model's guess
of where the next word comes from, and where word order is free it guesses wrong. Knowing
the word itself ("target foresight", Peter et al. 2017) makes aligning a lookup, and the
head is that lookup, learnt from an aligner's links (guided alignment, Chen et al. 2016):

    x_t = [f_t ; e(y_t)]                        f_t the decoder's features that predict y_t,
                                                 e(y_t) the target embedding of y_t
    score(t, s) = (W x_t + b)^T h_s             h_s the encoder's annotation of source piece s
    beta_t = softmax_s score(t, s)              over the real source pieces (EOS included)

With ``context`` (model.alignment_head_context) the head also reads the words after y_t,
the full target context of Garg et al. (2019): a GRU run backwards over the target
embeddings, r_t = GRU(e(y_t), r_{t+1}) from r_{T+1} = 0 (T: the last real piece, EOS),
and x_t = [f_t ; e(y_t) ; r_t]. An alignment is only read once the whole target is known
(nmt align, translate --alignments), so nothing is lost by looking ahead; a word whose
source depends on what follows it ("the" before the noun it goes with) can see it.

By default the inputs are detached: the head learns from the guided-alignment loss alone and
nothing of it reaches the encoder, the decoder or the embeddings, so translations are
exactly those of the model without it. ``joint`` (model.alignment_head_joint) lets the loss
train them too, a multi-task model (Garg et al. 2019) whose representations serve the
alignment as well as the translation. ``nmt align`` and ``nmt translate --alignments`` read
beta instead of the attention; beam search never does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nmt.model.attention import masked_softmax


class AlignmentHead(nn.Module):
    """beta (B, T, S) from the decoder features f (B, T, O), the target embeddings e(y)
    (B, T, E) and the encoder annotations h (B, S, K) with their mask (B, S)."""

    def __init__(
        self,
        feature_size: int,
        embedding_size: int,
        key_size: int,
        joint: bool = False,
        context: bool = False,
    ):
        super().__init__()
        # the backward GRU over the target embeddings: r_t, embedding_size wide
        self.context = nn.GRU(embedding_size, embedding_size, batch_first=True) if context else None
        width = feature_size + embedding_size * (2 if context else 1)
        self.query = nn.Linear(width, key_size)  # W, b
        self.joint = joint

    def forward(
        self,
        features: Tensor,
        embedded: Tensor,
        values: Tensor,
        mask: Tensor,
        trg_lengths: Tensor | None = None,
    ) -> Tensor:
        """``trg_lengths`` (B,): the real target pieces of each row (EOS included), which the
        context head needs; rows past a length are padding and their weights are ignored."""
        if not self.joint:
            features, embedded, values = features.detach(), embedded.detach(), values.detach()
        parts = [features, embedded]
        if self.context is not None:
            if trg_lengths is None:
                raise ValueError("the alignment head with target context needs trg_lengths")
            parts.append(self._right_context(embedded, trg_lengths))
        query = self.query(torch.cat(parts, dim=-1))  # (B, T, K)
        scores = torch.bmm(query, values.transpose(1, 2).to(query.dtype))  # (B, T, S)
        return masked_softmax(scores, mask)

    def _right_context(self, embedded: Tensor, lengths: Tensor) -> Tensor:
        """r (B, T, E): row t summarises e(y_t) .. e(y_T) of its sentence, read backwards.
        Each sentence is reversed within its length (its padding stays behind it), run
        forwards and put back in order: padding never reaches a real position."""
        assert self.context is not None
        steps = embedded.size(1)
        positions = torch.arange(steps, device=embedded.device).unsqueeze(0)  # (1, T)
        last = lengths.to(embedded.device).unsqueeze(1) - 1  # (B, 1)
        order = torch.where(positions <= last, last - positions, positions)  # its own inverse
        index = order.unsqueeze(-1).expand_as(embedded)
        reversed_in = embedded.gather(1, index)
        outputs, _ = self.context(reversed_in)
        return outputs.gather(1, order.unsqueeze(-1).expand_as(outputs))
