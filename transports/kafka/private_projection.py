"""Where a Kafka reader keeps its projection when it is given no ``store_dir``: a directory of its own.

Gym's config block is one block every model server process reads, so it cannot name a directory of each
process's own. A ledger or source built without ``store_dir`` takes one from ``tokcap.files.private_dirs`` (shared
by the readers of one kind of the same topic in this process, removed when the last of them closes, and
removed by the next start when a killed process left it), so the user writes no per-process setting.

A ledger's projection is ledger-only: it passes over staged calls unread (``LEDGER_SKIPPED_TYPES``), so it
holds ledger rows, failures and the rollouts' fences and commands, and no staged token or attachment. A
source's projection is whole, as with a ``store_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokcap.files.private_dirs import private_directories
from tokcap.log.events import EventType

__all__ = ["LEDGER_ONLY", "LEDGER_SKIPPED_TYPES", "PROJECTION", "PrivateProjection"]

LEDGER_SKIPPED_TYPES = frozenset({EventType.STAGE.value})
"""What a ledger-only projection passes over: nothing a ledger answers depends on a staged call's bytes."""

PROJECTION = "projection"
"""The kind of a whole projection (sources)."""

LEDGER_ONLY = "ledger"
"""The kind of a ledger-only projection (ledgers)."""


@dataclass
class PrivateProjection:
    """The directory a reader projects the topic into, and what that projection skips."""

    store_dir: Path
    skipped_types: frozenset[str]
    private: bool
    released: bool = False

    @classmethod
    def take(
        cls, store_dir: str | Path | None, kind: str, bootstrap_servers: str, topic: str
    ) -> PrivateProjection:
        """The given directory (a whole projection), or this process's private one of ``kind`` for the topic."""
        if store_dir is not None:
            return cls(Path(store_dir), frozenset(), private=False)
        skipped = LEDGER_SKIPPED_TYPES if kind == LEDGER_ONLY else frozenset()
        path = private_directories.acquire(f"{kind}-{topic}", (kind, bootstrap_servers, topic))
        return cls(path, skipped, private=True)

    def release(self) -> None:
        """Hand a private directory back (the last reader removes it); calling it again is a no-op."""
        if self.private and not self.released:
            self.released = True
            private_directories.release(self.store_dir)
