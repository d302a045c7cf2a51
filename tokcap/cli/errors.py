"""Every failure a user can cause becomes one line on stderr and a non-zero exit status.

A traceback helps whoever wrote the code, not whoever typed the command.
Usage mistakes exit with 2, failures of the work itself with 1, an interrupt with 130.
Set ``TOKCAP_DEBUG=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TextIO

import typer
from pydantic import ValidationError

from tokcap.errors import TokcapError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "one_line",
    "report_failure",
    "run_reporting_failures",
]

EXIT_FAILURE = 1
"""The command ran and failed: a missing directory, an unreachable broker, a refused write."""

EXIT_USAGE = 2
"""The command line itself was wrong: an unknown option, a missing argument."""

EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C, as shells report it."""

_DEBUG_ENV = "TOKCAP_DEBUG"


def one_line(message: str) -> str:
    """Collapse a message onto one line, so a script can read the error with ``head -1``."""
    return " ".join(message.split()) or "unknown error"


def _describe(exc: BaseException) -> tuple[str, int]:
    """The line to print for an exception and the exit status it deserves."""
    if isinstance(exc, typer.TyperException):
        code = getattr(exc, "exit_code", EXIT_USAGE)
        return exc.format_message(), code if isinstance(code, int) else EXIT_USAGE
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("confluent_kafka"):
        return (
            "this command needs the Kafka client, which is not installed: pip install 'tokcap[kafka]' "
            "(or `pip install -e '.[kafka]'` in a clone)",
            EXIT_FAILURE,
        )
    if isinstance(exc, TokcapError):
        return str(exc), EXIT_FAILURE
    if isinstance(exc, ValidationError):
        return f"invalid value: {exc.errors()[0].get('msg', exc)}", EXIT_FAILURE
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or exc}: no such file or directory", EXIT_FAILURE
    if isinstance(exc, PermissionError):
        return f"{exc.filename or exc}: permission denied", EXIT_FAILURE
    if isinstance(exc, NotADirectoryError):
        return f"{exc.filename or exc}: not a directory", EXIT_FAILURE
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", EXIT_FAILURE
    return (
        f"unexpected {type(exc).__name__}: {exc} (set {_DEBUG_ENV}=1 for the traceback and report it)",
        EXIT_FAILURE,
    )


def report_failure(exc: BaseException, stream: TextIO | None = None) -> int:
    """Print one ``tokcap: error: ...`` line for ``exc`` and return the exit status to use."""
    message, code = _describe(exc)
    out = stream if stream is not None else sys.stderr
    if os.environ.get(_DEBUG_ENV) == "1":
        traceback.print_exception(exc, file=out)
    print(f"tokcap: error: {one_line(message)}", file=out)
    return code


def run_reporting_failures(command: Callable[[], object]) -> int:
    """Run a Typer/Click entry point without its own error printing and return the exit status.

    ``command`` must run in non-standalone mode, so usage errors reach this function instead of being
    drawn as a multi-line panel.
    """
    try:
        result = command()
    except KeyboardInterrupt:
        print("tokcap: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except typer.Abort:
        print("tokcap: aborted", file=sys.stderr)
        return EXIT_FAILURE
    except typer.Exit as exc:
        return exc.exit_code
    except Exception as exc:
        return report_failure(exc)
    return result if isinstance(result, int) else 0
