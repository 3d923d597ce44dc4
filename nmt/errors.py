"""The one error family the library raises for user-facing problems.

The CLI turns any NMTError into a single line on stderr and exit status 2; ``listed`` keeps
the lists in those lines short.
"""

from collections.abc import Iterable


class NMTError(Exception):
    """A problem the user can fix; the message says what and how."""


class ConfigError(NMTError):
    """A bad config file, key or value."""


class DataError(NMTError):
    """A missing, unreadable or malformed corpus or text file."""


class CheckpointError(NMTError):
    """A missing, truncated or incompatible checkpoint or run directory."""


class DependencyError(NMTError):
    """An optional package that a command needs is not installed (the message names the
    extra that brings it)."""


class WriteError(NMTError, OSError):
    """A file that could not be written: a full disk, a quota, no permission. Also an OSError,
    so that code which tolerates a failed write (a cache) still catches it. ``path``: the file;
    ``reason``: the operating system's words; ``free``: the space left where the disk (or
    quota) was full, else None; ``needed``: how much room the write needed, where known."""

    def __init__(
        self, message: str, path: object = None, reason: str = "", free: str | None = None
    ):
        super().__init__(message)
        self.path = path
        self.reason = reason
        self.free = free
        self.needed: str | None = None


def listed(items: Iterable[object], limit: int = 6) -> str:
    """Items for a message, cut after ``limit``: ``a, b, ... and 4 more``."""
    names = [str(item) for item in items]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])}, ... and {len(names) - limit} more"
