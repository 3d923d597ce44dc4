"""The config: every key, its type, its default and a one-line description, and its loader.

YAML becomes typed, frozen objects here and nowhere else. Unknown keys are errors with the
closest match; every problem in a file is reported at once, one per line, as
``model.attention.score: got 'dott', expected one of ...``.

``base`` holds what every section shares, ``model`` the model section and its rules, ``schema``
the other sections and ``Config``, ``loading`` YAML, overrides and the error messages.
"""

from nmt.config.base import MAX_LAYERS, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH
from nmt.config.loading import (
    apply_override,
    changed_keys,
    from_dict,
    load,
    parse_yaml,
    read_yaml,
    saved_config,
    to_yaml,
    unknown_keys,
)
from nmt.config.model import (
    AttentionConfig,
    DecoderConfig,
    EncoderConfig,
    ModelConfig,
)
from nmt.config.schema import (
    Config,
    DataConfig,
    DecodingConfig,
    RunConfig,
    TokenizerConfig,
    TrainingConfig,
)
from nmt.errors import ConfigError

__all__ = [
    "MAX_LAYERS",
    "MAX_LENGTH",
    "MAX_VOCAB",
    "MAX_WIDTH",
    "AttentionConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecoderConfig",
    "DecodingConfig",
    "EncoderConfig",
    "ModelConfig",
    "RunConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "apply_override",
    "changed_keys",
    "from_dict",
    "load",
    "parse_yaml",
    "read_yaml",
    "saved_config",
    "to_yaml",
    "unknown_keys",
]
