"""Gym's import path of the file store (``tokcap.store:TokenCaptureStore`` in a config's ``sink``).

The store is ``tokcap.files.store``; this module only hands its public names on, so every config and
import written against Gym's layout keeps working.
"""

from tokcap.files.store import (
    ENTRIES_SUFFIX,
    INCOMPLETE_SUFFIX,
    INDEX_FLUSH_ENTRIES,
    INTENTS_SUFFIX,
    LOCK_SUFFIX,
    STATE_SUFFIX,
    AcceptedEntries,
    ApplyOutcome,
    ApplyResult,
    TokenCaptureStore,
    logger,
    make_token_store,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = [
    "ENTRIES_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "INDEX_FLUSH_ENTRIES",
    "INTENTS_SUFFIX",
    "LOCK_SUFFIX",
    "STATE_SUFFIX",
    "AcceptedEntries",
    "ApplyOutcome",
    "ApplyResult",
    "TokenCaptureStore",
    "logger",
    "make_token_store",
    "validate_rollout_id",
    "validate_rollout_ids",
]
