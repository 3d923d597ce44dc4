"""The `nmt` command line: train | translate | score | align | eval | average | export | serve.

Each command parses its options and calls one library function. Any NMTError becomes one
line on stderr and exit status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import typer

try:  # typer >= 0.20 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[assignment,no-redef]
    from click.globals import get_current_context  # type: ignore[no-redef]

from nmt import __version__
from nmt.allocator import limit_kernel_cache
from nmt.config import MAX_LENGTH, DecodingConfig, RunConfig, TrainingConfig
from nmt.decoding.options import Backend, Naming, decoding_options
from nmt.errors import NMTError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Device = str
    Precision = str
    EnsembleAverage = str
    ShortlistMode = str
else:  # the config's own choices (Literal types), which Typer lists in the help and checks
    Device = RunConfig.model_fields["device"].annotation
    Precision = TrainingConfig.model_fields["precision"].annotation
    EnsembleAverage = DecodingConfig.model_fields["ensemble_average"].annotation
    ShortlistMode = DecodingConfig.model_fields["shortlist"].annotation

Request = TypeVar("Request", bound="DataclassInstance")

app = typer.Typer(
    help="Attention-based RNN encoder-decoder machine translation: train, translate, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False, "may_restart": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """nmt: Bahdanau and Luong attention models from a YAML config."""
    _state["debug"] = debug


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config file (see configs/).")],
    override: Annotated[
        list[str] | None,
        typer.Option(
            "--override", "-O", help="Set a config key: --override training.epochs=3 (repeatable)."
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the run in the run directory from its last checkpoint."
        ),
    ] = False,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Run directory (default: run.dir of the config)."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No log lines on stderr.")] = False,
) -> None:
    """Train a model: data, tokenizer, checkpoints, logs and tensorboard go to the run dir."""
    from nmt.config import load

    cfg = load(config, override or [])  # a config's error comes before torch's import
    from nmt.training import train as run_training

    try:
        run_training(cfg, run_dir, resume=resume, quiet=quiet, restart=_state["may_restart"])
    except KeyboardInterrupt:
        where = Path(run_dir or cfg.run.dir)
        if (where / "last.pt").is_file():
            message = f"interrupted: {where / 'last.pt'} is saved; continue with --resume"
        else:
            message = (
                "interrupted before the first checkpoint: nothing to resume; run the command again"
            )
        typer.echo(message, err=True)
        raise typer.Exit(130) from None


# Options that several commands share, each declared once.
ModelsOption = Annotated[
    list[Path],
    typer.Option(
        "--model",
        "-m",
        help="Run directory (uses best.pt) or checkpoint file; repeat for an ensemble of models "
        "that share a tokenizer.",
    ),
]
OutputOption = Annotated[str, typer.Option("--output", "-o", help="Output file; - for stdout.")]
DeviceOption = Annotated[Device, typer.Option("--device", help="auto, cpu or cuda.")]
PrecisionOption = Annotated[
    Precision,
    typer.Option(
        "--precision",
        help="auto (bf16 on a GPU with native bf16, else fp16; on a CPU bf16 only where it has "
        "native bf16 and a probe finds it faster, else fp32), fp32, bf16 or fp16 autocast.",
    ),
]
BackendOption = Annotated[
    Backend,
    typer.Option(
        "--backend",
        help="torch (the checkpoint), or onnxruntime: --model is a directory that nmt export "
        "--format onnx wrote, decoded on the CPU in fp32 (no checkpoint needed).",
    ),
]
SourceOption = Annotated[
    str | None, typer.Option("--input", "-i", help="Source sentences, one a line; - for stdin.")
]
TargetOption = Annotated[
    str | None,
    typer.Option("--target", "-t", help="Their translations, line for line with --input."),
]
TsvOption = Annotated[
    str | None,
    typer.Option(
        "--tsv", help="source<TAB>target lines instead of -i/-t; - for stdin (the default)."
    ),
]


def _flag(param: Any) -> str:
    """An option's long name (``--beam`` of ``--beam/-b``), as errors name it."""
    return max(param.opts, key=len) if param.opts else str(param.name)


