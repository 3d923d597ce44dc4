"""An exported model (`nmt export RUN --format onnx -o DIR`) read without its checkpoint, and
run by onnxruntime behind search's step contract (``nmt.decoding.ensemble.Stepper``), so
that ``beam_search`` steps the two graphs as it steps the model.

The directory (``nmt.decoding.onnx`` writes it):

    encoder.onnx       src (batch, source) int64, src_lengths (batch,) int64 -> the attention
                       memory's tensors (values, keys, mask, ...) and the decoder's first state
                       (hidden, cell, feed, coverage: those the model has)
    decoder_step.onnx  prev (batch,) int64, step () int64, the state and the memory ->
                       log_probs (batch, V) float32, alphas (batch, source) float32, and the
                       next state (next_hidden, ...)
    export.json        the format, opset and exporter, and each graph's inputs and outputs in
                       order with their dynamic axes (axis -> "batch" or "source")
    config.yaml        the run's resolved config
    spm.model          the tokenizer (spm.src.model and spm.trg.model when not joint)

In the step graph "batch" counts hypotheses (sentences x beams). The memory is fixed per row;
the state is reordered along its batch axis as search keeps and repeats beams. onnxruntime
and its friends are the optional extra ``onnx``: imported here, when a model is loaded.
"""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt.config import Config, read_yaml, saved_config
from nmt.data.tokenizer import Tokenizer
from nmt.errors import CheckpointError, DependencyError
from nmt.fast import FastPaths

FORMAT = 1  # bumped when the directory's layout changes incompatibly
METADATA = "export.json"
ENCODER = "encoder.onnx"
STEP = "decoder_step.onnx"
CONFIG = "config.yaml"
JOINT_TOKENIZER = ("spm.model",)
SPLIT_TOKENIZER = ("spm.src.model", "spm.trg.model")
BATCH, SOURCE = "batch", "source"  # the dynamic axes' names
EXTRA = "pip install -e '.[onnx]'"
# onnxruntime's errors for a graph file it cannot load ("Load model from FILE failed: ...")
GRAPH_ERRORS = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf")


def require(package: str, what: str) -> ModuleType:
    """An optional package of the ``onnx`` extra, imported; missing, a one-line error."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise DependencyError(
            f"{what} needs the {package} package, which is not installed: {EXTRA}"
        ) from None


@dataclass(frozen=True)
class Graph:
    """One graph's file and its inputs and outputs in order, each with its dynamic axes."""

    file: str
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Graph:
        def axes(side: dict[str, dict[str, str]]) -> dict[str, dict[int, str]]:
            return {name: {int(a): kind for a, kind in dims.items()} for name, dims in side.items()}

        return cls(raw["file"], axes(raw["inputs"]), axes(raw["outputs"]))


@dataclass(frozen=True)
class Metadata:
    """export.json: what the directory holds and how it was made."""

    encoder: Graph
    step: Graph
    opset: int
    exporter: str
    src_vocab_size: int
    trg_vocab_size: int
    tokenizer: tuple[str, ...]
    checkpoint: str
    nmt_version: str
    torch_version: str
    format: int = FORMAT
    quantize: str | None = None  # "int8": onnxruntime's dynamic int8 of the weights
    int8_error: float | None = None  # int8: the largest |log-probability change| found

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Metadata:
        raw = json.loads(text)
        raw["encoder"], raw["step"] = Graph.from_json(raw["encoder"]), Graph.from_json(raw["step"])
        raw["tokenizer"] = tuple(raw["tokenizer"])
        return cls(**raw)

    def files(self) -> list[str]:
        return [METADATA, CONFIG, self.encoder.file, self.step.file, *self.tokenizer]


@dataclass
class GraphState:
    """The rows' tensors by graph name: the memory, fixed per row, and the decoder's state;
    ``step``: the 0-based target position of the next step."""

    memory: dict[str, Tensor]
    decoder: dict[str, Tensor]
    step: int = 0


