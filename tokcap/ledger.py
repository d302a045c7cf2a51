"""Gym's ``CaptureLedger`` over tokcap's file store: the token-free rows of engine-side staging.

Gym's model server records one row per committed call (``record``) or failed call (``record_failure``);
the trainer reads them back as the rollout's manifest. Each row is a ``ledger`` or ``ledger-failure``
event applied by the store like every other event, durable and visible to every process on the
directory before the call returns. A row is write-once: an identical repeat, through any object, is a
no-op; any difference in the commit (its request items included) raises, and the first row stands.

A committed row also answers request-time lineage: ``staged_resolution`` finds the one row whose
custody fingerprint (request plus the call's output) matches a new request, as Gym's file ledger does,
and returns its staging chain, cumulative length and chain hash, which Gym needs to admit the child.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from tokcap.errors import ConflictingEntryError, InvalidInputError, RolloutRetiredError, StoreCorruptionError
from tokcap.files.store import TokenCaptureStore
from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from tokcap.log.events import LedgerEvent, LedgerFailureEvent
from tokcap.log.input_rules import check_call_id, check_finite_values
from tokcap.log.records import ParentResolutionStatus
from tokcap.log.rules import ApplyOutcome, ApplyResult
from tokcap.log.state import RolloutState
from tokcap.metrics import source_timed
from tokcap.staging.records import CallRecord, CaptureLedgerCommit, ManifestFailure, RolloutManifest
from tokcap.staging.row_rules import call_record_of, ledger_row_problem

if TYPE_CHECKING:
    from tokcap.protocols import LineageResolution

__all__ = [
    "UNNAMED_CALL",
    "FileCaptureLedger",
    "PendingRollout",
    "ledger_event",
    "ledger_failure_event",
    "ledger_row",
    "pending_in",
]


@dataclass(frozen=True)
class PendingRollout:
    """A rollout with committed ledger rows, not retired or deleted: a restored trainer trains on it, not again.

    ``has_failures``: it also has failure rows, so some call did not commit and the rollout is poisoned.
    """

    rollout_id: str
    has_failures: bool


def pending_in(store: TokenCaptureStore) -> list[PendingRollout]:
    """The pending rollouts of a store directory, by rollout id."""
    pending = []
    for rollout_id in store.rollout_ids():
        state = store.read_state(rollout_id)
        if not state.retired and state.ledger:
            pending.append(PendingRollout(rollout_id, has_failures=bool(state.ledger_failures)))
    return pending


def _commit_from(commit: Any) -> CaptureLedgerCommit:
    data = commit.model_dump(mode="json") if hasattr(commit, "model_dump") else commit
    try:
        return CaptureLedgerCommit.model_validate(data)
    except ValueError as exc:
        raise InvalidInputError(f"record() takes a CaptureLedgerCommit; this one is invalid: {exc}") from exc


def ledger_row(commit: CaptureLedgerCommit) -> dict[str, Any]:
    """The token-free row a commit is stored as: Gym's custody columns and lookup fingerprints."""
    record = commit.record
    request = list(commit.request_items)
    return {
        "fingerprint": assistant_fingerprint(request + list(commit.response_items)),
        "context_len": len(request),
        "context_digest": conversation_digest(request),
        "digest": record.cumulative_hash,
        "parent_call_id": record.parent_call_id,
        "staging_key": record.staging_key,
        "weight_version": record.weight_version,
        "prev_len": record.prev_len,
        "delta_len": record.delta_len,
        "cum_len": record.cum_len,
        "staging_digest": record.digest,
        "extras_digest": record.extras_digest,
        "mode": record.mode,
        "admitted_at": record.admitted_at,
        "staging_chain": list(commit.staging_chain),
        "chain_hash": record.chain_hash,
        "cumulative_hash": record.cumulative_hash,
        "response_id": record.response_id,
        "output_fingerprint": record.output_fingerprint,
        "continuation_fingerprint": record.continuation_fingerprint,
        "fingerprint_version": record.fingerprint_version,
    }


