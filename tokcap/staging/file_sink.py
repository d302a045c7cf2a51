"""``FileStagingSink``: Gym's ``StagingSink`` over tokcap's file store, for engine-side staging.

An inference worker calls ``stage`` from its completion threads before it answers Gym. Each call becomes
one ``stage`` event applied by the store like every other event: the extras and attachments are written
as blobs, then the row naming them is appended and the new state written beside the state file; one
filesystem sync (shared by concurrent stagers) makes all of it durable before the state is renamed into
place, and the next makes the rename durable before ``stage`` returns ok. A crash before the rename leaves at
most blobs and a row no state names; a crash after leaves a row whose every byte is on disk. So ok is never
followed by a loss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from tokcap.errors import InvalidInputError, RecordValidationError, StoreWriteError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import LedgerFailureEvent, StagedBlob, StageEvent
from tokcap.log.input_rules import check_call_id, check_finite_values, check_token_ids
from tokcap.log.rules import ApplyOutcome
from tokcap.metrics import stage_timed
from tokcap.staging.gym_types import build, staging_records_module
from tokcap.staging.journal import REFUSED_STAGE_REASON, JournalCursor, file_cursor
from tokcap.staging.records import StagedCallRecord, staging_key

__all__ = ["FileStagingSink", "attachment_bytes", "staged_record_from"]


def staged_record_from(record: Any) -> StagedCallRecord:
    """A Gym or tokcap ``StagedCallRecord`` (or its mapping), checked by tokcap's input rules.

    The same rules as for a put apply: call ids without control characters, token ids in [0, 2**64), finite
    floats everywhere. A mapping is validated in full, digests recomputed. An instance of Gym's or tokcap's
    own ``StagedCallRecord`` had both digests checked when it was built, so they are not hashed again (the
    extras digest alone hashes every MB of routed experts); every read validates the stored row again,
    so a record changed after it was built is refused at the read and its rollout masked.
    """
    validated = _validated_record_type(record)
    data = record.model_dump() if hasattr(record, "model_dump") else record
    if not isinstance(data, Mapping):
        raise RecordValidationError(
            f"stage() takes a StagedCallRecord, got {type(record).__name__}; nothing was staged"
        )
    rollout_id, call_id = data.get("rollout_id"), data.get("model_call_id")
    if not isinstance(rollout_id, str):
        raise RecordValidationError(f"rollout_id must be a str, got {type(rollout_id).__name__}")
    check_call_id(rollout_id, call_id)
    assert isinstance(call_id, str)
    parent = data.get("parent_call_id")
    if parent is not None:
        check_call_id(rollout_id, parent)
    ids = data.get("token_ids_delta")
    if isinstance(ids, list):
        check_token_ids(rollout_id, call_id, "token_ids_delta", ids)
    for field in ("token_mask_delta", "generation_log_probs_delta", "extras"):
        check_finite_values(rollout_id, call_id, field, data.get(field))
    if validated and data.keys() == StagedCallRecord.model_fields.keys():
        return StagedCallRecord.model_construct(**data)
    try:
        return StagedCallRecord.model_validate(dict(data))
    except ValueError as exc:
        raise RecordValidationError(
            f"rollout {rollout_id!r} call {call_id!r}: not a valid staged record ({exc}); nothing was staged",
            rollout_id=rollout_id,
            model_call_id=call_id,
        ) from exc


def _validated_record_type(record: Any) -> bool:
    """Whether ``record`` is exactly Gym's or tokcap's ``StagedCallRecord``, whose validators ran when it was built.

    A subclass does not count: it may have replaced the validators.
    """
    kind = type(record)
    return kind is StagedCallRecord or kind is getattr(staging_records_module(), "StagedCallRecord", None)


def attachment_bytes(rollout_id: str, call_id: str, attachments: Mapping[str, Any]) -> dict[str, bytes]:
    """A staged call's attachments as bytes; anything else is refused, since it could not be returned as given.

    Every staging sink checks attachments this way (the file sink here, the Kafka sink before it sends), so
    both refuse the same input with the same message.
    """
    if not isinstance(attachments, Mapping):
        raise InvalidInputError(f"attachments must be a mapping, got {type(attachments).__name__}")
    out: dict[str, bytes] = {}
    for name, value in attachments.items():
        if not isinstance(name, str):
            raise InvalidInputError(
                f"rollout {rollout_id!r} call {call_id!r}: attachment names must be str, got {name!r}",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidInputError(
                f"rollout {rollout_id!r} call {call_id!r}: attachment {name!r} is a {type(value).__name__}; "
                "the file sink stores bytes, so serialize it (for example a tensor's buffer) first",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )
        out[name] = bytes(value)
    return out


class FileStagingSink:
    """Stage calls durably into a tokcap store directory; thread-safe and synchronous.

    Nameable by a framework worker as ``tokcap.staging:FileStagingSink`` with ``root`` the store
    directory; ``FileStagingSource`` and ``tokcap.lineage:FileLineageResolver`` on the same directory
    read what it staged, in any process.
    """

    def __init__(self, root: str | Path) -> None:
        self._store = TokenCaptureStore(root)

    def __repr__(self) -> str:
        return f"FileStagingSink(root={str(self._store.root)!r})"

    @stage_timed("file")
    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Make one staged call durable and return a ``StageResult`` with its key.

        A refusal (a different payload already staged under the key, or a retired rollout) returns a
        failed result; input that is no valid staged record raises ``InvalidInputError``; a failed write
        returns a failed result naming the file. Nothing is acknowledged that is not durable.
        """
        staged = staged_record_from(record)
        rollout_id, call_id = staged.rollout_id, staged.model_call_id
        blobs = attachment_bytes(rollout_id, call_id, attachments or {})
        key = staging_key(rollout_id, call_id)
        created: list[Path] = []
        try:
            contents: dict[str, bytes] = {}
            extras = None if staged.extras is None else _blob(orjson.dumps(staged.extras), contents)
            refs = {name: _blob(data, contents) for name, data in blobs.items()}
            # The stage's apply syncs them: an accepted one before its state is renamed, any other before its
            # verdict is answered.
            created = self._store.write_blobs(rollout_id, contents, wait=False)
            event = StageEvent(
                rollout_id=rollout_id,
                staging_key=key,
                model_call_id=call_id,
                row=staged.model_dump(mode="json", exclude={"extras"}),
                extras=extras,
                attachments=refs,
            )
            verdict = self._store.apply(event)
        except (OSError, StoreWriteError) as exc:
            return build("StageResult", {"ok": False, "error": f"staging {key!r} failed: {exc}"})
        if verdict.outcome in (ApplyOutcome.ACCEPTED, ApplyOutcome.NOOP):
            return build("StageResult", {"ok": True, "staging_key": key})
        if verdict.outcome is ApplyOutcome.REJECTED_RETIRED:
            for path in created:
                path.unlink(missing_ok=True)
            error = f"rollout {rollout_id!r} is retired; its fence refused the stage of {key!r}"
        else:
            error = f"{key!r} was already staged with a different payload; the first one stands"
        return build("StageResult", {"ok": False, "error": error})

    def journal_cursor(self, label: str) -> JournalCursor:
        """Where each rollout's staged rows end now (``tokcap.staging.journal``); it writes nothing."""
        return file_cursor(self._store, label)

    def record_refusal(self, rollout_id: str, model_call_id: str) -> None:
        """Record that a stage journaled here was not ok, as the failure row Gym's model server records for it.

        Raises ``StoreWriteError`` when the row cannot be written; another failure row already recorded for the
        call stands (the call is poisoned either way).
        """
        check_call_id(rollout_id, model_call_id)
        self._store.apply(
            LedgerFailureEvent(
                rollout_id=rollout_id, model_call_id=model_call_id, reason=REFUSED_STAGE_REASON
            )
        )

    def journal_dir(self) -> Path:
        """The store directory, where the cursors taken on this journal are recorded."""
        return self._store.root


def _blob(data: bytes, contents: dict[str, bytes]) -> StagedBlob:
    """Name bytes by their SHA-256 and add them to the blobs one stage writes."""
    sha = hashlib.sha256(data).hexdigest()
    contents[sha] = data
    return StagedBlob(sha256=sha, size=len(data))
