"""The ``tokcap`` console script.

``main`` runs the Typer app in non-standalone mode, so every error a user can cause is printed by
``tokcap.cli.errors`` as one line with a non-zero exit status instead of a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main", "run"]


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    from tokcap.cli.app import app
    from tokcap.cli.errors import run_reporting_failures

    args = list(sys.argv[1:] if argv is None else argv)
    return run_reporting_failures(lambda: app(args=args, prog_name="tokcap", standalone_mode=False))


def main() -> None:
    """The console-script entry point."""
    sys.exit(run())
