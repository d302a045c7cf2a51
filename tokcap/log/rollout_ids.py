"""Rollout ids name files and Kafka keys, so only safe ones are accepted."""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokcap.errors import InvalidRolloutIdError

__all__ = ["MAX_ROLLOUT_ID_LENGTH", "validate_rollout_id", "validate_rollout_ids"]

MAX_ROLLOUT_ID_LENGTH = 200
"""Longest accepted id: the longest derived file name must stay under the 255-byte name limit."""

_ALLOWED = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=,~-]*")


def validate_rollout_id(rollout_id: str) -> str:
    """Reject anything that could escape the store directory or name a bad file; return the id."""
    if not isinstance(rollout_id, str):
        raise InvalidRolloutIdError(f"rollout id must be a string, got {type(rollout_id).__name__}")
    if not rollout_id:
        raise InvalidRolloutIdError("rollout id must not be empty")
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRolloutIdError(
            f"rollout id is {len(rollout_id)} characters long; at most {MAX_ROLLOUT_ID_LENGTH} are allowed",
            rollout_id=rollout_id[:MAX_ROLLOUT_ID_LENGTH],
        )
    if _ALLOWED.fullmatch(rollout_id) is None:
        raise InvalidRolloutIdError(
            f"rollout id {rollout_id!r} is not allowed: use ASCII letters, digits and ._:@+=,~- "
            "and start with a letter, digit or underscore (no separators, '..', spaces or control characters)",
            rollout_id=rollout_id,
        )
    return rollout_id


def validate_rollout_ids(rollout_ids: Sequence[str]) -> list[str]:
    """Validate a whole batch before anything changes, and drop duplicates keeping first-seen order.

    A bare string is refused: it would be read as a sequence of one-character ids.
    """
    if isinstance(rollout_ids, str | bytes):
        raise InvalidRolloutIdError(
            f"expected a sequence of rollout ids, got the bare string {rollout_ids!r}; wrap it in a list"
        )
    validated = [validate_rollout_id(rollout_id) for rollout_id in rollout_ids]
    return list(dict.fromkeys(validated))
