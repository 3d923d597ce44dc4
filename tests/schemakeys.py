"""The config schema's leaf keys, for the tests that walk it (the reference page, the
property tests)."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from nmt.config import Config


def leaf_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, FieldInfo]:
    """Dotted key -> field, for every leaf key of every section."""
    keys: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.update(leaf_keys(annotation, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = field
    return keys
