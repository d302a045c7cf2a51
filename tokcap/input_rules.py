"""What a sink accepts: one rule set for the file store and the Kafka transport, checked before anything is written.

A value is refused when it cannot be stored and read back exactly, or when it could never be matched or
trained on. Each refusal is an ``InvalidInputError`` (a ``ValueError``) naming the rollout, the call and the
field, raised before any byte is written or sent. docs/events.md lists where this is stricter than Gym 0.7.0.

- A model call id is a non-empty ``str`` of at most ``MAX_CALL_ID_LENGTH`` characters without control
  characters: the intents and incomplete files hold one id per line. (``mark_incomplete`` may name no call.)
- Token ids are integers in [0, 2**64): Gym's digest encodes them as unsigned 64-bit numbers.
- Every float of a record (timestamps, log probs, anything in its items or extra fields) is finite:
  NaN and infinity would be stored as JSON ``null`` and the line could not be read back.
- A record given as a mapping carries its values as they will be read back: ids as ``str``, token ids as
  ``int``, log probs and ``created_at`` as numbers. A ``bytes`` id or a log prob written as the string
  ``"-0.5"`` would be silently converted, so it is refused. (A ``TokenEntry`` object was already
  validated when it was built.)
"""

from __future__ import annotations

import array
import math
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from tokcap.errors import InvalidInputError, RecordValidationError
from tokcap.records import TokenEntry, as_token_entry
from tokcap.rollout_ids import validate_rollout_id

__all__ = [
    "MAX_CALL_ID_LENGTH",
    "MAX_TOKEN_ID",
    "accept_entry",
    "check_call_id",
    "check_finite_values",
    "check_storable",
    "check_token_ids",
]

MAX_CALL_ID_LENGTH = 1024
"""Longest accepted model call id; ids are stored on every line that names the call."""

MAX_TOKEN_ID = 2**64 - 1
"""Largest token id Gym's digest encoding can hold."""


def check_call_id(rollout_id: str, model_call_id: object, *, may_be_empty: bool = False) -> str:
    """Refuse a call id no put could match or the side files could not hold; return it."""
    validate_rollout_id(rollout_id)
    if not isinstance(model_call_id, str):
        raise InvalidInputError(
            f"rollout {rollout_id!r}: model_call_id must be a str, got {type(model_call_id).__name__}",
            rollout_id=rollout_id,
        )
    if not model_call_id and not may_be_empty:
        raise InvalidInputError(
            f"rollout {rollout_id!r}: model_call_id is empty; no entry could ever match it, so the rollout would "
            "be masked for good",
            rollout_id=rollout_id,
        )
    if len(model_call_id) > MAX_CALL_ID_LENGTH:
        raise InvalidInputError(
            f"rollout {rollout_id!r}: model_call_id is {len(model_call_id)} characters long; at most "
            f"{MAX_CALL_ID_LENGTH} are allowed",
            rollout_id=rollout_id,
            model_call_id=model_call_id[:80],
        )
    # A printable string has no control character (Cc is one of the categories ``isprintable`` refuses), so
    # the per-character scan runs only for ids with a separator or format character.
    if not model_call_id.isprintable() and any(unicodedata.category(char) == "Cc" for char in model_call_id):
        raise InvalidInputError(
            f"rollout {rollout_id!r}: model_call_id {model_call_id[:80]!r} contains a control character "
            "(NUL, newline, ...); the side files hold one call id per line",
            rollout_id=rollout_id,
            model_call_id=model_call_id[:80],
        )
    return model_call_id


def accept_entry(entry: object) -> TokenEntry:
    """The one door of every sink: a tokcap or Gym ``TokenEntry`` or a mapping, checked and ready to store."""
    if isinstance(entry, Mapping):
        _check_raw_types(entry)
    return check_storable(as_token_entry(entry))


