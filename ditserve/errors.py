"""The command line's own error: a flag value it refuses (exit code 2, nothing written)."""

from __future__ import annotations


class UsageError(Exception):
    """A command-line value is invalid (exit code 2)."""
