"""The one error family the library raises for user-facing problems.

The CLI turns any NMTError into a single line on stderr and exit status 2.
"""


class NMTError(Exception):
    """A problem the user can fix; the message says what and how."""


class ConfigError(NMTError):
    """A bad config file, key or value."""


class DataError(NMTError):
    """A missing, unreadable or malformed corpus or text file."""


class CheckpointError(NMTError):
    """A missing, truncated or incompatible checkpoint or run directory."""
