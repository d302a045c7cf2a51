"""What a stage, a ledger row and a ledger failure must hold to be applied, whoever wrote them.

``stage``, ``record`` and ``record_failure`` build these events from records their input rules checked. An
event read back from a log (a hand-produced message, a writer of another version) gets the same checks
here before it is applied, so nothing reaches the store that a manifest or a fetch could not read back:

- every call id passes ``input_rules.check_call_id`` and a stage's token ids ``check_token_ids`` (checked by
  ``input_rules.check_event`` before these), and a stage's key is ``<rollout_id>/<model_call_id>``;
- a stage's row has the columns of a ``StagedCallBaseSnapshot`` of the event's rollout and call, each of its
  type and shape (digests as 64 hex digits, token ids in [0, 2**64), finite floats), and no ``extras``
  column (they travel as a blob). Its digests are not recomputed here: that costs milliseconds a call on
  every reader, and every fetch validates the stored row in full, so a row that does not match its digest
  is refused there and its rollout masked;
- a ledger row has exactly the columns ``ledger_row`` writes (``LEDGER_COLUMNS``), they make a valid
  ``CallRecord`` (``call_record_of``), and its lookup columns have the types a parent lookup reads;
- a ledger failure has a non-empty reason.

A refusal is an ``InvalidInputError`` that names the rollout, the call and the column.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, Self

from pydantic import ValidationError, model_validator

from tokcap.errors import InvalidInputError
from tokcap.log.events import LedgerEvent, LedgerFailureEvent, StageEvent
from tokcap.staging.records import CallRecord, StagedCallBaseSnapshot, staging_key

__all__ = [
    "LEDGER_COLUMNS",
    "call_record_of",
    "check_ledger_event",
    "check_ledger_failure_event",
    "check_stage_event",
    "ledger_row_problem",
]

_RECORD_FIELD_OF_COLUMN = {
    "parent_call_id": "parent_call_id",
    "prev_len": "prev_len",
    "delta_len": "delta_len",
    "cum_len": "cum_len",
    "weight_version": "weight_version",
    "staging_digest": "digest",
    "extras_digest": "extras_digest",
    "staging_key": "staging_key",
    "mode": "mode",
    "chain_hash": "chain_hash",
    "cumulative_hash": "cumulative_hash",
    "response_id": "response_id",
    "admitted_at": "admitted_at",
    "output_fingerprint": "output_fingerprint",
    "continuation_fingerprint": "continuation_fingerprint",
    "fingerprint_version": "fingerprint_version",
}
"""The ledger row's custody columns and the ``CallRecord`` field each holds."""

_COLUMN_OF_RECORD_FIELD = {field: column for column, field in _RECORD_FIELD_OF_COLUMN.items()}

LEDGER_COLUMNS = frozenset(
    {*_RECORD_FIELD_OF_COLUMN, "fingerprint", "context_len", "context_digest", "digest", "staging_chain"}
)
"""Every column of a ledger row (``tokcap.ledger.ledger_row``): custody columns and lookup keys."""


class _StagedRowShape(StagedCallBaseSnapshot):
    """A staged row's columns, types and shapes; the digest and the cross-column rules are left to the fetch."""

    @model_validator(mode="after")
    def _integrity(self) -> Self:
        return self


def call_record_of(model_call_id: str, row: Mapping[str, Any]) -> CallRecord:
    """The manifest's ``CallRecord`` a ledger row stands for; a missing column or a bad value raises ``ValueError``."""
    missing = sorted(_RECORD_FIELD_OF_COLUMN.keys() - row.keys())
    if missing:
        raise ValueError(f"the ledger row lacks column(s) {missing}")
    fields = {field: row[column] for column, field in _RECORD_FIELD_OF_COLUMN.items()}
    return CallRecord(model_call_id=model_call_id, **fields)


def _refuse(rollout_id: str, call_id: str, why: str) -> NoReturn:
    raise InvalidInputError(
        f"rollout {rollout_id!r} call {call_id!r}: {why}", rollout_id=rollout_id, model_call_id=call_id
    )


def _first_problem(exc: ValidationError, column_of: Mapping[str, str]) -> str:
    """The first complaint of a validation, naming the column (``column_of`` maps a field to it)."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    head = str(error["loc"][0]) if error["loc"] else ""
    column = column_of.get(head, head) + where[len(head) :] if head else "the row"
    return f"column {column!r}: {error['msg']}"


def ledger_row_problem(exc: ValidationError) -> str:
    """The first complaint of a ledger row's validation, naming the row's column."""
    return _first_problem(exc, _COLUMN_OF_RECORD_FIELD)


def check_stage_event(event: StageEvent) -> None:
    """Refuse a stage that ``stage`` would not have sent (its call id and token ids aside)."""
    rollout_id, call_id = event.rollout_id, event.model_call_id
    if event.staging_key != staging_key(rollout_id, call_id):
        _refuse(
            rollout_id,
            call_id,
            f"staging_key {event.staging_key[:80]!r} is not {staging_key(rollout_id, call_id)!r}, the key of its "
            "rollout and call",
        )
    row = event.row
    for column, value in (("rollout_id", rollout_id), ("model_call_id", call_id)):
        if row.get(column) != value:
            _refuse(rollout_id, call_id, f"the staged row's {column} {row.get(column)!r} is not the event's")
    try:
        _StagedRowShape.model_validate(row)
    except ValidationError as exc:
        _refuse(
            rollout_id, call_id, f"the staged row is not a valid staged record: {_first_problem(exc, {})}"
        )


def check_ledger_event(event: LedgerEvent) -> None:
    """Refuse a ledger row that ``record`` would not have sent (its call id aside)."""
    rollout_id, call_id = event.rollout_id, event.model_call_id
    row = event.row
    missing = sorted(LEDGER_COLUMNS - row.keys())
    if missing:
        _refuse(rollout_id, call_id, f"the ledger row lacks column(s) {missing}")
    unknown = sorted(row.keys() - LEDGER_COLUMNS)
    if unknown:
        _refuse(rollout_id, call_id, f"the ledger row has unknown column(s) {unknown}")
    try:
        record = call_record_of(call_id, row)
    except ValidationError as exc:
        _refuse(rollout_id, call_id, f"the ledger row is no valid call record: {ledger_row_problem(exc)}")
    if row["digest"] != record.cumulative_hash:
        _refuse(rollout_id, call_id, "the ledger row's column 'digest' is not its cumulative_hash")
    context_len = row["context_len"]
    if type(context_len) is not int or context_len < 0:
        _refuse(rollout_id, call_id, f"the ledger row's column 'context_len' is {context_len!r}, not a count")
    for column in ("fingerprint", "context_digest"):
        if not isinstance(row[column], str):
            _refuse(rollout_id, call_id, f"the ledger row's column {column!r} is not a str")
    chain = row["staging_chain"]
    if not isinstance(chain, list) or not all(isinstance(key, str) and key for key in chain):
        _refuse(rollout_id, call_id, "the ledger row's column 'staging_chain' is not a list of staging keys")


def check_ledger_failure_event(event: LedgerFailureEvent) -> None:
    """Refuse a ledger failure that ``record_failure`` would not have sent (its call id aside)."""
    if not event.reason:
        _refuse(
            event.rollout_id, event.model_call_id, "the ledger failure's reason is empty; it must say why"
        )
