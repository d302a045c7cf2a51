"""Where a rollout's files live: the store directory's naming, in one place.

Per rollout, in one directory:

- ``<id>.tokens.jsonl``: one canonical JSON line per accepted entry (keys sorted).
- ``<id>.tokens.state.json``: the ``RolloutState`` in Gym's layout, the commit record of the other files;
  once retired it is the fence that refuses late writers, kept until ``delete``.
- ``<id>.tokens.intents``: one line per dispatched call, its call id; a cancel is the call id after a NUL.
- ``<id>.tokens.incomplete``: one line per marker, the lost call's id (reasons live in the state).
- ``<id>.tokens.staged``: one canonical JSON line per staged call (engine-side staging), keys sorted.
- ``<id>.tokens.ledger``: one line per ledger row or ledger failure, in the order they were recorded.
- ``<id>.tokens.blobs/``: the staged calls' extras and attachments, one file per SHA-256 of its bytes.
- ``<id>.tokens.lock``: the per-rollout ``flock`` target shared with Gym's store; never removed.

The format is Gym 0.7.0's, so either store opens the other's rollouts. ``<id>.tokens.fence`` belonged to
tokcap 0.1; finding one means an old directory, which is refused with the upgrade step.

Nothing outside this module spells a file name; transports and tools ask the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tokcap.errors import InvalidRolloutIdError
from tokcap.log.rollout_ids import validate_rollout_id

logger = logging.getLogger(__name__)

__all__ = [
    "BLOBS_SUFFIX",
    "ENTRIES_SUFFIX",
    "FENCE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "INTENTS_SUFFIX",
    "JOURNAL_CURSORS_NAME",
    "LEDGER_SUFFIX",
    "LOCK_SUFFIX",
    "RECORD_SUFFIXES",
    "STAGED_SUFFIX",
    "STATE_SUFFIX",
    "RolloutPaths",
    "logger",
    "rollout_ids_in",
]

ENTRIES_SUFFIX = ".tokens.jsonl"
STATE_SUFFIX = ".tokens.state.json"
INTENTS_SUFFIX = ".tokens.intents"
INCOMPLETE_SUFFIX = ".tokens.incomplete"
LOCK_SUFFIX = ".tokens.lock"
FENCE_SUFFIX = ".tokens.fence"
STAGED_SUFFIX = ".tokens.staged"
LEDGER_SUFFIX = ".tokens.ledger"
BLOBS_SUFFIX = ".tokens.blobs"

JOURNAL_CURSORS_NAME = "tokcap-journal-cursors.jsonl"
"""The store directory's list of journal cursors taken (``tokcap.staging.journal``); no rollout file."""

RECORD_SUFFIXES = (ENTRIES_SUFFIX, INTENTS_SUFFIX, INCOMPLETE_SUFFIX, STAGED_SUFFIX, LEDGER_SUFFIX)
"""The files a retire removes: everything the rollout recorded, not its state, fence or lock."""

_LISTED_SUFFIXES = (
    ENTRIES_SUFFIX,
    STATE_SUFFIX,
    INTENTS_SUFFIX,
    INCOMPLETE_SUFFIX,
    FENCE_SUFFIX,
    STAGED_SUFFIX,
    LEDGER_SUFFIX,
)
"""A stray tokcap 0.1 fence is listed too, so the rollout's first read reports the old format."""


@dataclass(frozen=True)
class RolloutPaths:
    """Every file of one rollout; built once per rollout id, after the id was validated."""

    rollout_id: str
    entries: Path
    state: Path
    intents: Path
    incomplete: Path
    lock: Path
    fence: Path
    staged: Path
    ledger: Path
    blobs: Path

    @classmethod
    def of(cls, root: Path, rollout_id: str) -> RolloutPaths:
        """The files of ``rollout_id`` under ``root``; an unsafe id is refused before any path is built."""
        stem = str(root / validate_rollout_id(rollout_id))
        return cls(
            rollout_id=rollout_id,
            entries=Path(stem + ENTRIES_SUFFIX),
            state=Path(stem + STATE_SUFFIX),
            intents=Path(stem + INTENTS_SUFFIX),
            incomplete=Path(stem + INCOMPLETE_SUFFIX),
            lock=Path(stem + LOCK_SUFFIX),
            fence=Path(stem + FENCE_SUFFIX),
            staged=Path(stem + STAGED_SUFFIX),
            ledger=Path(stem + LEDGER_SUFFIX),
            blobs=Path(stem + BLOBS_SUFFIX),
        )

    @property
    def records(self) -> tuple[Path, ...]:
        """The files a retire removes (the blob directory goes before them)."""
        return (self.entries, self.intents, self.incomplete, self.staged, self.ledger)

    def blob(self, sha256: str) -> Path:
        """The file holding the staged bytes with this SHA-256."""
        return self.blobs / sha256


def rollout_ids_in(root: Path) -> list[str]:
    """Every rollout id that has a state, entries, intents, marker or fence in ``root``, sorted.

    A file whose name is no valid rollout id (``a b.tokens.jsonl``, say) is not tokcap's: it is skipped with a
    warning, so one foreign file never fails a listing of the whole directory.
    """
    ids: set[str] = set()
    for path in root.iterdir():
        name = path.name
        for suffix in _LISTED_SUFFIXES:
            if name.endswith(suffix):
                candidate = name[: -len(suffix)]
                try:
                    ids.add(validate_rollout_id(candidate))
                except InvalidRolloutIdError as exc:
                    logger.warning("skipping %s: not a tokcap rollout file (%s)", path, exc)
                break
    return sorted(ids)