def _decoding_value(param: typer.CallbackParam, value: Any) -> Any:
    """A decoding flag's value (None: the run's), checked as it is parsed by the schema's rule
    for its key (``DecodingConfig``: the bounds are declared there, once); an error names the
    flag."""
    if value is not None and param.name is not None:
        decoding_options(DecodingConfig(), {param.name: value}, Naming({param.name: _flag(param)}))
    return value


def _range(key: str) -> str:
    """A decoding key's bounds for its flag's help, from the schema: Above 0, at most 1000."""
    words = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    bounds = [
        f"{words[name]} {getattr(rule, name):g}"
        for rule in DecodingConfig.model_fields[key].metadata
        for name in words
        if hasattr(rule, name)
    ]
    text = ", ".join(bounds)
    return f"{text[:1].upper()}{text[1:]}."


def _decoding_flag(key: str, *names: str, help: str) -> Any:
    """The flag of a decoding key: the key's bounds in its help, its value checked by the
    schema (the command's parameter is named ``key``)."""
    return typer.Option(*names, callback=_decoding_value, help=f"{help} {_range(key)}")


# The decoding flags, each declared once. A command's parameter for one is named after its
# DecodingConfig key, as `_request` reads it; None keeps the run's value.
BeamSize = Annotated[
    int | None,
    _decoding_flag(
        "beam_size", "--beam", "-b", help="Beam size (1: greedy); default from the run's config."
    ),
]
BatchSize = Annotated[
    int | None, _decoding_flag("batch_size", "--batch-size", help="Sentences (or pairs) per batch.")
]
MaxLenRatio = Annotated[
    float | None,
    _decoding_flag(
        "max_len_ratio",
        "--max-len-ratio",
        help="Max output length per source piece: an output is at most ratio x source "
        f"pieces + --max-len-offset, and never over {MAX_LENGTH:,} pieces.",
    ),
]
MaxLenOffset = Annotated[
    int | None,
    _decoding_flag("max_len_offset", "--max-len-offset", help="Added to the max output length."),
]
LengthPenalty = Annotated[
    float | None,
    _decoding_flag(
        "length_penalty", "--length-penalty", help="GNMT alpha of the normalised score."
    ),
]
CoveragePenalty = Annotated[
    float | None,
    _decoding_flag(
        "coverage_penalty",
        "--coverage-penalty",
        help="GNMT beta: coverage penalty weight (0: off).",
    ),
]
NoRepeatNgram = Annotated[
    int | None,
    _decoding_flag(
        "no_repeat_ngram", "--no-repeat-ngram", help="Forbid repeating n-grams of this size."
    ),
]
EnsembleAverageOption = Annotated[
    EnsembleAverage | None,
    typer.Option(
        "--ensemble-average",
        help="Several --model: average their probabilities (linear) or log-probabilities "
        "(log_linear).",
    ),
]

ShortlistOption = Annotated[
    ShortlistMode | None,
    typer.Option(
        "--shortlist",
        help="Decode each batch over the target pieces its source can bring (the lexical "
        "shortlist the run built from its training pairs): auto when the checkpoint has "
        "one and the device is a CPU, on, or off for the whole vocabulary.",
    ),
]

WorkersOption = Annotated[
    str | None,
    typer.Option(
        "--workers",
        parser=lambda value: int(value) if value.strip().isdigit() else value,
        callback=_decoding_value,
        help="Decode this many batches at once, each in a thread: on a CPU with its share of "
        "the threads, on a GPU on its own CUDA stream (auto: on a CPU 2 where there are 2 "
        "threads or more and batches of 16 sentences or more; on a GPU 1; never more than "
        "the batches).",
    ),
]


