"""Local corpus files (plain text, TSV, JSONL) -> Arrow tables that ``datasets`` memory-maps.

nmt reads its own files instead of going through the ``datasets`` text and json builders,
which cannot give three things a corpus reader needs:

- lines end at ``\\n`` only. A stray ``\\r`` or U+2028 inside a sentence stays in it (the
  tokenizer reads it as a space); splitting there would shift every later line of one side
  and silently misalign the pairs. A line's trailing ``\\r`` (CRLF files) and a leading
  byte-order mark are removed.
- every problem names its file and line (invalid UTF-8, a TSV line without exactly one tab,
  a JSONL line that is not an object with the two string fields), and an empty file is an
  empty table, not a schema error.
- with ``data.utf8_errors: replace``, invalid bytes become U+FFFD and the lines affected are
  counted in a warning instead of stopping.

Each file version is parsed once into the run's cache as an Arrow stream (temporary file, then
rename) that ``datasets.Dataset.from_file`` memory-maps, so corpora larger than memory work.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from nmt.errors import DataError
from nmt.files import atomic_write_bytes, open_input, reading, refuse_compressed

log = logging.getLogger("nmt")

Kind = Literal["text", "tsv", "jsonl"]
Progress = Callable[[int], None] | None

BLOCK_BYTES = 1 << 22  # bytes read at a time (then completed to the end of a line)
READER_VERSION = 1  # part of the cache key: bump when parsing changes
_FIX_UTF8 = "re-encode the file as UTF-8 or set data.utf8_errors: replace"


@dataclass
class Counts:
    """What reading a file found: lines, and lines with invalid UTF-8 (replaced)."""

    lines: int = 0
    bad_utf8: int = 0
    first_bad: int = 0

    def bad(self, line: int) -> None:
        self.bad_utf8 += 1
        self.first_bad = self.first_bad or line


def quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def string_features(names: list[str]) -> Any:
    """``datasets.Features`` of string columns (an empty table needs them spelled out)."""
    datasets = quiet_datasets()
    return datasets.Features({name: datasets.Value("string") for name in names})


def existing(path: Path, key: str) -> Path:
    """``path`` or ``path.gz``, whichever is a file; else a DataError naming the config key."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    if path.is_dir():
        raise DataError(f"{key}: {path} is a directory, expected a file; fix {key} in the config")
    raise DataError(f"{key}: {path}: no such file (nor {path.name}.gz); fix {key} in the config")


def _blocks(path: Path, progress: Progress = None) -> Iterator[bytes]:
    """The file's bytes in blocks of whole lines (each ends in ``\\n`` but perhaps the last);
    ``progress(n)`` hears of each ``n`` bytes of the file read (compressed, for a .gz). An
    error reading it is a DataError naming it (``nmt.files.reading``), also when the blocks
    are parsed into a cache file: it never passes for a failed write of the cache."""
    with open_input(path) as handle:
        raw = getattr(handle, "fileobj", handle)  # a GzipFile's compressed file
        rest, done = b"", 0
        with reading(path):
            block = handle.read(BLOCK_BYTES)
        refuse_compressed(path, block[:16], gzipped=path.suffix == ".gz")
        while True:
            if progress is not None:
                with reading(path):
                    position = raw.tell()
                progress(position - done)
                done = position
            if not block:
                break
            block = rest + block
            cut = block.rfind(b"\n") + 1
            rest, block = block[cut:], block[:cut]
            if block:
                yield block
            with reading(path):
                block = handle.read(BLOCK_BYTES)
        if rest:
            yield rest


def _decode(block: bytes, first: int, path: Path, errors: str, counts: Counts) -> list[str]:
    """Lines of one block, without ``\\n`` or trailing ``\\r``; ``first`` is its first line."""
    try:
        lines = block.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = []
        for number, raw in enumerate(block.split(b"\n"), start=first):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                if errors == "strict":
                    raise DataError(
                        f"{path}:{number}: not valid UTF-8 (byte {exc.start + 1} of the line); "
                        f"{_FIX_UTF8}"
                    ) from None
                counts.bad(number)
                lines.append(raw.decode("utf-8", errors="replace"))
    if block.endswith(b"\n"):
        lines.pop()  # the empty string after the last newline
    if first == 1 and lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return [line.rstrip("\r") for line in lines]


def _parse_tsv(lines: list[str], first: int, path: Path) -> dict[str, list[str]]:
    src, trg = [], []
    for number, line in enumerate(lines, start=first):
        fields = line.split("\t")
        if len(fields) != 2 and line.strip():
            raise DataError(
                f"{path}:{number}: expected 2 tab-separated fields (source, target), found "
                f"{len(fields)}; fix or remove the line"
            )
        src.append(fields[0])
        trg.append(fields[1] if len(fields) == 2 else "")
    return {"src": src, "trg": trg}


def _text_field(value: Any, name: str, where: str, errors: str, counts: Counts, line: int) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {name!r} is {type(value).__name__}, expected a string; fix the line"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
        if errors == "strict":
            raise DataError(
                f"{where}: field {name!r} holds an unpaired surrogate escape, not text; "
                f"fix the line or set data.utf8_errors: replace"
            ) from None
        counts.bad(line)
        value = value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return value


