"""Ordinary mistakes on the command line: one line on stderr and exit status 2, never a traceback.

Subcommands raise :class:`UsageError` for what they check themselves; :func:`switchyard.cli.main.main`
turns it, and a missing file or folder named by a flag, into that one line.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A flag, a file or a combination the command cannot use; the message says which and why."""


def existing_file(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise UsageError(f"{what} {str(p)!r} is not a file")
    return p


def existing_folder(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{what} {str(p)!r} does not exist")
    if not p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is not a folder")
    return p


def writable_file(path: str | os.PathLike[str], what: str) -> Path:
    """A file the command may create or overwrite: its folder exists and is writable."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {str(p)!r} is a folder, not a file")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{what} {str(p)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{what} {str(p)!r} is not writable")
    return p


def writable_folder(path: str | os.PathLike[str], what: str) -> Path:
    """A folder the command creates if missing: it, or its nearest existing parent, is writable."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {str(p)!r} exists and is not a folder")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"{what} {str(p)!r} cannot be written ({str(existing)!r} is not a writable folder)")
    return p


def positive(value: int, flag: str) -> int:
    if value < 1:
        raise UsageError(f"{flag} must be at least 1, got {value}")
    return value


def not_negative(value: int, flag: str) -> int:
    """A count where 0 has a meaning of its own (all, or the server's default)."""
    if value < 0:
        raise UsageError(f"{flag} must be 0 or more, got {value}")
    return value


def positive_seconds(value: float, flag: str) -> float:
    if not value > 0:  # also NaN
        raise UsageError(f"{flag} must be a positive number of seconds, got {value}")
    return value
