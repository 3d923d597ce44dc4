"""What one request may ask of the server (``Limits``, the flags of `nmt serve`), and the
checks that turn a request past one into a ``LimitError`` (HTTP 413) before any decoding."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nmt.errors import NMTError


class LimitError(NMTError):
    """A request larger than the server takes: too many sentences, characters or body bytes,
    or too wide a beam."""


@dataclass(frozen=True)
class Limits:
    """Per request: sentences (or pairs), characters of text (sentences, targets, prefixes
    and constraint phrases together), bytes of the body, and the beam size."""

    max_sentences: int = 64
    max_chars: int = 20_000
    max_body: int = 1_000_000
    max_beam: int = 32

    def check_count(self, field: str, count: int) -> None:
        if count > self.max_sentences:
            raise LimitError(
                f"{field}: {count} given, more than this server's limit of "
                f"{self.max_sentences} per request (nmt serve --max-sentences); send them in "
                f"several requests"
            )

    def check_chars(self, texts: Iterable[str]) -> None:
        total = sum(len(text) for text in texts)
        if total > self.max_chars:
            raise LimitError(
                f"text: {total} characters, more than this server's limit of "
                f"{self.max_chars} per request (nmt serve --max-chars); send it in several "
                f"requests"
            )

    def check_beam(self, beam_size: int, given: bool) -> None:
        if beam_size > self.max_beam:
            which = "beam_size" if given else "beam_size (the run's decoding.beam_size)"
            raise LimitError(
                f"{which}: {beam_size}, more than this server's limit of {self.max_beam} "
                f"(nmt serve --max-beam); ask for a smaller beam"
            )

    def body_message(self, declared: int | None) -> str:
        """The error of a body past ``max_body``: ``declared`` by its Content-Length, or
        (None) found so while it was read."""
        amount = f"{declared} bytes, more than" if declared is not None else "more than"
        return (
            f"request body: {amount} this server's limit of {self.max_body} bytes (nmt serve "
            f"--max-body); send less text per request"
        )
