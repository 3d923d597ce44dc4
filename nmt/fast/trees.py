"""A CUDA graph's inputs as a tree: tensors, None and plain values in dataclasses, lists,
tuples, dicts and objects that list their tensors (``tensors()``: search's ``Finished``),
taken apart into its tensors and a hashable structure (``flatten``: a graph's key), made
again around other tensors (``rebuild``), or written into in place (``write_back``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from typing import Any

from torch import Tensor

TENSOR = "tensor"  # a tensor's place in a structure


def flatten(value: Any, tensors: list[Tensor]) -> Hashable:
    """``value``'s structure, its tensors appended to ``tensors``: TENSOR for a tensor, (type,
    ((name or index, structure), ...)) for a dataclass (the fields ``__init__`` takes), list,
    tuple, dict or an object's ``tensors()``, a ``Static`` for any other value."""
    if isinstance(value, Tensor):
        tensors.append(value)
        return TENSOR
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        items: Any = [(f.name, getattr(value, f.name)) for f in fields if f.init]
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    elif callable(getattr(value, "tensors", None)):
        items = enumerate(value.tensors())
    else:
        return Static(value)
    return (type(value), tuple((key, flatten(part, tensors)) for key, part in items))


def rebuild(structure: Any, tensors: Iterator[Tensor]) -> Any:
    """A tree of ``structure`` (``flatten``'s) around the next of ``tensors``: new dataclasses,
    lists, tuples and dicts (not objects that list their tensors), the same plain values."""
    if isinstance(structure, Static):
        return structure.value
    if structure == TENSOR:
        return next(tensors)
    kind: type[Any] = structure[0]
    parts = {key: rebuild(part, tensors) for key, part in structure[1]}
    if dataclasses.is_dataclass(kind):
        return kind(**parts)
    return kind(parts) if issubclass(kind, dict) else kind(parts.values())


def write_back(into: Any, new: Any, strict: bool = False) -> Any:
    """``new``'s tensors written into ``into``'s own, field by field (dataclasses, lists,
    dicts, an object's ``tensors()``; equal plain values stay): -> ``into``. A field whose
    tensor is new (a first coverage vector) or is not a tensor (a step count) is set
    instead, except with ``strict`` (a graph being captured, whose inputs must stay where
    they are): then a ValueError."""
    if isinstance(into, Tensor) and isinstance(new, Tensor) and into.shape == new.shape:
        if into is not new:
            into.copy_(new)
        return into
    if isinstance(into, bool | int | float | str) and type(into) is type(new) and into == new:
        return into
    if dataclasses.is_dataclass(into) and type(into) is type(new):
        for field in dataclasses.fields(into):
            old, value = getattr(into, field.name), getattr(new, field.name)
            if old is not value:
                object.__setattr__(into, field.name, write_back(old, value, strict))
        return into
    if type(into) is type(new) and callable(getattr(into, "tensors", None)):
        for mine, theirs in zip(into.tensors(), new.tensors(), strict=True):
            write_back(mine, theirs, strict)
        return into
    if isinstance(into, list) and isinstance(new, list) and len(into) == len(new):
        into[:] = [write_back(a, b, strict) for a, b in zip(into, new, strict=True)]
        return into
    if isinstance(into, dict) and isinstance(new, dict) and into.keys() == new.keys():
        for key in into:
            into[key] = write_back(into[key], new[key], strict)
        return into
    if strict and into is not new and not (into is None and new is None):
        raise ValueError(f"a captured step would replace a {type(into).__name__}")
    return new


class Static:
    """A plain value in a structure: equal by type and value where it is hashable (by
    identity, for an object that defines no equality: the plain attention products), else
    by identity."""

    def __init__(self, value: Any):
        self.value = value
        self._key = (type(value), value) if isinstance(value, Hashable) else id(value)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self._key == other._key