def _request(kind: type[Request], parameters: dict[str, Any], **given: Any) -> Request:
    """A command's request (a dataclass of nmt.commands) from the command's parameters (its
    ``locals()``): each field from the parameter of its name, ``decoding`` from the decoding
    flags (by their DecodingConfig keys; None keeps the run's value), ``naming`` (where the
    request has one) from the command's flags, for errors in the CLI's words, and ``given``
    for the fields the options only imply."""
    names = {field.name for field in dataclasses.fields(kind)}
    values = {name: value for name, value in parameters.items() if name in names}
    if "decoding" in names:
        keys = DecodingConfig.model_fields
        values["decoding"] = {key: parameters[key] for key in keys if key in parameters}
    if "naming" in names:
        flags = get_current_context().command.params
        values["naming"] = Naming({str(param.name): _flag(param) for param in flags})
    return kind(**{**values, **given})


# translate's own flags
TranslateInput = Annotated[
    str, typer.Option("--input", "-i", help="Input text, one sentence a line; - for stdin.")
]
NBest = Annotated[
    int,
    typer.Option(
        "--n-best", min=1, help="Write K hypotheses per line as TSV: line, rank, score, text."
    ),
]
Scores = Annotated[
    bool,
    typer.Option("--scores", help="Prefix each line with its length-normalised score and a tab."),
]
BatchTokens = Annotated[
    int | None,
    typer.Option("--batch-tokens", min=1, help="Also cap padded source tokens per batch."),
]
Prefix = Annotated[
    Path | None,
    typer.Option(
        "--prefix",
        help="Target prefixes, one per input line (empty: none): each output starts with "
        "its prefix.",
    ),
]
Constraints = Annotated[
    Path | None,
    typer.Option(
        "--constraints",
        help='JSONL, one list of target phrases per input line (["la casa", "verde"]; '
        "empty or []: none): each output contains every phrase.",
    ),
]
AttentionDir = Annotated[
    Path | None,
    typer.Option("--attention-dir", help="Write a heatmap PNG plus .npy/.json per sentence here."),
]
Alignments = Annotated[
    Path | None,
    typer.Option(
        "--alignments",
        help="Also write each output's word alignment (Pharaoh i-j, from the attention) "
        "to this file.",
    ),
]
Unbuffered = Annotated[
    bool,
    typer.Option(
        "--unbuffered",
        help="Translate each stdin line as it arrives and flush its output (the default "
        "when stdin is a terminal).",
    ),
]


@app.command()
def translate(
    model: ModelsOption,
    input: TranslateInput = "-",
    output: OutputOption = "-",
    beam_size: BeamSize = None,
    n_best: NBest = 1,
    scores: Scores = False,
    batch_size: BatchSize = None,
    batch_tokens: BatchTokens = None,
    max_len_ratio: MaxLenRatio = None,
    max_len_offset: MaxLenOffset = None,
    length_penalty: LengthPenalty = None,
    coverage_penalty: CoveragePenalty = None,
    no_repeat_ngram: NoRepeatNgram = None,
    ensemble_average: EnsembleAverageOption = None,
    shortlist: ShortlistOption = None,
    workers: WorkersOption = None,
    prefix: Prefix = None,
    constraints: Constraints = None,
    attention_dir: AttentionDir = None,
    alignments: Alignments = None,
    unbuffered: Unbuffered = False,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
    backend: BackendOption = "torch",
) -> None:
    """Translate text: exactly one output line per input line (empty in, empty out)."""
    from nmt.commands.common import Models
    from nmt.commands.translate import TranslateRequest, translate_command

    models = Models(model, device, precision, backend)
    translate_command(_request(TranslateRequest, locals(), models=models), _warn, _say)


def _warn(message: str) -> None:
    typer.echo(f"warning: {message}", err=True)


def _say(message: str) -> None:
    typer.echo(message, err=True)


