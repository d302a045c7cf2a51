"""What a reader could tell apart in an entry or a snapshot, for comparing them exactly (not just ``==``)."""

from __future__ import annotations

from typing import Any

from tokcap.log.records import TokenEntry
from tokcap.protocols import TokenCaptureSnapshot


def exact_shape(value: Any) -> Any:
    """Types, float signs, dict key order, extra fields and the fields-set, as comparable nested tuples."""
    if isinstance(value, TokenEntry):
        return (
            "entry",
            exact_shape(value.__dict__),
            exact_shape(value.__pydantic_extra__ or {}),
            sorted(value.model_fields_set),
            value.__pydantic_private__,
        )
    if isinstance(value, dict):
        return ("dict", [(type(key).__name__, key, exact_shape(item)) for key, item in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [exact_shape(item) for item in value])
    return (type(value).__name__, repr(value))


def snapshot_shape(snapshot: TokenCaptureSnapshot) -> Any:
    """A snapshot's identity, version, mask and entries, each entry by ``exact_shape``."""
    return (
        snapshot.rollout_id,
        snapshot.snapshot_id,
        snapshot.version,
        snapshot.incomplete,
        [exact_shape(entry) for entry in snapshot.entries],
    )
