"""nmt.fast.trees, the walk over a CUDA graph's inputs that training's graphs and search's
captured step share: a tree taken apart and made again around other tensors, its structure
as a key (equal for equal shapes of work, apart for another plain value or shared object),
tensors written back in place (strictly: nothing replaced); and StepGraphs on a CPU with
its capture emulated by the module it would graph, once per key; a capture's autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nmt.decoding.finished import Finished
from nmt.fast import graphs
from nmt.fast.sinks import Products
from nmt.fast.trees import flatten, rebuild, write_back
from nmt.model.attention import Memory
from nmt.model.decoder import DecoderState


def _tree(seed: int, beams: int = 2, products: Products | None = None) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, 3, 4, generator=generator)
    memory = Memory(values, values * 2, torch.ones(2, 3, dtype=torch.bool), beams=beams)
    if products is not None:
        memory.products = products
    state = DecoderState(torch.randn(1, 2, 4, generator=generator), step=3)
    return {"memory": memory, "states": [state, None], "pair": (0.5, "text")}


def test_a_tree_is_made_again_around_other_tensors() -> None:
    tree = _tree(0)
    tensors: list[torch.Tensor] = []
    structure = flatten(tree, tensors)
    memory, state = tree["memory"], tree["states"][0]
    assert tensors == [memory.values, memory.keys, memory.mask, state.hidden]  # field order
    others = [t + 1 for t in tensors]
    made = rebuild(structure, iter(others))
    assert type(made) is dict and type(made["states"]) is list and made["pair"] == (0.5, "text")
    assert made["memory"] is not memory and made["memory"].keys is others[1]
    assert made["memory"].products is memory.products and made["memory"].beams == 2
    assert made["memory"].projected_values is None and made["states"][1] is None
    assert made["states"][0].hidden is others[3] and made["states"][0].step == 3


def test_a_structure_keys_plain_values_and_shared_objects() -> None:
    def key(tree: dict[str, Any]) -> Any:
        return flatten(tree, [])

    same = key(_tree(0)), key(_tree(1))  # other numbers, the same shapes of work
    assert same[0] == same[1] and hash(same[0]) == hash(same[1])
    assert key(_tree(0, beams=3)) != same[0]
    assert key(_tree(0, products=Products())) != key(_tree(0, products=Products()))
    one = Products()
    assert key(_tree(0, products=one)) == key(_tree(1, products=one))
    assert key({"flag": True}) != key({"flag": 1})  # by type and value
    unhashable = bytearray(b"x")  # by identity
    assert key({"b": unhashable}) == key({"b": unhashable}) != key({"b": bytearray(b"x")})


def _tensors(tree: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    flatten(tree, tensors)
    return tensors


def test_write_back_keeps_the_tensors_in_place() -> None:
    into, new = _tree(0), _tree(1)
    before = _tensors(into)
    assert write_back(into, new, strict=True) is into
    after = _tensors(into)
    assert all(a is b for a, b in zip(after, before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after, _tensors(new), strict=True))


def test_write_back_into_an_object_that_lists_its_tensors() -> None:
    into, new = Finished(2, 3, 4, True, "cpu", 5), Finished(2, 3, 4, True, "cpu", 5)
    new.scores.fill_(-1.0)
    new.count.fill_(2)
    scores = into.scores
    assert write_back(into, new, strict=True) is into
    assert into.scores is scores and torch.equal(into.scores, new.scores)
    assert into.count.tolist() == [2, 2]
    assert flatten(into, []) == flatten(new, [])
    with pytest.raises(TypeError):  # such an object is not made again
        rebuild(flatten(into, []), iter(new.tensors()))


def test_strict_write_back_replaces_nothing() -> None:
    into = DecoderState(torch.zeros(1, 2, 3), step=1)
    grown = DecoderState(torch.ones(1, 2, 3), step=1, coverage=torch.ones(2, 4))
    with pytest.raises(ValueError, match="would replace a NoneType"):
        write_back(into, grown, strict=True)
    with pytest.raises(ValueError, match="would replace a int"):
        write_back(into, DecoderState(torch.ones(1, 2, 3), step=2), strict=True)
    hidden = into.hidden
    write_back(into, grown)  # an eager step may
    assert into.hidden is hidden and into.coverage is grown.coverage
    assert write_back([1, torch.zeros(2)], [2, torch.ones(2)])[0] == 2


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, memory: Memory, scale: float) -> torch.Tensor:
        return memory.values * self.weight * scale


def test_step_graphs_capture_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed call is ``_Call`` (emulated: run, not graphed): the arguments are made
    again around the flat tensors, and a new shape or plain value is a new capture."""
    captured: list[Any] = []

    def emulated(self: Any, owner: nn.Module, function: Any, structure: Any, flat: Any) -> Any:
        captured.append(structure)
        return graphs._Call(owner, function, structure)

    monkeypatch.setattr(graphs.StepGraphs, "_capture", emulated)
    module, steps = _Scaled(), graphs.StepGraphs()
    for seed, scale in [(0, 1.0), (1, 1.0), (2, 3.0)]:
        memory = _tree(seed)["memory"]
        found = steps(module, module, memory, scale)
        assert torch.equal(found, module(memory, scale))
    assert len(captured) == len(steps) == 2
    found.sum().backward()
    assert module.weight.grad is not None


def test_a_capture_autocasts_as_before_with_its_cache_off() -> None:
    with graphs.uncached_autocast():
        assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()
