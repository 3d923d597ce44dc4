"""The ONNX export of a trained model (`nmt export RUN --format onnx`): the encoder and one
decoder step as two graphs, traced through the model's own code (``Seq2Seq.encode``, the
decoder's ``step``, ``log_probs``), run under onnxruntime and compared with the model before
they are written. ``nmt.decoding.exported`` describes the directory and reads it back.

The exporter is torch.onnx's TorchScript exporter (``dynamo=False``) at opset ``OPSET``:

- torch.export, under the dynamo exporter, cannot take the encoder: ``pack_padded_sequence``'s
  batch sizes depend on the lengths' values. The TorchScript exporter turns the packed RNN
  into ONNX's GRU/LSTM with ``sequence_lens``, which keeps padding out of the recurrence as
  packing does (the backward direction starts at each sentence's last token).
- PyTorch's GRU applies the reset gate after the recurrent matmul, r * (W_hn h + b_hn): ONNX's
  GRU with ``linear_before_reset=1``. The dynamo exporter wrote 0, a different equation
  (pytorch#189225, onnxscript#2852; fixed in later onnxscript), the TorchScript exporter
  writes 1. ``check_recurrences`` refuses any GRU node without it.

Every batch and source-length axis is dynamic (found by encoding two batches of other sizes);
the step graph's "batch" counts hypotheses (sentences x beams). ``verify`` runs both graphs
on a batch of another size, with padding, than the one traced, and names the config key of
the first output that differs from the model's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nmt import __version__
from nmt.config import Config, to_yaml
from nmt.data.batching import pad
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.exported import (
    BATCH,
    CONFIG,
    ENCODER,
    JOINT_TOKENIZER,
    METADATA,
    SOURCE,
    SPLIT_TOKENIZER,
    STEP,
    ExportedModel,
    Graph,
    GraphState,
    Metadata,
    require,
)
from nmt.errors import ConfigError
from nmt.files import atomic_write_text
from nmt.model import Seq2Seq
from nmt.model.attention import Memory
from nmt.model.decoder import DecoderState
from nmt.model.scores import AdditiveAttention
from nmt.runtime import eval_mode
from nmt.vocab import BOS_ID

OPSET = 17
EXPORTER = "torch.onnx.export, TorchScript (dynamo=False)"
# Two probe batches, (B, S) = (3, 6) and (4, 9), each with padding: the first is traced, the
# second checks the graphs on other sizes.
PROBES = ([6, 3, 2], [9, 2, 4, 3])
STEPS = 3  # decoder steps checked
RTOL, ATOL = 1e-3, 1e-4  # fp32 round-off of the graphs' other operation order
# The config key an output that differs points to, in the order they are checked.
ENCODER_KEYS = {
    "values": "model.encoder.rnn",
    "mask": "model.encoder.rnn",
    "keys": "model.attention.score",
    "projected_values": "model.attention.score",
    "coverage_terms": "model.attention.coverage",
    "hidden": "model.decoder.init",
    "cell": "model.decoder.init",
    "feed": "model.decoder.input_feeding",
    "coverage": "model.attention.coverage",
}
STEP_KEYS = {
    "next_hidden": "model.decoder.rnn",
    "next_cell": "model.decoder.rnn",
    "alphas": "model.attention.score",
    "next_coverage": "model.attention.coverage",
    "next_feed": "model.decoder.style",
    "log_probs": "model.decoder.style",
}


def _tensors(obj: Any) -> dict[str, Tensor]:
    """A dataclass's tensor fields by name (those that are None, and ``step``, left out)."""
    found = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name != "step"}
    return {name: value for name, value in found.items() if isinstance(value, Tensor)}


class EncoderGraph(nn.Module):
    """src (B, S), src_lengths (B,) -> the memory's tensors, then those of the decoder's first
    state, with the coverage C_0 = 0 that the model makes at its first step."""

    def __init__(self, model: Seq2Seq):
        super().__init__()
        self.model = model
        self.train(model.training)  # torch.onnx.export restores this mode to the model

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Memory, DecoderState]:
        memory, state = self.model.encode(src, src_lengths)
        attention = self.model.decoder.attention
        if isinstance(attention, AdditiveAttention) and attention.coverage is not None:
            state = replace(state, coverage=attention.coverage.initial(memory))
        return memory, state

    def forward(self, src: Tensor, src_lengths: Tensor) -> tuple[Tensor, ...]:
        memory, state = self.encode(src, src_lengths)
        return (*_tensors(memory).values(), *_tensors(state).values())