class ExportedModel:
    """The two graphs under onnxruntime (CPU), stepped as search steps an ``Ensemble``:
    ``encode``, ``step``, ``reorder`` and ``select`` (``nmt.decoding.ensemble.Stepper``).

    ``threads``: onnxruntime's threads for every run; None: as many as torch has in the
    calling thread, so that each of ``decoding.workers`` threads (``nmt.decoding.workers``)
    runs the graphs with its own share. The sessions of each thread count are made once,
    on first use (the caller's count at once, so that a bad graph fails at load)."""

    def __init__(self, directory: Path, metadata: Metadata, threads: int | None = None):
        self._ort = require("onnxruntime", "--backend onnxruntime")
        self.directory = directory
        self.metadata = metadata
        self.threads = threads
        self._sessions: dict[int, tuple[Any, Any]] = {}
        self._making = threading.Lock()
        _, decoder = self.sessions()
        # the graphs' inputs as onnxruntime kept them (an input no output depends on is gone)
        self.step_inputs = {node.name for node in decoder.get_inputs()}
        outputs = metadata.step.outputs
        self.state_names = [n.removeprefix("next_") for n in outputs if n.startswith("next_")]
        self.batch_axis = {
            name: _axis(dims, BATCH) for name, dims in metadata.encoder.outputs.items()
        }
        # search's top-k over the graphs' log-probabilities: as a model built here would take it
        self.native_kernels = FastPaths().native_kernels

    def sessions(self) -> tuple[Any, Any]:
        """The encoder's and the step's sessions for the calling thread's count of threads."""
        count = self.threads or torch.get_num_threads()
        with self._making:
            if count not in self._sessions:
                options = self._ort.SessionOptions()
                options.intra_op_num_threads = count
                options.inter_op_num_threads = 1
                options.log_severity_level = 4  # its errors are exceptions, not lines on stderr
                # onnxruntime's threads spin between runs by default, on the cores torch's
                # threads need for the search's work between steps
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                self._sessions[count] = tuple(  # type: ignore[assignment]
                    self._session(self.directory / name, options) for name in (ENCODER, STEP)
                )
            return self._sessions[count]

    def _session(self, path: Path, options: Any) -> Any:
        """An onnxruntime session of the graph ``path``; a graph onnxruntime cannot load (a
        truncated or damaged file) is a one-line error naming it."""
        state = self._ort.capi.onnxruntime_pybind11_state
        errors = tuple(getattr(state, name) for name in GRAPH_ERRORS)
        try:
            return self._ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
        except errors as exc:
            if "Load model from" not in str(exc):  # the graph loaded: not the file's fault
                raise
            raise CheckpointError(
                f"{path}: damaged or not written by nmt export; export the run again"
            ) from None

    def encode(self, src: Tensor, src_lengths: Tensor, repeat: int = 1) -> GraphState:
        """src (B, S), src_lengths (B,) -> the state of B * repeat rows."""
        feeds = {"src": src, "src_lengths": src_lengths}
        outputs = _run(self.sessions()[0], list(self.metadata.encoder.outputs), feeds)
        if repeat > 1:
            index = torch.arange(src.size(0)).repeat_interleave(repeat)
            outputs = {n: t.index_select(self.batch_axis[n], index) for n, t in outputs.items()}
        memory = {n: t for n, t in outputs.items() if n not in self.state_names}
        return GraphState(memory, {n: outputs[n] for n in self.state_names})

    def step(self, prev: Tensor, state: GraphState) -> tuple[Tensor, Tensor, GraphState]:
        """prev (N,) -> log-probabilities (N, V) float32, attention (N, S), the next state."""
        given = {"prev": prev, "step": torch.tensor(state.step), **state.decoder, **state.memory}
        feeds = {name: given[name] for name in self.step_inputs}
        out = _run(self.sessions()[1], list(self.metadata.step.outputs), feeds)
        decoder = {name: out[f"next_{name}"] for name in self.state_names}
        return out["log_probs"], out["alphas"], GraphState(state.memory, decoder, state.step + 1)

    def reorder(self, state: GraphState, index: Tensor) -> GraphState:
        """The state of the rows ``index`` (N',); the memory stays as it is (search keeps K
        rows per sentence throughout)."""
        index = index.cpu()
        decoder = {n: t.index_select(self.batch_axis[n], index) for n, t in state.decoder.items()}
        return GraphState(state.memory, decoder, state.step)

    def select(self, state: GraphState, index: Tensor) -> GraphState:
        """The rows ``index`` (N'), the memory's included (finished sentences dropped)."""
        index = index.cpu()
        memory = {n: t.index_select(self.batch_axis[n], index) for n, t in state.memory.items()}
        return GraphState(memory, self.reorder(state, index).decoder, state.step)


