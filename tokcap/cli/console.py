"""Where command output goes: rich tables for people on stdout, JSON for scripts, progress on stderr."""

from __future__ import annotations

import sys
from typing import Any

import orjson
from rich.console import Console

__all__ = ["NON_TERMINAL_WIDTH", "emit_json", "progress_console", "stdout_console"]


NON_TERMINAL_WIDTH = 200
"""Tables written to a file or a pipe get this many columns instead of wrapping at 80."""


def stdout_console() -> Console:
    """The console for a command's result; highlighting is off so numbers keep one colour."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = NON_TERMINAL_WIDTH
    return console


def progress_console() -> Console:
    """Progress bars draw on stderr, so piping stdout into a file or ``jq`` keeps it clean."""
    return Console(stderr=True, highlight=False)


def emit_json(data: Any) -> None:
    """Print one JSON document with sorted keys on stdout, for ``--json``."""
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode() + "\n")
    sys.stdout.flush()
