"""The body of `nmt translate`: lines in, exactly one output line (or n-best block) per line,
and the attention of each translation on request."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from nmt import checkpoint
from nmt.commands.progress import progress_bar
from nmt.decoding.translator import Translation, Translator
from nmt.errors import ConfigError, DataError
from nmt.files import STDIN, atomic_write_text, check_output, read_lines
from nmt.plots import save_attention


def _format(
    translator: Translator, index: int, item: Translation, n_best: int, scores: bool
) -> list[str]:
    if n_best > 1:
        rows = [
            f"{index}\t{rank}\t{hyp.score:.4f}\t{translator.detokenize(hyp)}"
            for rank, hyp in enumerate(item.hypotheses, start=1)
        ]
        return rows or [f"{index}\t1\t0.0000\t"]
    text = translator.detokenize(item.hypotheses[0]) if item.hypotheses else ""
    if scores:
        score = item.hypotheses[0].score if item.hypotheses else 0.0
        return [f"{score:.4f}\t{text}"]
    return [text]


def _write_attention(
    translator: Translator, directory: Path, index: int, item: Translation
) -> None:
    if not item.hypotheses:
        return
    best = item.hypotheses[0]
    if best.alphas is None:
        return
    tokenizer = translator.tokenizer
    src = tokenizer.src_pieces(item.src_ids)
    trg = [*tokenizer.trg_pieces(best.tokens), "</s>"]
    save_attention(directory / f"{index:06d}", src, trg, best.alphas.float().numpy())


def translate_command(
    model: Path,
    input_path: str,
    output_path: str,
    decoding_overrides: dict[str, Any],
    n_best: int = 1,
    scores: bool = False,
    batch_tokens: int | None = None,
    device: str = "auto",
    attention_dir: Path | None = None,
    show_progress: bool = True,
    precision: str = "auto",
) -> int:
    """`nmt translate`: read lines, write exactly one output line (or n-best block) per line.

    Every user error (input, output path, checkpoint, options) is raised before the output is
    touched; a file output is replaced atomically, so a failed run leaves an existing file as
    it was.
    """
    if output_path != STDIN:
        inputs = {"--model": checkpoint.resolve(model)}
        if input_path != STDIN:
            inputs["--input"] = Path(input_path)
        check_output(Path(output_path), "--output", inputs)
    if attention_dir is not None and attention_dir.exists() and not attention_dir.is_dir():
        raise DataError(f"--attention-dir {attention_dir}: is a file; give a directory")
    lines = read_lines(input_path)
    translator = Translator.from_checkpoint(model, device, precision)
    decoding = translator.config.decoding.model_copy(
        update={k: v for k, v in decoding_overrides.items() if v is not None}
    )
    if n_best > decoding.beam_size:
        beam = f"--beam {decoding.beam_size}" + (
            "" if decoding_overrides.get("beam_size") else " (the run's decoding.beam_size)"
        )
        raise ConfigError(
            f"--n-best {n_best} is larger than {beam}; a beam keeps at most that many "
            f"hypotheses: raise --beam or lower --n-best"
        )
    with progress_bar(len(lines), show_progress and input_path != STDIN) as advance:
        results = translator.translate(
            lines, decoding, n_best, attention_dir is not None, batch_tokens, advance
        )
    out_lines = []
    for index, item in enumerate(results):
        out_lines.extend(_format(translator, index, item, n_best, scores))
        if attention_dir is not None:
            _write_attention(translator, attention_dir, index, item)
    text = "".join(line + "\n" for line in out_lines)
    if output_path == STDIN:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        atomic_write_text(Path(output_path), text)
    return len(lines)
