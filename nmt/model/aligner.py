"""The alignment head: a second attention that reads each target word once it is known.

The decoder's attention at step t is computed before y_t is chosen: it is the model's guess
of where the next word comes from, and where word order is free it guesses wrong. Knowing
the word itself ("target foresight", Peter et al. 2017) makes aligning a lookup, and the
head is that lookup, learnt from an aligner's links (guided alignment, Chen et al. 2016):

    x_t = [f_t ; e(y_t)]                        f_t the decoder's features that predict y_t,
                                                 e(y_t) the target embedding of y_t
    score(t, s) = (W x_t + b)^T h_s             h_s the encoder's annotation of source piece s
    beta_t = softmax_s score(t, s)              over the real source pieces (EOS included)

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

    def __init__(self, feature_size: int, embedding_size: int, key_size: int, joint: bool = False):
        super().__init__()
        self.query = nn.Linear(feature_size + embedding_size, key_size)  # W, b
        self.joint = joint

    def forward(self, features: Tensor, embedded: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        inputs = torch.cat([features, embedded], dim=-1)
        if not self.joint:
            inputs, values = inputs.detach(), values.detach()
        query = self.query(inputs)  # (B, T, K)
        scores = torch.bmm(query, values.transpose(1, 2).to(query.dtype))  # (B, T, S)
        return masked_softmax(scores, mask)
