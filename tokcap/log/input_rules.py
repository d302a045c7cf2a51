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
  ``int``, log probs and ``created_at`` as numbers. A ``bytes`` id, a token id ``true`` or a log prob
  written as the string ``"-0.5"`` would be silently converted, so it is refused. (A ``TokenEntry`` object
  was already validated when it was built.)

The same rules hold for every event read back from a log (``accept_event``, ``check_event``): the Kafka
codec applies them where a message becomes an event, so what a sink refuses to send is dead-lettered when
it is found on a topic instead. The writers of side-file lines check their call id last
(``check_line_call_id``), so no line can ever be read as another.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import orjson

from tokcap.errors import InvalidInputError, RecordValidationError
from tokcap.log.events import (
    CancelEvent,
    Event,
    IncompleteEvent,
    IntentEvent,
    LedgerEvent,
    LedgerFailureEvent,
    PutEvent,
    StageEvent,
    event_from_mapping,
)
from tokcap.log.records import REQUIRED_TOKEN_FIELDS, TokenEntry, as_token_entry
from tokcap.log.rollout_ids import validate_rollout_id

__all__ = [
    "MAX_CALL_ID_LENGTH",
    "MAX_TOKEN_ID",
    "accept_entry",
    "accept_event",
    "check_call_id",
    "check_entry_fields",
    "check_event",
    "check_finite_values",
    "check_line_call_id",
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
    problem = _line_problem(model_call_id)
    if problem:
        raise InvalidInputError(
            f"rollout {rollout_id!r}: {problem}", rollout_id=rollout_id, model_call_id=model_call_id[:80]
        )
    return model_call_id


def check_line_call_id(model_call_id: str) -> str:
    """Refuse a call id that would not stay one line of a side file; return it.

    The writers of intent, cancel and marker lines call this last, whatever checked the id before them: a
    newline or a NUL in an id would make a Gym or tokcap reader see another call, or another call's cancel.
    """
    problem = _line_problem(model_call_id)
    if problem:
        raise InvalidInputError(problem, model_call_id=model_call_id[:80])
    return model_call_id


def _line_problem(model_call_id: str) -> str:
    """Why a call id cannot be one line of a side file, or ``""``."""
    if len(model_call_id) > MAX_CALL_ID_LENGTH:
        return (
            f"model_call_id is {len(model_call_id)} characters long; at most {MAX_CALL_ID_LENGTH} are allowed"
        )
    # A printable string has no control character (Cc is one of the categories ``isprintable`` refuses), so
    # the per-character scan runs only for ids with a separator or format character.
    if not model_call_id.isprintable() and any(unicodedata.category(char) == "Cc" for char in model_call_id):
        return (
            f"model_call_id {model_call_id[:80]!r} contains a control character (NUL, newline, ...); the side "
            "files hold one call id per line"
        )
    return ""


def accept_entry(entry: object) -> TokenEntry:
    """The one door of every sink: a tokcap or Gym ``TokenEntry`` or a mapping, checked and ready to store."""
    if isinstance(entry, Mapping):
        _check_raw_types(entry)
    return check_storable(as_token_entry(entry))


def accept_event(raw: object, *, token_ids_checked: bool = False) -> Event:
    """The one door of every reader of a log: decoded JSON validated into an event a sink would have sent.

    A put's entry is checked as it arrived, before validation could turn ``true`` into the token id 1, then
    the event as ``check_event`` does. ``token_ids_checked`` says the caller already proved that the token
    arrays hold ints in [0, 2**64) (a packed array's dtype and sign bytes prove it for a fraction of the
    cost of a scan of the decoded lists), so they are not scanned again.
    """
    if isinstance(raw, Mapping) and raw.get("type") == "put" and isinstance(raw.get("entry"), Mapping):
        _check_raw_types(raw["entry"], arrays=not token_ids_checked)
    return check_event(event_from_mapping(raw), token_ids_checked=token_ids_checked)


def check_event(event: Event, *, token_ids_checked: bool = False) -> Event:
    """Refuse a decoded event that a sink would have refused to send; return it unchanged.

    Each event type is checked for what it carries: a put its entry (``check_storable``), an intent or a
    cancel its call id, an incomplete marker its call id, which may be empty (its marker id was checked
    against ``MARKER_ID_PATTERN`` when it was validated), a stage, ledger row or ledger failure its call
    id, key, columns and reason (``tokcap.staging.row_rules``), every event its rollout id.
    """
    if isinstance(event, PutEvent):
        check_storable(event.entry, token_ids_checked=token_ids_checked)
    elif isinstance(event, IntentEvent | CancelEvent):
        check_call_id(event.rollout_id, event.model_call_id)
    elif isinstance(event, IncompleteEvent):
        check_call_id(event.rollout_id, event.model_call_id, may_be_empty=True)
    elif isinstance(event, StageEvent | LedgerEvent | LedgerFailureEvent):
        _check_staging_event(event)
    else:
        validate_rollout_id(event.rollout_id)
    return event


def _check_staging_event(event: StageEvent | LedgerEvent | LedgerFailureEvent) -> None:
    """The checks of ``stage``, ``record`` and ``record_failure``: the call id and token ids here, the columns
    in ``tokcap.staging.row_rules``.

    Imported here, not at the top: the staging package's sinks import these rules themselves.
    """
    from tokcap.staging import row_rules

    check_call_id(event.rollout_id, event.model_call_id)
    if isinstance(event, StageEvent):
        ids = event.row.get("token_ids_delta")
        if isinstance(ids, list):
            _check_token_ids(event.rollout_id, event.model_call_id, "token_ids_delta", ids)
        row_rules.check_stage_event(event)
    elif isinstance(event, LedgerEvent):
        row_rules.check_ledger_event(event)
    else:
        row_rules.check_ledger_failure_event(event)


def check_entry_fields(raw: Mapping[str, Any]) -> None:
    """Check an entry given as decoded JSON without its token arrays by every rule that is not about them.

    A reader that keeps the arrays undecoded (the lineage resolver) checks the rest of the entry with this,
    and the arrays' types and ranges on their packed bytes.
    """
    _check_raw_types(raw, arrays=False)
    rollout_id, call_id = raw["rollout_id"], raw["model_call_id"]
    check_call_id(rollout_id, call_id)
    for field, value in raw.items():
        if type(value) not in _JSON_LEAVES and field not in REQUIRED_TOKEN_FIELDS:
            _check_finite(rollout_id, call_id, field, value)


def _check_raw_types(raw: Mapping[str, Any], *, arrays: bool = True) -> None:
    """Refuse values pydantic would convert; ``arrays`` false skips the three token arrays.

    This runs on every put a reader decodes, so the common case does no formatting and no generic scans.
    """
    rollout_id = raw.get("rollout_id")
    call_id = raw.get("model_call_id")
    for field, value in (("rollout_id", rollout_id), ("model_call_id", call_id)):
        if not isinstance(value, str):
            _refuse_raw(raw, f"{field} must be a str, got {type(value).__name__}")
    for field in ("prompt_token_ids", "generation_token_ids") if arrays else ():
        values = raw.get(field)
        if isinstance(values, list) and any(type(value) is not int for value in values):
            _refuse_raw(raw, f"{field} must hold ints only (not true, false or floats)")
    numbers: list[Any] = list(raw.get("generation_log_probs") or []) if arrays else []
    if "created_at" in raw:
        numbers.append(raw["created_at"])
    if any(type(value) is not float and not _is_number(value) for value in numbers):
        _refuse_raw(raw, "generation_log_probs and created_at must be numbers, not strings")


def _is_number(value: object) -> bool:
    """An int or a float, but not a bool (which pydantic would take as 0 or 1)."""
    return not isinstance(value, bool) and isinstance(value, int | float)


def _refuse_raw(raw: Mapping[str, Any], why: str) -> NoReturn:
    rollout_id, call_id = raw.get("rollout_id"), raw.get("model_call_id")
    raise RecordValidationError(
        f"rollout {rollout_id!r} call {call_id!r}: {why}; nothing was written",
        rollout_id=rollout_id if isinstance(rollout_id, str) else None,
        model_call_id=call_id if isinstance(call_id, str) else None,
    )


def check_storable(entry: TokenEntry, *, token_ids_checked: bool = False) -> TokenEntry:
    """Refuse an entry that could not be stored and read back exactly; return it unchanged.

    ``token_ids_checked``: the caller proved the token ids are ints in [0, 2**64); they are not scanned.
    """
    rollout_id, call_id = entry.rollout_id, entry.model_call_id
    if not isinstance(rollout_id, str):
        raise RecordValidationError(f"rollout_id must be a str, got {type(rollout_id).__name__}")
    check_call_id(rollout_id, call_id)
    for field in ("prompt_token_ids", "generation_token_ids") if not token_ids_checked else ():
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
    """Refuse an id that is not an int (a bool included), or is outside [0, 2**64).

    orjson encodes the ids in one pass in C, measured no slower than packing them as unsigned 64-bit numbers
    (which takes a bool as 1). It refuses an int of 2**64 or more and a value that is no JSON type. It writes
    a negative id with a ``-``, a float with a ``.`` or an ``e``, a bool as ``true`` or ``false``, None as
    ``null`` and a string in quotes. So ids that encode to digits, commas and brackets only are ints in range
    (an ``IntEnum`` member is written as its number, as the canonical line writes it). Only when that fails
    are the ids scanned in Python to name the one at fault.
    """
    try:
        encoded = orjson.dumps(ids)
    except orjson.JSONEncodeError:
        pass
    else:
        if not encoded.translate(None, _ID_ARRAY_BYTES):
            return
    for token in ids:
        if type(token) is not int:
            _refuse(
                rollout_id, call_id, field, f"holds {token!r}, a {type(token).__name__}, where an int belongs"
            )
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(token for token in ids if not 0 <= token <= MAX_TOKEN_ID)
        _refuse(rollout_id, call_id, field, f"holds token id {bad}, outside [0, 2**64)")


_ID_ARRAY_BYTES = b"0123456789,[]"
"""The only bytes orjson writes for a list of ints in [0, 2**64)."""

_JSON_LEAVES = frozenset({str, int, bool, type(None)})
"""Types of JSON values that hold no float: the walk skips them without the slower abstract checks."""


def _finite_numbers(items: list[Any]) -> bool:
    """Whether a list holds only finite numbers; decided in C for the long columns of log probs and masks.

    ``False`` means "walk it": the list holds something else (a nested value, a string) or a non-finite
    float, and the walk finds which.
    """
    try:
        return all(map(math.isfinite, items))
    except (TypeError, OverflowError):
        return False


def _check_finite(rollout_id: str, call_id: str, field: str, value: Any) -> None:
    """Walk a JSON-like value; a non-finite float anywhere is refused.

    The plain JSON types are recognised by their exact type first: this runs on every field of every
    event a reader decodes, and an abstract ``Mapping`` or ``Iterable`` check costs several times more.
    """
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _JSON_LEAVES:
            continue
        if kind is dict:
            pending.extend(item.values())
        elif kind is list:
            if _finite_numbers(item):
                continue
            pending.extend(item)
        elif isinstance(item, float):
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