class StepGraph(nn.Module):
    """prev (N,), step () and the tensors of the state, then of the memory, in the order of
    their fields -> log_probs (N, V) float32, alphas (N, S), the next state's tensors. The
    templates (a state and a memory of this model) give the classes and the fields that are
    None; the step is the decoder's own, with the position a tensor, the graph's input."""

    def __init__(self, model: Seq2Seq, state: DecoderState, memory: Memory):
        super().__init__()
        self.model = model
        self.templates = (state, memory)
        self.state_names = list(_tensors(state))
        self.memory_names = list(_tensors(memory))
        self.train(model.training)

    def forward(self, prev: Tensor, step: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        given: dict[str, Any] = dict(
            zip(self.state_names + self.memory_names, tensors, strict=True)
        )
        state, memory = self.templates
        memory = replace(memory, **{name: given[name] for name in self.memory_names})
        state = replace(state, step=step, **{name: given[name] for name in self.state_names})
        features, alphas, after = self.model.decoder.step(prev, memory, state)
        following = _tensors(after)
        assert list(following) == self.state_names, (list(following), self.state_names)
        return (self.model.log_probs(features), alphas, *following.values())


def _probe_source(lengths: list[int], vocab_size: int) -> tuple[Tensor, Tensor]:
    """Random word ids (no special pieces), right-padded: (B, S) and lengths (B,)."""
    generator = torch.Generator().manual_seed(len(lengths))
    first = BOS_ID + 2  # the first piece after PAD, UNK, BOS and EOS
    ids = [
        torch.randint(first, max(vocab_size, first + 1), (n,), generator=generator) for n in lengths
    ]
    return pad([row.tolist() for row in ids]), torch.tensor(lengths)


class _Probe:
    """The model's encoder and decoder step on one probe batch: what is traced, and what
    the graphs are compared with."""

    def __init__(self, model: Seq2Seq, lengths: list[int], vocab_size: int):
        self.src, self.src_lengths = _probe_source(lengths, vocab_size)
        memory, state = EncoderGraph(model).encode(self.src, self.src_lengths)
        self.memory, self.first = _tensors(memory), _tensors(state)
        self.graph = StepGraph(model, state, memory)
        self.bos = torch.full((len(lengths),), BOS_ID)

    def step_args(self, prev: Tensor, t: int, state: dict[str, Tensor]) -> tuple[Tensor, ...]:
        return (prev, torch.tensor(t), *state.values(), *self.memory.values())

    def step(self, prev: Tensor, t: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """log_probs, alphas and next_<name> for each of the state's tensors."""
        names = ["log_probs", "alphas", *(f"next_{name}" for name in state)]
        return dict(zip(names, self.graph(*self.step_args(prev, t, state)), strict=True))


def _axes(first: dict[str, Tensor], second: dict[str, Tensor]) -> dict[str, dict[int, str]]:
    """Each tensor's dynamic axes, from its shapes on the two probes: the axes whose size
    follows the batch size (3, 4) or the source width (6, 9)."""
    kinds = {(len(PROBES[0]), len(PROBES[1])): BATCH, (max(PROBES[0]), max(PROBES[1])): SOURCE}
    out = {}
    for name, tensor in first.items():
        sizes = zip(tensor.shape, second[name].shape, strict=True)
        out[name] = {axis: kinds[pair] for axis, pair in enumerate(sizes) if pair[0] != pair[1]}
    return out


def export_onnx(
    model: Seq2Seq,
    tokenizer: Tokenizer,
    config: Config,
    directory: Path,
    checkpoint: str,
    quantize: str | None = None,
) -> Metadata:
    """Write the exported model of ``checkpoint`` (its path, recorded) into ``directory``,
    an existing empty folder: both graphs, checked against the model (``quantize`` "int8":
    then quantized, ``quantize_int8``), then the tokenizer, the config and export.json."""
    onnx = require("onnx", "nmt export --format onnx")
    require("onnxruntime", "nmt export --format onnx")
    with eval_mode(model), torch.no_grad():
        encoder, step = _export_graphs(model, tokenizer.src_vocab_size, directory)
        for graph, side in ((encoder, "encoder"), (step, "decoder")):
            check_recurrences(onnx.load(str(directory / graph.file)), f"model.{side}.rnn")
        metadata = Metadata(
            encoder,
            step,
            OPSET,
            EXPORTER,
            tokenizer.src_vocab_size,
            tokenizer.trg_vocab_size,
            JOINT_TOKENIZER if tokenizer.joint else SPLIT_TOKENIZER,
            checkpoint,
            __version__,
            torch.__version__,
        )
        verify(model, ExportedModel(directory, metadata), config)
        if quantize == "int8":
            metadata = quantize_int8(model, directory, metadata)
    tokenizer.save(directory)
    atomic_write_text(directory / CONFIG, to_yaml(config))
    atomic_write_text(directory / METADATA, metadata.to_json())
    return metadata


def quantize_int8(model: Seq2Seq, directory: Path, metadata: Metadata) -> Metadata:
    """Both graphs, already checked in fp32, rewritten by onnxruntime's dynamic quantization:
    the weights of every MatMul (output layer, attention, projections), Gather (embeddings)
    and LSTM as int8 with a scale per output channel, in 7 bits (``reduce_range``: on a CPU
    without VNNI onnxruntime's 8-bit products sum in 16 bits, which full 8-bit weights
    saturate; an export may run anywhere), the activations quantized as each call runs;
    onnxruntime has no integer GRU, so GRU nodes stay fp32. The largest change of a
    log-probability over the probe's steps is recorded (``int8_error``)."""
    quantization = require("onnxruntime.quantization", "nmt export --quantize int8")
    fp32 = ExportedModel(directory, metadata)
    for graph in (metadata.encoder, metadata.step):
        path = directory / graph.file
        staged = path.with_name(f"int8.{graph.file}")
        with warnings.catch_warnings(), _root_logger_quiet():
            warnings.simplefilter("ignore")
            quantization.quantize_dynamic(
                str(path),
                str(staged),
                weight_type=quantization.QuantType.QInt8,
                per_channel=True,
                reduce_range=True,
            )
        staged.replace(path)
    int8 = ExportedModel(directory, metadata)
    return replace(metadata, quantize="int8", int8_error=_largest_change(model, fp32, int8))


@contextlib.contextmanager
def _root_logger_quiet() -> Iterator[None]:
    """onnxruntime's quantizer advises pre-processing through the root logger's warnings."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _largest_change(model: Seq2Seq, fp32: ExportedModel, int8: ExportedModel) -> float:
    """max |log p_int8 - log p_fp32| over the probe's first ``STEPS`` greedy steps, both fed
    the fp32 graphs' tokens; non-finite int8 outputs are a ConfigError."""
    probe = _Probe(model, PROBES[1], fp32.metadata.src_vocab_size)
    states = [m.encode(probe.src, probe.src_lengths) for m in (fp32, int8)]
    prev, largest = probe.bos, 0.0
    for _ in range(STEPS):
        (want, _, after), (got, _, after_int8) = (
            m.step(prev, state) for m, state in zip((fp32, int8), states, strict=True)
        )
        if not bool(torch.isfinite(got).all()):
            raise ConfigError(
                "--quantize int8: the int8 graphs give non-finite log-probabilities on a test "
                "batch; export without --quantize"
            )
        largest = max(largest, float((got - want).abs().max()))
        states, prev = [after, after_int8], want.argmax(dim=-1)
    return largest


def _export_graphs(model: Seq2Seq, vocab_size: int, directory: Path) -> tuple[Graph, Graph]:
    """Both graphs traced on the first probe into ``directory``: their names and axes."""
    first, second = (_Probe(model, lengths, vocab_size) for lengths in PROBES)
    axes = _axes({**first.memory, **first.first}, {**second.memory, **second.first})
    encoder = Graph(ENCODER, {"src": {0: BATCH, 1: SOURCE}, "src_lengths": {0: BATCH}}, axes)
    _write(EncoderGraph(model), (first.src, first.src_lengths), directory, encoder)
    stepped = [probe.step(probe.bos, 0, probe.first) for probe in (first, second)]
    inputs = {"prev": {0: BATCH}, "step": {}, **{n: axes[n] for n in [*first.first, *first.memory]}}
    step = Graph(STEP, inputs, _axes(*stepped))
    _write(first.graph, first.step_args(first.bos, 0, first.first), directory, step)
    return encoder, step


def _write(module: nn.Module, args: Sequence[Tensor], directory: Path, graph: Graph) -> None:
    """torch.onnx's TorchScript exporter, its warnings (the tracer's, the deprecation, the
    packed sequence's shape inference) kept off the command's output."""
    axes = {name: dims for name, dims in {**graph.inputs, **graph.outputs}.items() if dims}
    with warnings.catch_warnings(), _native_stderr_silenced():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            tuple(args),
            str(directory / graph.file),
            dynamo=False,
            opset_version=OPSET,
            input_names=list(graph.inputs),
            output_names=list(graph.outputs),
            dynamic_axes=axes,
        )


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The exporter's C++ passes print their warnings to file descriptor 2 themselves; for
    the block, that goes to a temporary file."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def check_recurrences(graph: Any, key: str) -> None:
    """Every GRU node of an ONNX graph computes PyTorch's GRU: linear_before_reset=1 (the
    module docstring); ``key`` names the config key in the error."""
    for node in graph.graph.node:
        if node.op_type != "GRU":
            continue
        reset = {a.name: a.i for a in node.attribute}.get("linear_before_reset", 0)
        if reset != 1:
            raise ConfigError(
                f"{key}: 'gru' was exported as ONNX's GRU with linear_before_reset={reset}, "
                f"another equation than PyTorch's GRU (the reset gate after the recurrent "
                f"matmul: 1; pytorch#189225); translate the run with the torch backend"
            )


def verify(model: Seq2Seq, exported: ExportedModel, config: Config) -> None:
    """Both graphs under onnxruntime equal the model on the second probe (another batch
    size and source width than traced, with padding), for ``STEPS`` steps each fed the
    model's own state; else a ConfigError naming the key of the first output that differs."""
    probe = _Probe(model, PROBES[1], exported.metadata.src_vocab_size)
    with _failures("encoder", config):
        encoded = exported.encode(probe.src, probe.src_lengths)
    found = {**encoded.memory, **encoded.decoder}
    _compare(ENCODER_KEYS, {**probe.memory, **probe.first}, found, "encoder", config)
    prev, state = probe.bos, probe.first
    for t in range(STEPS):
        expected = probe.step(prev, t, state)
        with _failures("decoder step", config):
            log_probs, alphas, after = exported.step(prev, GraphState(probe.memory, state, t))
        found = {"log_probs": log_probs, "alphas": alphas}
        found.update({f"next_{name}": tensor for name, tensor in after.decoder.items()})
        _compare(STEP_KEYS, expected, found, "decoder step", config)
        state = {name: expected[f"next_{name}"] for name in state}
        prev = expected["log_probs"].argmax(dim=-1)


@contextlib.contextmanager
def _failures(graph: str, config: Config) -> Iterator[None]:
    """onnxruntime's error running a graph on other sizes than traced (a shape the tracer
    froze) -> a ConfigError naming the key of the module whose node failed."""
    try:
        yield
    except Exception as exc:  # onnxruntime's error types are its own
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        found = re.search(r"running (\w+) node\. Name:'([^']*)'", str(exc))
        node = f"its {found[1]} node {found[2]}" if found else "onnxruntime"
        key = _key_of_node(found[2] if found else "", graph)
        raise ConfigError(
            f"{key}: {_setting(config, key)!r} does not export faithfully: the ONNX {graph} "
            f"fails on a batch of other sizes than the one traced ({node}); translate this "
            f"run with the torch backend (nmt translate without --backend)"
        ) from None


def _key_of_node(name: str, graph: str) -> str:
    """The config key of the module a node belongs to (its scope, /attention/... or
    /rnn/...), else of the graph's main part."""
    if "/attention/" in name:
        return "model.attention.score"
    if graph == "encoder":
        return "model.encoder.rnn"
    return "model.decoder.rnn" if "/rnn/" in name else "model.decoder.style"


def _setting(config: Config, key: str) -> Any:
    """The value of a dotted config key."""
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _compare(
    keys: dict[str, str],
    expected: dict[str, Tensor],
    found: dict[str, Tensor],
    graph: str,
    config: Config,
) -> None:
    """The first output (in ``keys``' order) whose values differ beyond fp32 round-off is a
    ConfigError naming its config key."""
    for name in sorted(expected, key=list(keys).index):
        want, got = expected[name].double(), found[name].double()
        if got.shape == want.shape:
            gap = (got - want).abs()
            if bool((gap <= ATOL + RTOL * want.abs()).all()):
                continue
            difference = f"differs from the model's by up to {float(gap.max()):.2g}"
        else:
            difference = f"has shape {tuple(got.shape)}, the model's {tuple(want.shape)}"
        key = keys[name]
        raise ConfigError(
            f"{key}: {_setting(config, key)!r} does not export faithfully: the ONNX {graph}'s {name} "
            f"{difference} on a batch of other sizes than the one traced; translate this run "
            f"with the torch backend (nmt translate without --backend)"
        )