def _pair_of(record: Any, fields: tuple[str, str], where: str) -> tuple[Any, Any]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    src_field, trg_field = fields
    nested = record.get("translation")
    for holder in (record, nested):
        if isinstance(holder, dict) and src_field in holder and trg_field in holder:
            return holder[src_field], holder[trg_field]
    found = ", ".join(map(str, record)) or "nothing"
    if isinstance(nested, dict):
        found += f"; translation: {', '.join(map(str, nested)) or 'nothing'}"
    raise DataError(
        f"{where}: no fields {src_field!r} and {trg_field!r} (found {found}); "
        f"set data.src_field and data.trg_field"
    )


def _parse_jsonl(
    lines: list[str],
    first: int,
    path: Path,
    fields: tuple[str, str],
    errors: str,
    counts: Counts,
) -> dict[str, list[str]]:
    src, trg = [], []
    for number, line in enumerate(lines, start=first):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            detail = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise DataError(f"{where}: not valid JSON ({detail}); fix the line") from None
        source, target = _pair_of(record, fields, where)
        src.append(_text_field(source, fields[0], where, errors, counts, number))
        trg.append(_text_field(target, fields[1], where, errors, counts, number))
    return {"src": src, "trg": trg}


def _columns(kind: Kind) -> list[str]:
    return ["text"] if kind == "text" else ["src", "trg"]


def _rows(
    path: Path,
    kind: Kind,
    fields: tuple[str, str],
    errors: str,
    counts: Counts,
    progress: Progress = None,
) -> Iterator[dict[str, list[str]]]:
    """Column blocks of the parsed file; ``counts`` fills in as the blocks go by."""
    for block in _blocks(path, progress):
        first = counts.lines + 1
        lines = _decode(block, first, path, errors, counts)
        counts.lines += len(lines)
        if kind == "text":
            yield {"text": lines}
        elif kind == "tsv":
            yield _parse_tsv(lines, first, path)
        else:
            yield _parse_jsonl(lines, first, path, fields, errors, counts)


def _cache_name(path: Path, kind: Kind, fields: tuple[str, str], errors: str) -> str:
    stat = path.stat()
    version = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    key = (READER_VERSION, version, kind, fields, errors)
    return f"{path.name}.{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}"


def _write_arrow(
    target: Path, path: Path, kind: Kind, fields: tuple[str, str], errors: str, progress: Progress
) -> Counts:
    """Parse ``path`` into an Arrow stream at ``target`` (atomically); returns the counts."""
    import pyarrow as pa

    counts = Counts()
    schema = pa.schema([(name, pa.string()) for name in _columns(kind)])

    def write(handle: BinaryIO) -> None:
        with pa.ipc.new_stream(handle, schema) as writer:
            for block in _rows(path, kind, fields, errors, counts, progress):
                arrays = [pa.array(block[name], pa.string()) for name in schema.names]
                writer.write_batch(pa.record_batch(arrays, schema=schema))

    atomic_write_bytes(target, write)
    return counts


def read_file(
    path: Path,
    kind: Kind,
    fields: tuple[str, str] = ("", ""),
    utf8_errors: str = "strict",
    cache_dir: Path | None = None,
    progress: Progress = None,
) -> Any:
    """A ``datasets.Dataset``: column ``text`` (kind text) or ``src`` and ``trg`` (tsv, jsonl).

    With a ``cache_dir`` the table is an Arrow file there, memory-mapped, reused while the
    file is unchanged; without, it is held in memory. ``progress(n)`` hears of the bytes
    parsed.

    Raises:
        DataError: unreadable file, invalid UTF-8 (with ``utf8_errors`` strict), a malformed
            TSV or JSONL line; the message names the file and line.
    """
    datasets = quiet_datasets()
    if cache_dir is None:
        counts = Counts()
        columns: dict[str, list[str]] = {name: [] for name in _columns(kind)}
        for block in _rows(path, kind, fields, utf8_errors, counts, progress):
            for name, values in block.items():
                columns[name].extend(values)
        rows = datasets.Dataset.from_dict(columns, features=string_features(list(columns)))
    else:
        name = _cache_name(path, kind, fields, utf8_errors)
        target = cache_dir / "files" / f"{name}.arrow"
        report = target.with_suffix(".json")
        if target.is_file() and report.is_file():
            counts = Counts(**json.loads(report.read_text(encoding="utf-8")))
        else:
            counts = _write_arrow(target, path, kind, fields, utf8_errors, progress)
            summary = json.dumps(asdict(counts)).encode()
            atomic_write_bytes(report, lambda handle: handle.write(summary))
        rows = datasets.Dataset.from_file(str(target))
    if counts.bad_utf8:
        log.warning(
            "%s: %d %s with invalid UTF-8 (the first is line %d); the bad bytes were replaced "
            "by U+FFFD (data.utf8_errors: replace)",
            path,
            counts.bad_utf8,
            "line" if counts.bad_utf8 == 1 else "lines",
            counts.first_bad,
        )
    return rows