@app.command()
def score(
    model: ModelsOption,
    input: SourceOption = None,
    target: TargetOption = None,
    tsv: TsvOption = None,
    n_best: Annotated[
        str | None,
        typer.Option(
            "--n-best",
            help="Rescore the TSV of nmt translate --n-best (sources from -i): each row gets a "
            "score column.",
        ),
    ] = None,
    output: OutputOption = "-",
    tokens: Annotated[
        bool,
        typer.Option(
            "--tokens", help="Add each target piece's log-probability and the pieces (EOS last)."
        ),
    ] = False,
    length_penalty: LengthPenalty = None,
    coverage_penalty: CoveragePenalty = None,
    ensemble_average: EnsembleAverageOption = None,
    batch_size: BatchSize = None,
    attention_dir: Annotated[
        Path | None,
        typer.Option("--attention-dir", help="Write the attention over each given target here."),
    ] = None,
    align_ref: Annotated[
        Path | None,
        typer.Option(
            "--align-ref",
            help="With --attention-dir: outline these reference word links on each heatmap "
            "(Pharaoh, i-j sure red, i?j possible orange; a line per pair).",
        ),
    ] = None,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
) -> None:
    """Score given translations: per line, log P(target | source) and the length-normalised
    score (as translate ranks), tab-separated."""
    from nmt.commands.common import Models
    from nmt.commands.score import ScoreRequest, score_command

    models = Models(model, device, precision)
    score_command(_request(ScoreRequest, locals(), models=models), _say)


@app.command()
def align(
    model: ModelsOption,
    input: SourceOption = None,
    target: TargetOption = None,
    tsv: TsvOption = None,
    output: OutputOption = "-",
    extract: Annotated[
        str,
        typer.Option(
            "--extract",
            help="argmax (each target word to its most attended source word), threshold, "
            "next (the attention of the following step, when the word has been read), "
            "intersect (the argmax links that are also the source word's best target word), "
            "or gdfa (grow-diag-final-and of the two directions' argmax links).",
        ),
    ] = "argmax",
    threshold: Annotated[
        float | None,
        typer.Option("--threshold", help="With --extract threshold: the least mass (default 0.5)."),
    ] = None,
    attention: Annotated[
        bool,
        typer.Option(
            "--attention",
            help="Align with the attention even when the model has an alignment head "
            "(model.alignment_head), which is read by default.",
        ),
    ] = False,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
) -> None:
    """Word alignments (Pharaoh: source-target word indices, 0-based) from the model's
    attention (or its alignment head) while it reads the given translations."""
    from nmt.commands.align import AlignRequest, Extraction, align_command
    from nmt.commands.common import Models

    extraction = Extraction(extract, threshold, attention)
    models = Models(model, device, precision)
    align_command(_request(AlignRequest, locals(), models=models, extraction=extraction), _say)


@app.command()
def average(
    checkpoints: Annotated[
        list[Path] | None,
        typer.Argument(help="Checkpoint files (or run directories: their best.pt) to average."),
    ] = None,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The averaged checkpoint to write.")
    ] = Path("averaged.pt"),
    run: Annotated[
        Path | None,
        typer.Option("--run", help="Average this run's newest step-N.pt files (with --last)."),
    ] = None,
    last: Annotated[
        int | None,
        typer.Option("--last", min=2, help="How many of the run's newest step-N.pt to average."),
    ] = None,
) -> None:
    """Average checkpoints of one model (weights' mean, in float64) into a normal checkpoint
    that translate, eval and score read."""
    from nmt.commands.average import AverageRequest, average_command

    given = list(checkpoints or [])
    used = average_command(_request(AverageRequest, locals(), checkpoints=given))
    typer.echo(f"{output}: the mean of {len(used)} checkpoints", err=True)


