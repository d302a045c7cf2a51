"""The ``tokcap`` console script.

``main`` runs the Typer app in non-standalone mode, so every error a user can cause is printed by
``tokcap.cli.errors`` as one line with a non-zero exit status instead of a traceback.
The command needs the ``cli`` extra (Typer and Rich); the library does not, so without them the script says
which extra to install instead of failing on an import.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main", "run"]

_CLI_REQUIREMENTS = frozenset({"typer", "click", "rich"})
"""Top-level modules the command needs and the library does not: the ``cli`` extra and what it pulls in."""


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    try:
        from tokcap.cli.app import app
        from tokcap.cli.errors import run_reporting_failures
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _CLI_REQUIREMENTS:
            raise
        print(
            f"tokcap: error: the tokcap command needs {exc.name}, which is not installed: "
            "pip install 'tokcap[cli]' (or `pip install -e '.[cli]'` in a clone)",
            file=sys.stderr,
        )
        return 1
    args = list(sys.argv[1:] if argv is None else argv)
    return run_reporting_failures(lambda: app(args=args, prog_name="tokcap", standalone_mode=False))


def main() -> None:
    """The console-script entry point."""
    sys.exit(run())
