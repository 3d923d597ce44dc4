"""What every config section shares: strict, frozen validation and the bounds of sizes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bounds that no model trainable with nmt reaches; a size above them is a typo.
MAX_WIDTH = 65_536  # embedding, hidden and output sizes, heads
MAX_LAYERS = 64
MAX_VOCAB = 1_000_000
MAX_LENGTH = 100_000  # sentence lengths in pieces, positions, windows; the longest output
MAX_COUNT = 2**31 - 1  # counts of steps, epochs, sentences, tokens, minutes (a C int)
MAX_BEAM = 1_000  # beam width: each sentence scores beam x vocabulary pieces a step
MAX_DECODING_BATCH = 10_000  # sentences a search steps at once (a GPU pads a batch to it)
MAX_LEN_RATIO = 1_000.0  # output pieces per source piece
MAX_NBEST_SAMPLES = 512  # segmentations sentencepiece samples among (its kMaxNBestSize)


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen once validated."""

    # strict: YAML's true is not 1 and "3" is not 3; finite: .inf and .nan pass no range check
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False
    )
