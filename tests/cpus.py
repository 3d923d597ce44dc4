"""A CPU the precision tests describe themselves: its name fixed, no oneDNN cap, and a cache
of its own, so that no verdict of this machine's is read."""

from __future__ import annotations

from pathlib import Path

import pytest

import nmt.fast.precision as precision


def described_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This test's CPU is "Test CPU", with no ISA cap and an empty cache under tmp_path."""
    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path / "cache"))
    for name in precision.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(precision, "cpu_description", lambda: "model name: Test CPU")