def ledger_event(commit: Any) -> LedgerEvent:
    """The ``ledger`` event of a commit (Gym's ``CaptureLedgerCommit`` or its mapping), checked by the input rules."""
    checked = _commit_from(commit)
    call_id = checked.record.model_call_id
    check_call_id(checked.rollout_id, call_id)
    check_finite_values(checked.rollout_id, call_id, "request_items", checked.request_items)
    check_finite_values(checked.rollout_id, call_id, "response_items", checked.response_items)
    whole = orjson.dumps(checked.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return LedgerEvent(
        rollout_id=checked.rollout_id,
        model_call_id=call_id,
        commit_digest=hashlib.sha256(whole).hexdigest(),
        row=ledger_row(checked),
    )


def ledger_failure_event(rollout_id: str, model_call_id: str, reason: str) -> LedgerFailureEvent:
    """The ``ledger-failure`` event of a call that did not commit; its reason must be said."""
    check_call_id(rollout_id, model_call_id)
    if not isinstance(reason, str) or not reason:
        raise InvalidInputError(f"rollout {rollout_id!r}: a ledger failure needs a non-empty reason")
    return LedgerFailureEvent(rollout_id=rollout_id, model_call_id=model_call_id, reason=reason)


UNNAMED_CALL = "(no call)"
"""The call a manifest failure names when what masks the rollout names none (a mark of the whole rollout, a
ledger line too damaged to name its call)."""


def _manifest_row(number: int, line: bytes) -> CallRecord | ManifestFailure:
    """A ledger line as a manifest row; a line no reader can take is a failure that says so, masking the rollout."""
    call_id: object = None
    try:
        row = orjson.loads(line)
        if not isinstance(row, dict):
            raise ValueError(f"it is a JSON {type(row).__name__}, not an object")
        call_id = row.get("model_call_id")
        if not isinstance(call_id, str):
            raise ValueError(f"its model_call_id is {call_id!r}, not a str")
        if "failure_reason" in row:
            return ManifestFailure(model_call_id=call_id, reason=row["failure_reason"])
        return call_record_of(call_id, row)
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
        named = call_id if isinstance(call_id, str) and call_id else UNNAMED_CALL
        reason = f"ledger line {number} cannot be read as a manifest row ({_first_line(exc)}); the rollout is masked"
        return ManifestFailure(model_call_id=named, reason=reason)


def _first_line(exc: Exception) -> str:
    """What was wrong with a ledger line, in one line that names the column."""
    if isinstance(exc, ValidationError):
        return ledger_row_problem(exc)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _mask_failures(state: RolloutState) -> list[ManifestFailure]:
    """Why the store masked the rollout (a dead-lettered or conflicting event, a lost call), as failure rows."""
    failures = [
        ManifestFailure(
            model_call_id=mark.model_call_id or UNNAMED_CALL,
            reason=mark.reason or "the rollout was marked incomplete",
        )
        for mark in state.incomplete_marks
    ]
    if state.incomplete and not failures:
        reason = "the rollout was marked incomplete (a call was dispatched and never captured)"
        failures.append(ManifestFailure(model_call_id=UNNAMED_CALL, reason=reason))
    return failures


class FileCaptureLedger:
    """Gym's ``CaptureLedger`` (``record``, ``record_failure``, ``manifest``, ``has_rows``) on a store directory."""

    _store: TokenCaptureStore

    def __init__(self, root: str | Path) -> None:
        self._store = TokenCaptureStore(root)

    def _raise_for(self, verdict: ApplyResult, what: str) -> None:
        if verdict.outcome is ApplyOutcome.CONFLICT:
            raise ConflictingEntryError(
                f"{what} of call {verdict.model_call_id!r} in rollout {verdict.rollout_id!r} was refused: "
                f"{verdict.detail}. A call id is committed once, with the row its worker staged",
                rollout_id=verdict.rollout_id,
                model_call_id=verdict.model_call_id,
            )
        if verdict.outcome is ApplyOutcome.REJECTED_RETIRED:
            raise RolloutRetiredError(
                f"rollout {verdict.rollout_id!r} is retired; its fence refused the {what} of call "
                f"{verdict.model_call_id!r}. Delete the rollout before reusing its id",
                rollout_id=verdict.rollout_id,
                model_call_id=verdict.model_call_id,
            )

    def record_now(self, commit: Any) -> None:
        """The blocking form of ``record``."""
        self._raise_for(self._store.apply(ledger_event(commit)), "ledger row")

    def record_failure_now(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """The blocking form of ``record_failure``."""
        self._raise_for(
            self._store.apply(ledger_failure_event(rollout_id, model_call_id, reason)), "ledger failure"
        )

    def _rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """The ledger's lines that are JSON objects; a damaged line (the manifest reports it) resolves nothing."""
        rows = []
        for line in self._store.read_ledger_lines(rollout_id):
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def manifest_now(self, rollout_id: str) -> dict[str, Any]:
        """The blocking form of ``manifest``.

        It answers for every rollout: a ledger line it cannot read, a ledger that no longer matches its
        state, and every reason the store masked the rollout for, are failure rows that say why, so the
        trainer gets a masked rollout rather than an error.
        """
        records: list[CallRecord] = []
        failures: list[ManifestFailure] = []
        try:
            lines = self._store.read_ledger_lines(rollout_id)
            state = self._store.read_state(rollout_id)
        except StoreCorruptionError as exc:
            failures.append(ManifestFailure(model_call_id=UNNAMED_CALL, reason=str(exc)))
        else:
            for number, line in enumerate(lines, 1):
                row = _manifest_row(number, line)
                if isinstance(row, ManifestFailure):
                    failures.append(row)
                else:
                    records.append(row)
            failures.extend(_mask_failures(state))
        return RolloutManifest(rollout_id=rollout_id, records=records, failures=failures).model_dump(
            mode="json"
        )

    def has_rows_now(self, rollout_id: str) -> bool:
        """The blocking form of ``has_rows``."""
        state = self._store.read_state(rollout_id)
        return bool(state.ledger or state.ledger_failures)

    def staged_resolution(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution | None:
        """The one committed row the request continues, as a resolved ``LineageResolution``; else ``None``.

        Failure rows and rows stamped by another fingerprint version never match; two matching rows are
        ambiguous and resolve nothing, as in Gym's file ledger.
        """
        from tokcap.protocols import LineageMatch, LineageResolution

        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return None
        rows = [
            row
            for row in self._rows(rollout_id)
            if row.get("fingerprint") == fingerprint and row.get("fingerprint_version") == FINGERPRINT_VERSION
        ]
        if len(rows) != 1:
            return None
        row = rows[0]
        try:
            context_len = int(row["context_len"])
            if len(request_items) < context_len:
                return None
            if conversation_digest(list(request_items[:context_len])) != row["context_digest"]:
                return None
            match = LineageMatch(
                model_call_id=row["model_call_id"],
                cumulative_token_ids=(),
                digest=row["digest"],
                staging_chain=tuple(row["staging_chain"]),
                prev_len=int(row["cum_len"]),
                chain_hash=row["chain_hash"],
            )
        except (KeyError, TypeError, ValueError):
            # A damaged row resolves nothing (the manifest masks its rollout); unresolved is always safe.
            return None
        return LineageResolution(ParentResolutionStatus.RESOLVED, match=match)

    @source_timed("file", "record")
    async def record(self, commit: Any) -> None:
        """Record a committed call; returns once every process on the directory can read it."""
        await asyncio.to_thread(self.record_now, commit)

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Record a call that did not commit; it never resolves a parent and poisons the rollout."""
        await asyncio.to_thread(self.record_failure_now, rollout_id, model_call_id, reason)

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's token-free ledger as plain JSON: ``records`` (Gym's ``CallRecord``) and ``failures``."""
        return await asyncio.to_thread(self.manifest_now, rollout_id)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any ledger row, committed or failed, exists for the rollout."""
        return await asyncio.to_thread(self.has_rows_now, rollout_id)

    async def pending_rollouts(self) -> list[PendingRollout]:
        """The rollouts with at least one committed row, not retired or deleted, each saying if it has failures."""
        return await asyncio.to_thread(pending_in, self._store)

    async def retire(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Remove the rollouts' staged rows, ledger rows and records, keeping the fence (Gym main's names).

        Call it once the trainer has read every manifest row; a late ``stage`` or ``record`` then fails.
        """
        payload = await asyncio.to_thread(self._store.retire_now, list(rollout_ids))
        return {"removed": list(payload.removed), "absent": list(payload.not_found)}

    async def delete(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Remove the rollouts and their fences, so the ids can be used again."""
        payload = await asyncio.to_thread(self._store.delete_now, list(rollout_ids))
        return {"removed": list(payload.removed), "absent": list(payload.not_found)}