def _check_raw_types(raw: Mapping[str, Any]) -> None:
    rollout_id = raw.get("rollout_id")
    call_id = raw.get("model_call_id")
    where = f"rollout {rollout_id!r} call {call_id!r}"
    named = {
        "rollout_id": rollout_id if isinstance(rollout_id, str) else None,
        "model_call_id": call_id if isinstance(call_id, str) else None,
    }
    for field in ("rollout_id", "model_call_id"):
        if not isinstance(raw.get(field), str):
            raise RecordValidationError(
                f"{where}: {field} must be a str, got {type(raw.get(field)).__name__}; nothing was written",
                **named,
            )
    for field in ("prompt_token_ids", "generation_token_ids"):
        values = raw.get(field)
        if isinstance(values, list) and any(type(value) is not int for value in values):
            raise RecordValidationError(f"{where}: {field} must hold ints only; nothing was written", **named)
    numbers: list[Any] = list(raw.get("generation_log_probs") or [])
    if "created_at" in raw:
        numbers.append(raw["created_at"])
    if any(isinstance(value, bool) or not isinstance(value, int | float) for value in numbers):
        raise RecordValidationError(
            f"{where}: generation_log_probs and created_at must be numbers, not strings; nothing was written",
            **named,
        )


def check_storable(entry: TokenEntry) -> TokenEntry:
    """Refuse an entry that could not be stored and read back exactly; return it unchanged."""
    rollout_id, call_id = entry.rollout_id, entry.model_call_id
    if not isinstance(rollout_id, str):
        raise RecordValidationError(f"rollout_id must be a str, got {type(rollout_id).__name__}")
    check_call_id(rollout_id, call_id)
    for field in ("prompt_token_ids", "generation_token_ids"):
        _check_token_ids(rollout_id, call_id, field, getattr(entry, field))
    if not math.isfinite(sum(entry.generation_log_probs)):
        _refuse(rollout_id, call_id, "generation_log_probs", "holds a non-finite value")
    if not math.isfinite(entry.created_at):
        _refuse(rollout_id, call_id, "created_at", f"is {entry.created_at!r}")
    for field in ("output_items", "routed_experts"):
        _check_finite(rollout_id, call_id, field, getattr(entry, field))
    for field, value in (entry.__pydantic_extra__ or {}).items():
        _check_finite(rollout_id, call_id, field, value)
    return entry


def _refuse(rollout_id: str, call_id: str, field: str, why: str) -> None:
    raise RecordValidationError(
        f"rollout {rollout_id!r} call {call_id!r}: {field} {why}; it could not be stored and read back exactly, "
        "so nothing was written",
        rollout_id=rollout_id,
        model_call_id=call_id,
    )


def _check_token_ids(rollout_id: str, call_id: str, field: str, ids: list[int]) -> None:
    """Refuse an id outside [0, 2**64).

    Packing the ids as unsigned 64-bit numbers checks the range in one pass in C, five times faster than a
    ``min`` and a ``max``; only when that refuses (a value out of range, or not an int) are the ids scanned
    in Python to name the one at fault.
    """
    try:
        array.array("Q", ids)
    except (OverflowError, TypeError):
        pass
    else:
        return
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(token for token in ids if not 0 <= token <= MAX_TOKEN_ID)
        _refuse(rollout_id, call_id, field, f"holds token id {bad}, outside [0, 2**64)")


def _check_finite(rollout_id: str, call_id: str, field: str, value: Any) -> None:
    """Walk a JSON-like value; a non-finite float anywhere is refused."""
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                _refuse(rollout_id, call_id, field, f"holds {item!r}")
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, Iterable) and not isinstance(item, str | bytes):
            pending.extend(list(item))


def check_token_ids(rollout_id: str, call_id: str, field: str, ids: list[int]) -> None:
    """Refuse token ids outside [0, 2**64) in any record, a put's or a staged call's."""
    _check_token_ids(rollout_id, call_id, field, ids)


def check_finite_values(rollout_id: str, call_id: str, field: str, value: Any) -> None:
    """Refuse a non-finite float anywhere in a JSON-like value, a put's or a staged call's."""
    _check_finite(rollout_id, call_id, field, value)
