"""Command-line options that core commands and mounted transport commands share, spelled once."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["JsonFlag", "Timeout"]

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
"""``--json``: scripts read one document on stdout; people get tables."""

Timeout = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the broker before giving up.", min=0.1)
]
"""``--timeout``: how long a command waits for a broker before it fails."""