@app.command()
def export(
    run: Annotated[
        Path, typer.Argument(help="Run directory (uses best.pt) or checkpoint file to export.")
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Directory to write: new, empty, or an earlier export (which is replaced).",
        ),
    ],
    format: Annotated[
        Literal["onnx"],
        typer.Option(
            "--format",
            help="onnx: the encoder and one decoder step as ONNX graphs (opset 17; batch and "
            "source length dynamic) with the tokenizer and config, for nmt translate "
            "--backend onnxruntime.",
        ),
    ] = "onnx",
    quantize: Annotated[
        Literal["int8"] | None,
        typer.Option(
            "--quantize",
            help="int8: the graphs' weights as int8, activations quantized as they run "
            "(onnxruntime's dynamic quantization; GRUs stay fp32), for CPU decoding.",
        ),
    ] = None,
) -> None:
    """Export a trained model for inference without its checkpoint (docs/guide/export.md)."""
    from nmt.commands.export import ExportRequest, export_command

    metadata = export_command(_request(ExportRequest, locals()))
    graphs = "int8 ONNX graphs" if metadata.quantize == "int8" else "ONNX graphs"
    typer.echo(
        f"{output}: encoder and decoder step as {graphs} (opset {metadata.opset}), "
        f"with the tokenizer and config",
        err=True,
    )


@app.command()
def shortlist(
    run: Annotated[
        Path,
        typer.Argument(help="Run directory (each of its checkpoints) or checkpoint file."),
    ],
) -> None:
    """Build the lexical shortlist for a run trained without one, from its training data,
    and add it to its checkpoints (docs/guide/translating.md)."""
    from nmt.commands.shortlist import ShortlistRequest, shortlist_command

    result = shortlist_command(_request(ShortlistRequest, locals()))
    for path in result.added:
        typer.echo(f"{path}: shortlist added (built in {result.seconds:.1f}s)", err=True)
    for path in result.kept:
        typer.echo(f"{path}: has a shortlist already, kept", err=True)


# eval's own flags
Hypotheses = Annotated[
    list[Path] | None, typer.Argument(help="Hypothesis file(s), one system each.")
]
References = Annotated[
    list[Path] | None,
    typer.Option("--ref", "-r", help="Reference file (repeat for several)."),
]
SplitModels = Annotated[
    list[Path] | None,
    typer.Option(
        "--model",
        "-m",
        help="Translate a split of this run's data instead (repeat: an ensemble).",
    ),
]
Split = Annotated[
    str,
    typer.Option(
        "--split",
        help="With --model: dev, test, train or a data.eval_splits name (the demo: books).",
    ),
]
SaveHypotheses = Annotated[
    Path | None,
    typer.Option("--save-hypotheses", help="With --model: write the translations here."),
]
Significance = Annotated[
    str,
    typer.Option(
        "--significance",
        help="Paired test against the first system when there are 2+: bootstrap, ar "
        "(approximate randomisation) or none.",
    ),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
AlignFile = Annotated[
    Path | None,
    typer.Option("--align", help="Score this Pharaoh alignment file (with --align-ref) instead."),
]
AlignReference = Annotated[
    Path | None,
    typer.Option("--align-ref", help="Reference alignments: i-j sure links, i?j possible ones."),
]
AlignSource = Annotated[
    Path | None,
    typer.Option(
        "--align-src",
        help="With --align: the source text the links index (e.g. test.es.gz), for the "
        "content-word figures.",
    ),
]
AlignTarget = Annotated[
    Path | None,
    typer.Option("--align-trg", help="With --align: the target text (e.g. test.en.gz)."),
]


@app.command("eval")
def eval_(
    hypotheses: Hypotheses = None,
    ref: References = None,
    model: SplitModels = None,
    split: Split = "test",
    beam_size: BeamSize = None,
    save_hypotheses: SaveHypotheses = None,
    length_penalty: LengthPenalty = None,
    coverage_penalty: CoveragePenalty = None,
    ensemble_average: EnsembleAverageOption = None,
    shortlist: ShortlistOption = None,
    workers: WorkersOption = None,
    significance: Significance = "bootstrap",
    json_out: JsonOut = False,
    align: AlignFile = None,
    align_ref: AlignReference = None,
    align_src: AlignSource = None,
    align_trg: AlignTarget = None,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
) -> None:
    """Score with sacrebleu (BLEU, chrF, TER and their signatures).

    With --model, the decoding options (--beam, --length-penalty, ...) apply to its
    translation of the split."""
    from nmt.commands.evaluate import EvalRequest, evaluate_command
    from nmt.files import standard_output

    standard_output()  # where the report goes: a closed one is refused before any work
    models = None
    if model:  # scoring files alone needs no torch
        from nmt.commands.common import Models

        models = Models(model, device, precision)
    systems = {"hypotheses": list(hypotheses or []), "references": list(ref or [])}
    report = evaluate_command(_request(EvalRequest, locals(), models=models, **systems))
    typer.echo(report.to_json() if json_out else report.to_table())


# serve's own flags
ServedModelsOption = Annotated[
    list[Path],
    typer.Option(
        "--model",
        "-m",
        help="Run directory (uses best.pt) or checkpoint file to serve; repeat for more "
        "models, each a model of its own named by its run directory (the first: the default).",
    ),
]
Host = Annotated[
    str,
    typer.Option(
        "--host", help="Address to listen on (the default: this machine only; 0.0.0.0: every one)."
    ),
]
Port = Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: any free one).")]
MaxSentences = Annotated[
    int, typer.Option("--max-sentences", min=1, help="Most sentences (or pairs) per request.")
]
MaxChars = Annotated[
    int, typer.Option("--max-chars", min=1, help="Most characters of text per request.")
]
MaxBody = Annotated[int, typer.Option("--max-body", min=1, help="Most bytes of a request body.")]
MaxBeam = Annotated[int, typer.Option("--max-beam", min=1, help="Largest beam a request may ask.")]
BatchWindow = Annotated[
    float,
    typer.Option(
        "--batch-window-ms",
        min=0.0,
        max=60_000.0,
        help="After a request arrives, wait this long for more to decode with it (at most a "
        "minute).",
    ),
]
MaxBatch = Annotated[
    int, typer.Option("--max-batch", min=1, help="Most sentences decoded together.")
]
NoBatching = Annotated[
    bool,
    typer.Option("--no-batching", help="Decode each request alone, in arrival order."),
]


