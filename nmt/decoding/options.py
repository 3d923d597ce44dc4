"""What a caller asks of decoding beyond the run's config: the ``decoding`` keys it overrides
(``decoding_options``: applied to the run's section and checked by the schema), the choices
that cannot go together (``check_request``), what one request adds that is no config key
(``SearchOptions``), and what runs the search (``Backend``: the model in PyTorch, or its
exported graphs under onnxruntime). The commands and the Python API share these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from nmt.config import DecodingConfig, from_dict
from nmt.errors import ConfigError

Backend = Literal["torch", "onnxruntime"]


@dataclass(frozen=True)
class SearchOptions:
    """One request's choices beside the decoding section: hypotheses kept per line, whether
    they keep their attention, and a cap on the padded source tokens of a batch (None: only
    ``decoding.batch_size`` bounds a batch)."""

    n_best: int = 1
    attention: bool = False
    batch_tokens: int | None = None


def decoding_options(base: DecodingConfig, overrides: Mapping[str, object]) -> DecodingConfig:
    """The run's decoding section (``base``) with the given keys (None: keep) applied and
    checked by the schema."""
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = {**base.model_dump(), **given}
    return from_dict({"decoding": merged}, "decoding options").decoding


def check_request(
    decoding: DecodingConfig, n_best: int, constrained: bool, beam_given: bool
) -> None:
    """Options that cannot go together: more n-best than beam, constraints with greedy."""
    beam = f"--beam {decoding.beam_size}" + (
        "" if beam_given else " (the run's decoding.beam_size)"
    )
    if n_best > decoding.beam_size:
        raise ConfigError(
            f"--n-best {n_best} is larger than {beam}; a beam keeps at most that many "
            f"hypotheses: raise --beam or lower --n-best"
        )
    if constrained and decoding.beam_size < 2:
        raise ConfigError(
            f"--constraints needs a beam of 2 or more, got {beam}: greedy search cannot "
            f"place constraints; give --beam 5 (at least one more than the constraint pieces)"
        )
