"""Files the commands read and write: atomic replacement, UTF-8 lines, output checks.

Every file nmt writes (checkpoints, the run's config and tokenizer, translations, plots,
corpus caches) goes through ``atomic_write_bytes`` (a device, a FIFO or an open file such as
/dev/stdout is written straight through); the text lines a command writes (translations,
scores, alignments) go through ``write_lines``, which gzips a file named ``.gz``. Every text
file a command reads line by line (hypotheses, references, input) goes through
``read_lines``. Every input is opened with ``open_input`` and read inside ``reading``, which
makes any error reading it (missing, not gzip, cut short) a DataError that names it, before
it can reach a writer and pass for a failed write of the file being written from it (a
corpus cache).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gzip
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from nmt.errors import ConfigError, DataError, NMTError, WriteError

STDIN = "-"


@functools.cache
def _umask() -> int:
    """The process umask (read once: setting it to read it is not thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, write: Callable[[Any], object]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync, then rename it over
    ``path`` (and fsync the folder, so that the rename survives a power cut).

    A reader sees the old file or the complete new one, never a part, even when the writer is
    killed midway; the temporary file is ``.NAME.XXXX.tmp``, which nothing takes for a
    checkpoint. The new file gets the usual permissions (0666 less the umask), not
    ``mkstemp``'s private 0600. A symlink is followed: its target is replaced, the link
    kept. What is no file to replace (a device such as /dev/null, a FIFO, a socket, an open
    file such as /dev/stdout or /dev/fd/N) is written straight through, never truncated. An
    operating-system error (a full disk, a quota, no permission), also one that ``write``
    wraps in its own (torch.save's RuntimeError), is a ``WriteError`` that names ``path``;
    the temporary file is removed and ``path`` is as it was. An NMTError that ``write``
    raises (a DataError about the input it reads) passes unchanged.
    """
    path = Path(path)
    try:
        target = replaced_file(path)
        if target is None:  # appended to: /dev/stdout may be a file the shell appends to
            with path.open("ab") as handle:
                write(handle)
        else:
            _replace(target, write)
    except BaseException as exc:
        cause = os_error(exc)
        if cause is None or isinstance(exc, NMTError):
            raise
        raise write_error(path, cause) from exc


def replaced_file(path: Path) -> Path | None:
    """The regular file that writing ``path`` replaces: ``path`` itself or, for a symlink,
    where its links lead (which need not exist yet); None where ``path`` is something else
    that exists (a device, a FIFO, a socket, a folder) or leads through /proc (/dev/stdout,
    /dev/fd/N: a file a process holds open, not a name to replace)."""
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's own limit on links followed
        current = Path(os.path.realpath(current.parent), current.name)
        if current.parts[1:2] == ("proc",):
            return None
        if not current.is_symlink():
            return current if current.is_file() or not current.exists() else None
        current = Path(os.path.abspath(current.parent / os.readlink(current)))
    return None  # a loop of links: opening it says so


def _replace(path: Path, write: Callable[[Any], object]) -> None:
    """``atomic_write_bytes`` of the regular file ``path`` (or a new one)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def os_error(exc: BaseException) -> OSError | None:
    """``exc`` itself if it is an OSError, else the first OSError in its chain of causes (a
    library's own error around a failed write), else None. A context that ``raise ... from
    None`` suppressed is not a cause."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        context = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or context
    return None


def write_error(path: Path, cause: OSError) -> WriteError:
    """One line for a file that could not be written: the file, the error and, for a full
    disk, how much room is left and what to do."""
    reason = cause.strerror or str(cause)
    message = f"{path}: cannot write it ({reason})"
    free = free_space(path.parent) if cause.errno in (errno.ENOSPC, errno.EDQUOT) else None
    if free is not None:
        message += f"; {free} free there: free some space and run it again"
    return WriteError(message, path, reason, free)


def free_space(directory: Path) -> str:
    """The free space of the filesystem that holds ``directory``, for messages."""
    for place in (Path(directory), *Path(directory).parents):
        try:
            free = shutil.disk_usage(place).free
        except OSError:
            continue
        return human_size(free)
    return "unknown space"


def human_size(size: float) -> str:
    """Bytes as KiB, MiB or GiB, for messages."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size / 2**10:,.1f} KiB"


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """A folder written whole or not at all: the block fills a temporary folder beside
    ``path`` (``.NAME.XXXX.tmp``), which then takes the place of ``path``, replacing a folder
    already there. If the block fails, the temporary folder is removed and ``path`` is as it
    was; an operating-system error is a ``WriteError`` that names ``path``."""
    path = Path(path)
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        _swap_in(tmp, path)
        tmp = None
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = os_error(exc)
        if cause is None or isinstance(exc, NMTError):
            raise
        raise write_error(path, cause) from exc


def _swap_in(new: Path, path: Path) -> None:
    """Rename the folder ``new`` to ``path``; a folder there first moves aside, and is
    deleted once ``new`` is in place (or moved back if it cannot be)."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.{os.getpid()}.old.tmp")
        path.rename(old)
    try:
        new.rename(path)
    except OSError:
        if old is not None:
            old.rename(path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically (see ``atomic_write_bytes``)."""
    atomic_write_bytes(path, lambda handle: handle.write(text.encode("utf-8")))


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the ``.NAME.XXXX.tmp`` files of writers killed midway; returns them."""
    stale = sorted(directory.glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def split_lines(data: bytes, name: str, first: int = 1) -> list[str]:
    """UTF-8 bytes -> lines without their endings (``first``: the number of the first line).

    Lines are split on ``\\n`` only; a trailing ``\\r`` (CRLF files) is removed and a final
    newline does not start an extra empty line. Invalid UTF-8 is a DataError naming
    ``name``, the line and the byte.
    """
    chunks = data.split(b"\n")
    if chunks[-1] == b"":
        chunks.pop()
    lines = []
    for number, chunk in enumerate(chunks, start=first):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{name}:{number}: not valid UTF-8 (byte {exc.start + 1} of the line); "
                "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from None
        lines.append(text.removesuffix("\r"))
    return lines


def read_lines(path: Path | str) -> list[str]:
    """A UTF-8 text file (``-``: standard input; ``.gz``: decompressed) as a list of lines
    (``split_lines``).

    Raises:
        DataError: The file is missing, unreadable, not gzip (``.gz``), compressed otherwise
            or not valid UTF-8.
    """
    if str(path) == STDIN:
        data = standard_input().buffer.read()
        refuse_compressed("<stdin>", data[:16])
        return split_lines(data, "<stdin>")
    path = Path(path)
    with reading(path), open_input(path) as handle:
        data = handle.read()
    refuse_compressed(path, data[:16], gzipped=path.suffix == ".gz")
    return split_lines(data, str(path))


def check_one_stdin(inputs: Mapping[str, str | Path | Sequence[Path] | None]) -> None:
    """At most one of a command's ``inputs`` (option -> what it reads: a path, the paths of a
    repeated option, or None) is standard input, which can be read only once: a second
    reader would find it empty."""
    readers = [
        option
        for option, given in inputs.items()
        for path in (given if isinstance(given, list | tuple) else [given])
        if path is not None and str(path) == STDIN
    ]
    if len(readers) > 1:
        raise ConfigError(
            f"only one input can be standard input (-): {', '.join(readers)} read it; give "
            f"files for all but one"
        )


def open_input(path: Path) -> BinaryIO:
    """An input file opened for reading bytes, decompressed if its name ends in ``.gz``;
    errors as ``reading``'s. Read it inside ``with reading(path)``."""
    with reading(path):
        return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")  # type: ignore[return-value]


@contextlib.contextmanager
def reading(path: Path | str) -> Iterator[None]:
    """An error while reading the input ``path`` (an OSError, a gzip stream cut short or
    damaged) becomes a DataError that names ``path`` and says what is wrong (``read_error``):
    never an error of some other file, such as the cache being written from it."""
    try:
        yield
    except NMTError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise read_error(path, exc) from None


def read_error(path: Path | str, exc: BaseException) -> DataError:
    """One line for an input that could not be read: the file, what is wrong, what to do."""
    if isinstance(exc, FileNotFoundError):
        what = "no such file"
    elif isinstance(exc, IsADirectoryError):
        what = "is a directory, expected a text file"
    elif isinstance(exc, gzip.BadGzipFile) and str(exc).startswith("Not a gzipped file"):
        what = (
            "not gzip-compressed, though its name ends in .gz; if it is plain text, remove "
            "the .gz from its name, else copy or download it again"
        )
    elif isinstance(exc, EOFError):
        what = (
            "cut short: its gzip data ends before the end-of-stream marker (an interrupted "
            "copy or download?); copy or download it again"
        )
    elif isinstance(exc, gzip.BadGzipFile | zlib.error):
        what = f"damaged gzip data ({exc}); copy or download it again, or re-create it"
    else:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        what = f"cannot read it ({reason})"
    return DataError(f"{path}: {what}")


# The headers of compressed files, which are no text: (start, what made it, what undoes it).
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "gunzip"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
    (b"BZh", "bzip2", "bunzip2"),
)