@app.command()
def serve(
    model: ServedModelsOption,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    max_sentences: MaxSentences = 64,
    max_chars: MaxChars = 20_000,
    max_body: MaxBody = 1_000_000,
    max_beam: MaxBeam = 32,
    batch_window_ms: BatchWindow = 5.0,
    max_batch: MaxBatch = 64,
    no_batching: NoBatching = False,
    device: DeviceOption = "auto",
    precision: PrecisionOption = "auto",
) -> None:
    """Serve models over HTTP: a JSON API (translate, score, align; /docs describes it) and
    a page at / to try them, until Ctrl-C. Needs FastAPI and uvicorn, the extra named serve."""
    from nmt.commands.common import Models
    from nmt.commands.serve.batching import Batching
    from nmt.commands.serve.command import ServeRequest, serve_command
    from nmt.commands.serve.limits import Limits

    models = [Models([path], device, precision) for path in model]
    limits, batching = _request(Limits, locals()), _request(Batching, locals())
    request = _request(ServeRequest, locals(), models=models)
    serve_command(request, ready=lambda message: typer.echo(message, err=True))


def command() -> None:
    """The `nmt` command (console script and ``python -m nmt``): ``main``, allowed to start
    itself again with other malloc settings before it trains on a CPU
    (``nmt.training.process.setup_process``)."""
    _state["may_restart"] = True
    main()


def main() -> None:
    """The command's body (the tests also run it in-process): an NMTError (or a failed file
    operation) is one stderr line and exit status 2; ``--debug`` re-raises it with its
    traceback.

    Usage errors (an unknown option, a value out of range) are one line too, with click's
    exit status 2; ``typer.Exit`` codes are honoured and Ctrl-C outside training exits 130.
    """
    limit_kernel_cache()
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `nmt` alone: the help, as asked for by no_args_is_help
        typer.echo(exc.ctx.get_help(), err=True)
        sys.exit(2)
    except ClickException as exc:
        if _state["debug"]:
            raise
        print(f"error: {_one_line_text(exc.format_message())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except (NMTError, OSError) as exc:
        if _state["debug"]:
            raise
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, NMTError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    return _one_line_text(str(exc))


def _one_line_text(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
