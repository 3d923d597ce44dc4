"""Trained models with their tokenizer: checkpoints (or an exported model under
onnxruntime) in, lines in, hypotheses out. Used by the commands (`nmt translate`, `nmt eval`)
and by validation during training."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt import checkpoint
from nmt.config import Config, DecodingConfig, saved_config
from nmt.data.batching import length_sorted_batches, pad
from nmt.data.tokenizer import Tokenizer, checkpoint_tokenizer
from nmt.decoding.ensemble import Ensemble, Stepper, StepTables
from nmt.decoding.exported import load_exported
from nmt.decoding.options import Backend, SearchOptions
from nmt.decoding.plan import DecodingPlan, kernels_run, shortlist_used
from nmt.decoding.scoring import Scored, score_ids
from nmt.decoding.search import Hypothesis, beam_search, runs_on_device
from nmt.decoding.search_precision import search_precision
from nmt.decoding.shortlist import Columns, Shortlist, batch_columns, forced_pieces
from nmt.decoding.steering import Steering
from nmt.decoding.workers import AUTO_WORKERS, in_workers, worker_count, worker_stream
from nmt.errors import CheckpointError, ConfigError, DataError
from nmt.fast import compiled
from nmt.model import Seq2Seq, build_model
from nmt.runtime import allow_tf32, autocast, choose_device, eval_mode
from nmt.vocab import UNK_ID


@dataclass
class Translation:
    """One input line's n-best list (empty for an empty line, or for a line whose constraints
    no output could meet) and its source pieces."""

    hypotheses: list[Hypothesis]
    src_ids: list[int]

    @property
    def best(self) -> Hypothesis | None:
        """The best hypothesis; None where there is none."""
        return self.hypotheses[0] if self.hypotheses else None


class Translator:
    """One trained model, or an ensemble of models that share a tokenizer, ready to decode
    and to score. ``config`` is the first model's (its decoding section is the default).

    ``backend``: another stepper for search to step instead of the models (an exported
    model under onnxruntime, ``from_exported``), with no models: it decodes, it cannot score.
    """

    def __init__(
        self,
        model: Seq2Seq | Sequence[Seq2Seq],
        tokenizer: Tokenizer,
        config: Config,
        device: torch.device,
        precision: str = "fp32",
        precision_reason: str | None = None,
        backend: Stepper[Any] | None = None,
        shortlists: Sequence[Shortlist] | None = None,
    ):
        members = [model] if isinstance(model, Seq2Seq) else list(model)
        # a model already there stays as it is: moving it would re-pack a GPU RNN's weights
        # into new memory, under a training run's CUDA graphs and optimiser
        self.models = [m if _on(m, device) else m.to(device) for m in members]
        self.model = self.models[0] if self.models else None
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.precision = precision
        self._tables: list[StepTables] | None = None  # see _step_tables
        self.precision_reason = precision_reason or f"as given: {precision}"
        # each model's lexical shortlist of its training data; None: a model has none
        self.shortlists = list(shortlists) if shortlists is not None else None
        self.last_plan: DecodingPlan | None = None  # what the last search or scoring ran

    @classmethod
    def from_checkpoint(
        cls, path: Path, device: str = "auto", precision: str = "fp32"
    ) -> Translator:
        return cls.from_checkpoints([path], device, precision)

    @classmethod
    def from_checkpoints(
        cls, paths: Sequence[Path], device: str = "auto", precision: str = "fp32"
    ) -> Translator:
        """Load one model per run directory or checkpoint (several: an ensemble); every
        model must have the first one's tokenizer."""
        target = choose_device(device)
        loaded = [_load_member(Path(path)) for path in paths]
        first_path, _, first_tokenizer, first_config, _ = loaded[0]
        for path, _, tokenizer, _, _ in loaded[1:]:
            if tokenizer.state_dict() != first_tokenizer.state_dict():
                raise CheckpointError(
                    f"--model {path}: its tokenizer differs from that of --model {first_path} "
                    f"(vocabularies {tokenizer.src_vocab_size}/{tokenizer.trg_vocab_size} and "
                    f"{first_tokenizer.src_vocab_size}/{first_tokenizer.trg_vocab_size}); an "
                    f"ensemble's models must share one tokenizer: train them on the same data "
                    f"with the same tokenizer settings, or with tokenizer.model set to one file"
                )
        models = [m for _, m, _, _, _ in loaded]
        found = [member[4] for member in loaded]
        shortlists = [s for s in found if s is not None] if None not in found else None
        made: dict[str, Translator] = {}

        def make(name: str) -> Translator:
            if name not in made:
                made[name] = cls(
                    models, first_tokenizer, first_config, target, name, None, None, shortlists
                )
            return made[name]

        vocab = first_tokenizer.src_vocab_size
        chosen = search_precision(precision, target, make, first_config, models, vocab)
        allow_tf32(target, chosen.name)
        translator = make(chosen.name)
        translator.precision_reason = chosen.reason
        return translator

    @classmethod
    def from_exported(
        cls, directory: Path, device: str = "auto", precision: str = "auto"
    ) -> Translator:
        """An exported directory (`nmt export`) under onnxruntime, on the CPU in fp32 (int8
        weights where it was exported with --quantize int8), with its own tokenizer and
        config; its checkpoint is not read."""
        if device not in ("auto", "cpu"):
            raise ConfigError(
                f"--device {device}: --backend onnxruntime runs on the CPU; drop --device or "
                f"give --device cpu"
            )
        if precision not in ("auto", "fp32"):
            raise ConfigError(
                f"--precision {precision}: --backend onnxruntime runs the exported graphs "
                f"as they were exported; drop --precision"
            )
        exported = load_exported(Path(directory))
        name, reason = "fp32", "onnxruntime: the exported fp32 graphs"
        if exported.model.metadata.quantize == "int8":
            if precision == "fp32":
                raise ConfigError(
                    f"--precision fp32: {directory} holds int8 graphs (nmt export --quantize "
                    f"int8); drop --precision, or export the run without --quantize"
                )
            name, reason = "int8", "onnxruntime: int8 weights, onnxruntime's dynamic quantization"
        cpu = torch.device("cpu")
        return cls([], exported.tokenizer, exported.config, cpu, name, reason, exported.model)

    @property
    def backend_name(self) -> Backend:
        """What runs the search: the models in torch, or the exported graphs."""
        return "torch" if self.backend is None else "onnxruntime"

    def plan(
        self,
        decoding: DecodingConfig,
        sizes: Sequence[int] | None = None,
        steering: Steering | None = None,
        forced: bool = False,
    ) -> DecodingPlan:
        """What a search of batches of ``sizes`` sentences (None: full batches, as many as
        workers take) under ``decoding`` and ``steering`` runs here; ``forced``: a forced
        pass (scoring, alignment), one batch at a time over the whole output layer.
        ``decode_ids`` and ``score`` run by it and keep it as ``last_plan``."""
        native = self.stepper(decoding).native_kernels
        kernels = kernels_run(self.backend_name, self.device, self.precision, native)
        if forced:
            return DecodingPlan(
                self.precision, self.precision_reason, kernels, "forced", 1, False, "torch"
            )
        if sizes is None:  # as many full batches as the workers could take
            many = decoding.workers if decoding.workers != "auto" else AUTO_WORKERS
            sizes = [decoding.batch_size] * max(2, many)
        has = self.shortlists is not None
        return DecodingPlan(
            self.precision,
            self.precision_reason,
            kernels,
            "device" if runs_on_device(decoding, self.device, steering) else "host",
            worker_count(decoding.workers, self.device, sizes),
            shortlist_used(decoding, self.device, self.backend_name, has),
            self.backend_name,
        )

    def ensemble(self, decoding: DecodingConfig) -> Ensemble:
        """The models stepped as one, averaged as ``decoding.ensemble_average`` says."""
        if not self.models:
            raise ConfigError(
                "forced scoring and alignment heads need the model's checkpoint: the exported "
                "graphs only translate; give the run directory and the torch backend"
            )
        return Ensemble(self.models, decoding.ensemble_average, self._step_tables())

    def _step_tables(self) -> list[StepTables]:
        """Each model's StepTables, made on the first call: a Translator's models are fixed.
        In float32 alone (under autocast the module's matmuls run in the lower precision);
        the output layer's and the decoder step's products and the encoder's tables on a CPU
        (``FastPaths.product``, ``Decoder.search_products``, ``Encoder.gate_table``)."""
        if self._tables is None:
            fp32 = self.precision == "fp32"
            cpu = self.device.type == "cpu"
            self._tables = [
                StepTables(
                    m.decoder.gate_table() if fp32 else None,
                    m.fast.product(m.generator.weight) if fp32 and cpu else None,
                    m.decoder.search_products() if fp32 and cpu else None,
                    m.encoder.gate_table() if fp32 and cpu else None,
                )
                for m in self.models
            ]
        return self._tables

    def stepper(self, decoding: DecodingConfig) -> Stepper[Any]:
        """What search steps: the backend, else the models' ensemble."""
        return self.backend if self.backend is not None else self.ensemble(decoding)

    @property
    def has_alignment_head(self) -> bool:
        """Every model has an alignment head (model.alignment_head): alignments read it."""
        return bool(self.models) and all(model.aligner is not None for model in self.models)

    def head_alignment(
        self, src_ids: Sequence[int], tokens: Sequence[int], decoding: DecodingConfig
    ) -> Tensor | None:
        """The alignment heads' weights (|y|+1, |x|) for an output the search produced
        (``tokens``): one forced pass over it, as the heads read each word once it is
        chosen; None without heads."""
        if not self.has_alignment_head or not src_ids:
            return None
        with eval_modes(self.models), autocast(self.device, self.precision):
            scored = score_ids(
                self.ensemble(decoding),
                [list(src_ids)],
                [list(tokens)],
                decoding,
                self.device,
                True,
            )
        return scored[0].alignment

    def decode_ids(
        self,
        src_ids: Sequence[list[int]],
        decoding: DecodingConfig,
        search: SearchOptions = SearchOptions(),
        progress: Callable[[int], None] | None = None,
        steering: Steering | None = None,
    ) -> list[list[Hypothesis]]:
        """Beam-search every id sequence (non-empty), in length-sorted batches,
        ``decoding.workers`` batches at once (nmt.decoding.workers); ``steering`` has one
        entry per sequence. ``progress`` hears of each batch as it is done. Once
        ``search.stop`` is set, the search raises ``captured.SearchStopped`` at its next
        step."""
        out: list[list[Hypothesis]] = [[] for _ in src_ids]
        lengths = [len(s) for s in src_ids]
        batches = length_sorted_batches(lengths, decoding.batch_size, search.batch_tokens)
        plan = self.last_plan = self.plan(decoding, [len(index) for index in batches], steering)
        scorer = self.stepper(decoding)  # made here: its tables once, before any thread
        shortlists = self.shortlists if plan.shortlist else None
        workers = plan.workers
        if workers > 1 and scorer.native_kernels:
            compiled.library()  # built (on a first run) and loaded once, not by each thread

        def decode(index: np.ndarray) -> list[list[Hypothesis]]:
            chunk = [src_ids[i] for i in index]
            part = steering.subset(index.tolist()) if steering is not None else None
            # per thread, as autocast's state is; on a GPU each worker on its own stream
            with worker_stream(self.device, workers), autocast(self.device, self.precision):
                src = pad(chunk).to(self.device)
                src_lengths = torch.tensor([len(s) for s in chunk], device=self.device)
                if shortlists is None:
                    options = (search.n_best, search.attention, part, search.stop)
                    return beam_search(scorer, src, src_lengths, decoding, *options)
                return self._shortlisted(
                    shortlists, chunk, src, src_lengths, decoding, search, part
                )

        with eval_modes(self.models):
            # with workers, the longest batches first: a worker's last batch is then short
            done = (
                ((index, decode(index)) for index in batches)
                if workers == 1
                else in_workers(batches[::-1], decode, workers)
            )
            for index, results in done:
                for i, hyps in zip(index, results, strict=True):
                    for hyp in hyps:  # on the host, without the batch's padding columns
                        if hyp.alphas is not None:
                            hyp.alphas = hyp.alphas[:, : len(src_ids[i])].float().cpu()
                    out[int(i)] = hyps
                if progress is not None:
                    progress(len(index))
        return out

    def decoding_shortlists(self, decoding: DecodingConfig) -> list[Shortlist] | None:
        """The shortlists search uses under ``decoding.shortlist`` (``plan.shortlist_used``);
        None: the whole output layer."""
        has = self.shortlists is not None
        if shortlist_used(decoding, self.device, self.backend_name, has):
            return self.shortlists
        return None

    def _shortlisted(
        self,
        shortlists: list[Shortlist],
        chunk: list[list[int]],
        src: Tensor,
        src_lengths: Tensor,
        decoding: DecodingConfig,
        search: SearchOptions,
        steering: Steering | None,
    ) -> list[list[Hypothesis]]:
        """One batch's search over its shortlist's columns, its outputs in target ids."""
        ids, allowed = batch_columns(
            shortlists,
            chunk,
            decoding.shortlist_frequent,
            decoding.shortlist_per_word,
            forced_pieces(steering, len(chunk)),
        )
        columns = Columns(ids)
        scorer = self.ensemble(decoding).restricted(ids.to(self.device), allowed.to(self.device))
        options = (search.n_best, search.attention, columns.steering(steering), search.stop)
        results = beam_search(scorer, src, src_lengths, decoding, *options)
        return [columns.hypotheses(hyps) for hyps in results]

    def translate(
        self,
        lines: Sequence[str],
        decoding: DecodingConfig,
        search: SearchOptions = SearchOptions(),
        progress: Callable[[int], None] | None = None,
        steering: Steering | None = None,
    ) -> list[Translation]:
        """Exactly one Translation per input line; empty lines give empty n-best lists.
        ``steering`` has one entry per line (the empty lines' entries are not used)."""
        keep = [i for i, line in enumerate(lines) if line.strip()]
        src_ids = self.tokenizer.encode_src([lines[i] for i in keep])
        if progress is not None and len(keep) < len(lines):
            progress(len(lines) - len(keep))
        kept = steering.subset(keep) if steering is not None else None
        hyps = self.decode_ids(src_ids, decoding, search, progress, kept)
        out = [Translation([], []) for _ in lines]
        for i, ids, h in zip(keep, src_ids, hyps, strict=True):
            out[i] = Translation(h, ids)
        return out

    def score(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        decoding: DecodingConfig,
        return_attention: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> list[Scored | None]:
        """Forced scores of each (source, target) pair; None where the source is empty
        (nothing to condition on, as translate gives an empty line for it)."""
        keep = [i for i, line in enumerate(sources) if line.strip()]
        src_ids = self.tokenizer.encode_src([sources[i] for i in keep])
        trg_ids = self.tokenizer.encode_trg([targets[i] for i in keep])
        if progress is not None and len(keep) < len(sources):
            progress(len(sources) - len(keep))
        ensemble = self.ensemble(decoding)
        self.last_plan = self.plan(decoding, forced=True)
        with eval_modes(self.models), autocast(self.device, self.precision):
            scored = score_ids(
                ensemble,
                src_ids,
                trg_ids,
                decoding,
                self.device,
                return_attention,
                progress,
            )
        out: list[Scored | None] = [None] * len(sources)
        for i, result in zip(keep, scored, strict=True):
            out[i] = result
        return out

    def detokenize(self, hypothesis: Hypothesis) -> str:
        return self.tokenizer.decode_trg([hypothesis.tokens])[0]

    def best_text(self, translation: Translation) -> str:
        """The best hypothesis's text; empty where there is none (an empty line, or unmet
        constraints): a line's output line."""
        best = translation.best
        return self.detokenize(best) if best is not None else ""

    def target_ids(self, text: str, where: str) -> list[int]:
        """A target phrase's pieces; ``where`` (file and line) names it in the error when a
        piece is not in the target vocabulary."""
        (ids,) = self.tokenizer.encode_trg([text])
        if UNK_ID in ids:
            pieces = self.tokenizer.trg.encode(text, out_type=str)
            unknown = [p for p, i in zip(pieces, ids, strict=False) if i == UNK_ID]
            raise DataError(
                f"{where}: {text!r} has pieces the model's target vocabulary lacks "
                f"({', '.join(repr(p) for p in unknown[:3]) or 'unknown characters'}); the "
                f"model cannot produce them: change the phrase"
            )
        return ids


def _load_member(path: Path) -> tuple[Path, Seq2Seq, Tokenizer, Config, Shortlist | None]:
    """A checkpoint (or run directory) -> its path, model in eval mode, tokenizer, config
    and shortlist (None: the checkpoint has none)."""
    path = checkpoint.resolve(path)
    state = checkpoint.load(path)
    config = saved_config(state["config"], path, state.get("version"))
    tokenizer = checkpoint_tokenizer(state, path)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    _check_weights(model, state["model"], tokenizer, path)
    model.load_state_dict(state["model"])
    model.eval()
    shortlist = None
    if state.get("shortlist") is not None:
        shortlist = Shortlist.from_state_dict(
            state["shortlist"], tokenizer.src_vocab_size, tokenizer.trg_vocab_size, path
        )
    return path, model, tokenizer, config, shortlist


def _on(model: Seq2Seq, device: torch.device) -> bool:
    """Whether every tensor of ``model`` is on ``device``."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(
        t.device == device or (t.device.type == device.type and device.index is None)
        for t in tensors
    )


@contextmanager
def eval_modes(models: Sequence[Seq2Seq]) -> Iterator[None]:
    """Every model in eval mode for the block; each training flag restored afterwards."""
    with ExitStack() as stack:
        for model in models:
            stack.enter_context(eval_mode(model))
        yield


def _check_weights(
    model: Seq2Seq, weights: dict[str, Any], tokenizer: Tokenizer, path: Path
) -> None:
    """The saved weights have the names and shapes of the model that the saved config and
    tokenizer build; a vocabulary size that differs means the tokenizer is not the model's."""
    expected = model.state_dict()
    names = set(expected) ^ set(weights)
    if names:
        raise CheckpointError(
            f"{path}: the weights do not fit the model of the saved config (parameters "
            f"{', '.join(sorted(names)[:3])} differ); the checkpoint was written by another nmt "
            f"version or edited"
        )
    vocab = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    for name, tensor in weights.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) == want:
            continue
        if want and want[0] in vocab and tensor.shape[0] != want[0]:
            raise CheckpointError(
                f"{path}: its tokenizer has {vocab[0]} source / {vocab[1]} target pieces but "
                f"{name} has {tensor.shape[0]} rows; the tokenizer does not belong to this "
                f"model: use the checkpoint as nmt train wrote it"
            )
        raise CheckpointError(
            f"{path}: {name} has shape {tuple(tensor.shape)} but the saved config builds "
            f"{want}; the checkpoint was written by another nmt version or edited"
        )