def refuse_compressed(path: Path | str, head: bytes, gzipped: bool = False) -> None:
    """A DataError if ``head`` (the first bytes of an input, decompressed for a ``.gz``)
    starts like a compressed file: nmt reads UTF-8 text, plain or gzip named ``.gz``."""
    for magic, kind, tool in _COMPRESSED:
        if not head.startswith(magic) or (kind == "bzip2" and head[4:10] != b"1AY&SY"):
            continue
        if kind == "gzip" and not gzipped:
            raise DataError(
                f"{path}: gzip-compressed, but its name does not end in .gz; add .gz to its "
                f"name (or {tool} it)"
            )
        inside = " inside its gzip" if gzipped else ""
        raise DataError(
            f"{path}: {kind}-compressed{inside}; nmt reads UTF-8 text, plain or gzip-compressed "
            f"(named .gz): decompress it first ({tool})"
        )


# What `nmt train` writes into a run directory, and what marks a folder as one.
RUN_FILES = ("config.yaml", "environment.json", "train.log", "metrics.jsonl", ".lock")
RUN_PATTERNS = ("*.pt", "spm*.model", "events.out.tfevents.*")


def run_directory_of(path: Path) -> Path | None:
    """The run directory ``path`` would be a run's own file of, or None."""
    folder = path.parent
    if folder.name == "tensorboard" and (folder.parent / "config.yaml").is_file():
        return folder.parent
    is_run = (folder / "config.yaml").is_file() and any(
        (folder / name).exists() for name in ("last.pt", "best.pt", ".lock", "environment.json")
    )
    ours = path.name in RUN_FILES or any(path.match(pattern) for pattern in RUN_PATTERNS)
    return folder if is_run and ours else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def check_output(
    path: Path, option: str, inputs: Mapping[str, Path | Sequence[Path]] | None = None
) -> None:
    """Fail before any work if ``path`` cannot be written as a file, or if writing it would
    overwrite what the command reads (``inputs``: option -> path, or the paths of a repeated
    option) or a file of a run directory (checkpoints, tokenizer, config, logs)."""
    for source_option, given in (inputs or {}).items():
        sources = [given] if isinstance(given, Path) else list(given)
        if any(_same_file(path, source) for source in sources):
            raise DataError(
                f"{option} {path}: is the {source_option} this command reads; writing it would "
                f"destroy it: choose another file"
            )
    if path.is_dir():
        raise DataError(f"{option} {path}: is a directory; give a file name")
    target = replaced_file(path)
    if target is None:  # a device, a FIFO, an open file: written straight through
        if not os.access(path, os.W_OK):
            reason = "permission denied" if path.exists() else "not open"  # /dev/fd/N, closed
            raise DataError(f"{option} {path}: cannot write it ({reason})")
        return
    run_dir = run_directory_of(target)
    if run_dir is not None:
        raise DataError(
            f"{option} {path}: is a file of the training run in {run_dir}; choose a file "
            f"outside it or another name"
        )
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise DataError(f"{option} {path}: the folder {parent} {what}; create it first")
    if not os.access(parent, os.W_OK):
        raise DataError(f"{option} {path}: cannot write in {parent} (permission denied)")


