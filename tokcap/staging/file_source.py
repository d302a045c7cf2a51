"""``FileStagingSource``: Gym's ``StagingSource`` over tokcap's file store.

A fetch reads, under each rollout's lock, only the lines of the keys asked for (the state says where
each one is), so a staged row is fetchable by any process as soon as its ``stage`` returned ok, and a
fetch never parses extras or attachments it does not return. Blobs are checked against the SHA-256 and
size their row recorded, so a damaged blob is reported, never returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from tokcap.errors import StagingKeyNotFoundError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.rollout_ids import validate_rollout_id
from tokcap.metrics import source_timed
from tokcap.staging.gym_types import build
from tokcap.staging.journal import read_blob

__all__ = ["FileStagingSource"]


def _rollout_of(key: str) -> str:
    rollout_id, slash, call_id = key.partition("/") if isinstance(key, str) else ("", "", "")
    if not slash or not call_id:
        raise StagingKeyNotFoundError(
            f"staging key {key!r} is not '<rollout_id>/<model_call_id>'; no staged call has that key"
        )
    return validate_rollout_id(rollout_id)


class FileStagingSource:
    """Fetch staged calls by key from a tokcap store directory, in any process."""

    def __init__(self, root: str | Path) -> None:
        self._store = TokenCaptureStore(root)

    def __repr__(self) -> str:
        return f"FileStagingSource(root={str(self._store.root)!r})"

    def _stored(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        """The stored line of each key, parsed, in the order asked; a missing key raises."""
        keys = list(keys)
        by_rollout: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            by_rollout.setdefault(_rollout_of(key), []).append(index)
        found: list[dict[str, Any] | None] = [None] * len(keys)
        for rollout_id, indexes in by_rollout.items():
            lines = self._store.read_staged_lines(rollout_id, [keys[i] for i in indexes])
            for index, line in zip(indexes, lines, strict=True):
                if line is None:
                    raise StagingKeyNotFoundError(
                        f"staging key {keys[index]!r} names no staged call: it was never staged ok, or its "
                        "rollout was retired",
                        rollout_id=rollout_id,
                    )
                found[index] = orjson.loads(line)
        return [item for item in found if item is not None]

    @source_timed("file", "fetch")
    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One ``StagedCallBaseSnapshot`` per key, in order, without extras (Gym's class when Gym imports)."""
        return [build("StagedCallBaseSnapshot", stored["row"]) for stored in self._stored(staging_keys)]

    def fetch_full(self, staging_keys: list[str]) -> list[Any]:
        """One ``StagedCallSnapshot`` per key, in order, with its extras exactly as staged."""
        snapshots = []
        for stored in self._stored(staging_keys):
            rollout_id = stored["row"]["rollout_id"]
            extras_ref = stored["extras"]
            extras = None if extras_ref is None else orjson.loads(self._blob(rollout_id, extras_ref))
            snapshots.append(build("StagedCallSnapshot", {**stored["row"], "extras": extras}))
        return snapshots

    def fetch_attachments(self, staging_key: str) -> dict[str, bytes]:
        """The attachments staged with the call, by name, as the bytes given (``{}`` when none)."""
        stored = self._stored([staging_key])[0]
        rollout_id = stored["row"]["rollout_id"]
        return {name: self._blob(rollout_id, ref) for name, ref in stored["attachments"].items()}

    def _blob(self, rollout_id: str, ref: dict[str, Any]) -> bytes:
        return read_blob(self._store, rollout_id, ref)

    def journal_store(self) -> TokenCaptureStore:
        """The store a restage reads (``tokcap.staging.journal``); the file store is its own projection."""
        return self._store

    def journal_topic(self) -> None:
        """None: the file store's journal has no topic."""
        return None
