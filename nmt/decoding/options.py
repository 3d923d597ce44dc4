"""What a caller asks of decoding beyond the run's config: the ``decoding`` keys it overrides
(``decoding_options``: applied to the run's section and checked by the schema), the choices
that cannot go together (``check_request``), what one request adds that is no config key
(``SearchOptions``), and what runs the search (``Backend``: the model in PyTorch, or its
exported graphs under onnxruntime). The commands, the server and the Python API share these;
each error names an option as the caller named it (``Naming``): `nmt translate --n-best`,
a request's ``n_best`` field."""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from nmt.config import DecodingConfig
from nmt.errors import ConfigError

Backend = Literal["torch", "onnxruntime"]


@dataclass(frozen=True)
class Naming:
    """What the caller calls each option, for errors in its words: an option's own key
    (``beam_size``: a config key, a request field, a keyword argument) unless ``names`` maps
    it to another (`nmt translate`'s ``--beam``; the align request's ``use_attention``)."""

    names: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, key: str) -> str:
        return self.names.get(key, key)


KEYS = Naming()  # the keys themselves: request fields and the Python API's keywords


@dataclass(frozen=True)
class SearchOptions:
    """One request's choices beside the decoding section: hypotheses kept per line, whether
    they keep their attention, a cap on the padded source tokens of a batch (None: only
    ``decoding.batch_size`` bounds a batch), and an event that, once set, ends the search
    at its next step with ``captured.SearchStopped`` (None: it runs to the end)."""

    n_best: int = 1
    attention: bool = False
    batch_tokens: int | None = None
    stop: threading.Event | None = None


def decoding_options(
    base: DecodingConfig, overrides: Mapping[str, object], naming: Naming = KEYS
) -> DecodingConfig:
    """The run's decoding section (``base``) with the given keys (None: keep) applied and
    checked by the schema (its bounds: ``DecodingConfig``); every problem in one ConfigError,
    each naming its option by ``naming``."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return DecodingConfig.model_validate({**base.model_dump(), **given})
    except ValidationError as exc:
        problems = [_problem(error, naming) for error in exc.errors()]
        raise ConfigError("; ".join(problems)) from None


def _problem(error: ErrorDetails, naming: Naming) -> str:
    """One of the schema's errors as ``name: got VALUE; what it should be``."""
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        keys = list(DecodingConfig.model_fields)
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f"did you mean {naming(close[0])}?" if close else f"one of {', '.join(keys)}"
        return f"{naming(key)}: not a decoding option; {hint}"
    message = error["msg"]
    return f"{naming(key)}: got {error['input']!r}; {message[0].lower()}{message[1:]}"


def check_request(
    decoding: DecodingConfig,
    n_best: int,
    constrained: bool,
    beam_given: bool,
    naming: Naming = KEYS,
) -> None:
    """Options that cannot go together: more n-best than beam, constraints with greedy. The
    options are ``beam_size``, ``n_best`` and ``constraints``, named by ``naming``."""
    beam_size, best, constraints = naming("beam_size"), naming("n_best"), naming("constraints")
    beam = f"{beam_size} {decoding.beam_size}" + (
        "" if beam_given else " (the run's decoding.beam_size)"
    )
    if n_best > decoding.beam_size:
        raise ConfigError(
            f"{best} {n_best} is larger than {beam}; a beam keeps at most that many "
            f"hypotheses: raise {beam_size} or lower {best}"
        )
    if constrained and decoding.beam_size < 2:
        raise ConfigError(
            f"{constraints} needs a beam of 2 or more, got {beam}: greedy search cannot "
            f"place constraints; give {beam_size} 5 (at least one more than the constraint "
            f"pieces)"
        )