def write_lines(output: str | Path, lines: Sequence[str]) -> None:
    """A command's output lines: to stdout (the string ``-``, flushed) or atomically to a
    file, gzip-compressed if its name ends in ``.gz`` (with no timestamp: the same lines give
    the same bytes), which ``read_lines`` reads back."""
    text = "".join(line + "\n" for line in lines)
    if output == STDIN:
        stdout = standard_output()
        stdout.write(text)
        stdout.flush()
        return
    data = text.encode("utf-8")
    if Path(output).suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    atomic_write_bytes(Path(output), lambda handle: handle.write(data))


def standard_input() -> TextIO:
    """``sys.stdin``, where a command reads its text by default (``-``); a DataError where the
    command was started with it closed (``<&-``), which Python makes None."""
    if sys.stdin is None:
        raise DataError(
            "standard input is closed (<&-): nothing to read; pipe the text in, or give an "
            "input file (-i FILE)"
        )
    return sys.stdin


def standard_output() -> TextIO:
    """``sys.stdout``, where a command writes its lines by default; a WriteError where the
    command was started with it closed (``>&-``), which Python makes None."""
    if sys.stdout is None:
        raise WriteError(
            "standard output is closed (>&-): nowhere to write the output; run the command "
            "with it open, or give an output file (-o FILE) where the command takes one",
            STDIN,
            "closed",
        )
    return sys.stdout
