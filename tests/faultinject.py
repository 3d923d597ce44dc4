"""Faults the tests inject into a training run."""

from __future__ import annotations

import math
from typing import Any

import pytest

from nmt.model import Seq2Seq


def nan_losses(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int] | range) -> None:
    """Make the training loss NaN on the given training forward passes (counting from 1)."""
    real_loss = Seq2Seq.loss
    calls = {"n": 0}

    def loss(self: Seq2Seq, *tensors: Any, **options: Any) -> Any:
        loss_sum, nll_sum = real_loss(self, *tensors, **options)
        if self.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                return loss_sum * math.nan, nll_sum * math.nan
        return loss_sum, nll_sum

    monkeypatch.setattr(Seq2Seq, "loss", loss)