def _axis(dims: dict[int, str], kind: str) -> int:
    (axis,) = [a for a, name in dims.items() if name == kind]
    return axis


def _run(session: Any, names: list[str], feeds: dict[str, Tensor]) -> dict[str, Tensor]:
    """One run of a graph: tensors in (on the CPU), tensors out, by name."""
    arrays = {name: np.ascontiguousarray(t.detach().cpu().numpy()) for name, t in feeds.items()}
    return {n: torch.from_numpy(a) for n, a in zip(names, session.run(names, arrays), strict=True)}


@dataclass
class Exported:
    """An exported directory, loaded: the graphs, the tokenizer and the run's config."""

    model: ExportedModel
    tokenizer: Tokenizer
    config: Config


def read_metadata(directory: Path) -> Metadata:
    """export.json of an exported directory; anything else is a one-line error saying what
    to give instead."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise CheckpointError(
            f"{directory}: {what}; give the directory that nmt export --format onnx wrote"
        )
    path = directory / METADATA
    if not path.is_file():
        run = (directory / "best.pt").is_file() or (directory / "last.pt").is_file()
        hint = (
            f"it is a run directory: export it first (nmt export {directory} --format onnx "
            f"-o DIR) or translate it without --backend onnxruntime"
            if run
            else "give the directory that nmt export --format onnx wrote"
        )
        raise CheckpointError(f"{directory}: not an exported model (no {METADATA}); {hint}")
    try:
        metadata = Metadata.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"{path}: damaged or not written by nmt export; export the run again"
        ) from None
    if metadata.format != FORMAT:
        raise CheckpointError(
            f"{path}: export format {metadata.format} (nmt {metadata.nmt_version}) is not "
            f"readable by this nmt, which reads format {FORMAT}; export the run again"
        )
    missing = [name for name in metadata.files() if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{directory}: incomplete export (no {', '.join(missing)}); export the run again"
        )
    return metadata


def load_exported(directory: Path, threads: int | None = None) -> Exported:
    """An exported directory's graphs (under onnxruntime), tokenizer and config; the
    checkpoint it came from is not read."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    config = saved_config(read_yaml(directory / CONFIG), directory / CONFIG, metadata.nmt_version)
    protos = [(directory / name).read_bytes() for name in metadata.tokenizer]
    try:
        tokenizer = Tokenizer(protos[0], protos[-1])
    except RuntimeError:
        raise CheckpointError(
            f"{directory}: {', '.join(metadata.tokenizer)} is not a valid sentencepiece "
            f"model; export the run again"
        ) from None
    sizes = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    if sizes != (metadata.src_vocab_size, metadata.trg_vocab_size):
        raise CheckpointError(
            f"{directory}: the tokenizer has {sizes[0]}/{sizes[1]} pieces but the graphs "
            f"were exported for {metadata.src_vocab_size}/{metadata.trg_vocab_size}; the "
            f"files do not belong together: export the run again"
        )
    return Exported(ExportedModel(directory, metadata, threads), tokenizer, config)
