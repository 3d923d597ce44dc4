"""The models a server decodes with, each loaded once at start under its name (its run
directory's), and what GET /api/models says of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt import checkpoint
from nmt.commands.common import Models
from nmt.commands.serve.schemas import ModelInfo, PlanInfo, TrainingFigures, VocabularySizes
from nmt.config import Config
from nmt.data.tokenizer import Tokenizer
from nmt.decoding.translator import Translator


@dataclass
class ServedModel:
    """A model requests name: ``name``, the run directory or checkpoint it came from, its
    loaded ``translator`` and what its checkpoint records of its training."""

    name: str
    path: Path
    translator: Translator = field(repr=False)
    training: TrainingFigures = field(default_factory=TrainingFigures)

    @classmethod
    def load(
        cls, path: Path, name: str | None = None, device: str = "auto", precision: str = "auto"
    ) -> ServedModel:
        """The run directory (its best.pt) or checkpoint ``path``, named ``name`` (None: its
        run directory's name)."""
        models = Models([Path(path)], device, precision)
        (file,) = models.files()
        translator = models.open()
        figures = training_figures(checkpoint.load(file), translator.config)
        return cls(name or run_name(Path(path)), Path(path), translator, figures)

    def info(self) -> ModelInfo:
        translator = self.translator
        tokenizer = translator.tokenizer
        return ModelInfo(
            name=self.name,
            path=str(self.path),
            device=str(translator.device),
            precision=translator.precision,
            decoding_plan=PlanInfo(**translator.plan(translator.config.decoding).as_dict()),
            alignment_head=translator.has_alignment_head,
            summary=summary(translator.config, tokenizer),
            config=translator.config.model_dump(mode="json"),
            vocabulary=VocabularySizes(
                source=tokenizer.src_vocab_size,
                target=tokenizer.trg_vocab_size,
                joint=tokenizer.joint,
            ),
            training=self.training,
        )


def load_models(models: Sequence[Models]) -> list[ServedModel]:
    """Each ``--model`` (its device and precision) as a served model; every path is checked
    before any is loaded. Names are the run directories' names; a name taken already gets
    ``-2``, ``-3``, ..."""
    for given in models:
        given.files()
    names = unique_names([run_name(Path(given.paths[0])) for given in models])
    return [
        ServedModel.load(given.paths[0], name, given.device, given.precision)
        for given, name in zip(models, names, strict=True)
    ]


def run_name(path: Path) -> str:
    """A run directory's name; a checkpoint file's: its directory's."""
    directory = path if path.is_dir() else path.parent
    return directory.resolve().name or "model"


def unique_names(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}-{n}"
        out.append(candidate)
    return out


def training_figures(state: dict[str, Any], config: Config) -> TrainingFigures:
    """Step, epoch, best dev score and the last validation's BLEU and loss, as the
    checkpoint's ``progress`` records them (None where it records nothing)."""
    progress = state.get("progress")
    if not isinstance(progress, dict):
        return TrainingFigures(best_metric=config.training.best_metric)
    history = progress.get("history") or [{}]
    last = history[-1] if isinstance(history[-1], dict) else {}
    return TrainingFigures(
        step=_number(progress.get("step"), int),
        epoch=_number(progress.get("epoch"), int),
        best_metric=config.training.best_metric,
        best=_number(progress.get("best_score"), float),
        dev_bleu=_number(last.get("bleu"), float),
        dev_loss=_number(last.get("loss"), float),
    )


def _number(value: Any, kind: type[int] | type[float]) -> Any:
    return kind(value) if isinstance(value, (int, float)) else None


def summary(config: Config, tokenizer: Tokenizer) -> str:
    """One line, e.g. ``Luong general attention, no input feeding; bi-GRU 256, GRU 256;
    8000 pieces``."""
    model = config.model
    encoder, decoder, attention = model.encoder, model.decoder, model.attention
    score = attention.score
    if score in ("local-m", "local-p"):
        score = f"{score} ({attention.local_score})"
    feeding = ""
    if decoder.style == "luong":
        feeding = ", input feeding" if decoder.input_feeding else ", no input feeding"
    reader = _rnn(encoder.rnn, encoder.hidden_size, encoder.layers)
    sides = f"{'bi-' if encoder.bidirectional else ''}{reader}, " + _rnn(
        decoder.rnn, decoder.hidden_size, decoder.layers
    )
    sizes = (tokenizer.src_vocab_size, tokenizer.trg_vocab_size)
    pieces = f"{sizes[0]} pieces" if tokenizer.joint else f"{sizes[0]}/{sizes[1]} pieces"
    return f"{decoder.style.capitalize()} {score} attention{feeding}; {sides}; {pieces}"


def _rnn(cell: str, size: int, layers: int) -> str:
    return f"{cell.upper()} {size}" + (f" x{layers}" if layers > 1 else "")
