"""The errors a user can fix: each says, in one line, which field or file is wrong, the
value found, and what would fit. The `lathe` command prints them without a traceback and
exits 2; every other exception is a bug and keeps its traceback."""

from __future__ import annotations


class LatheError(ValueError):
    """Base of every user-fixable error (bad config, bad checkpoint, bad input file)."""


class ConfigError(LatheError):
    """A config, recipe or command-line value that cannot be used as given."""


class CheckpointError(LatheError):
    """A checkpoint folder that is missing, malformed, or does not match its config."""
