"""What a transport's command-line package hands the core commands when ``tokcap.cli.app`` mounts it.

The core commands import no transport. A transport registers its own commands on the app (Kafka:
``materialize``, ``replay``, ``log``, ``topic``) and returns this object, through which the two core
commands with a transport part reach it: ``demo --bootstrap`` runs the workload over the transport,
``inspect`` shows the files the transport's readers keep in a store directory, and ``staging status
--bootstrap`` reads the staging journal of a run topic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tokcap.cli.demo import DemoReport, DemoSettings, ProgressCallback

__all__ = ["MountedTransport"]


class MountedTransport(Protocol):
    """A transport's part of the core commands."""

    @property
    def logger_name(self) -> str:
        """The root of the transport's loggers; quiet unless ``--verbose``, like ``tokcap``'s own."""
        ...

    def run_demo(
        self,
        settings: DemoSettings,
        bootstrap: str,
        run_id: str,
        *,
        servers: int,
        partitions: int,
        directory: Path | None,
        keep: bool,
        on_progress: ProgressCallback | None,
        broker_timeout_s: float,
    ) -> DemoReport:
        """The demo workload with ``servers`` sinks and a source over a fresh run ``run_id`` at ``bootstrap``."""
        ...

    def describe_side_files(self, directory: Path) -> dict[str, Any]:
        """The transport's files in a store directory, under the keys ``inspect --json`` prints them."""
        ...

    def render_side_files(self, description: Mapping[str, Any], console: Console) -> None:
        """Print what ``describe_side_files`` found, under the table of rollouts."""
        ...

    def staging_status(
        self,
        bootstrap: str,
        *,
        run_id: str | None,
        topic: str | None,
        client_options: Sequence[str],
        timeout_s: float,
        cursors: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """``tokcap staging status --bootstrap``: the staging status of a run topic, as the file store's."""
        ...
