"""The rules: one pure decision per event, the only place a rule of the store lives.

``decide(state, event, position)`` returns a ``Decision``: the rollout's new state, the file effects that
carry it out, and the verdict for the caller. It reads no file, clock or random number, and never mutates
its input; the store (``tokcap.files.store``) carries out the effects in order. Because both transports feed the
same function in the same event order, the Kafka projection and the file store agree, and a replay of a
log reproduces the store byte for byte.

The rules, one per sentence (DESIGN.md, "Rules the apply function enforces"):

- An event at or before the rollout's last applied log position was applied already and changes nothing.
- A put of a known call id with the same canonical payload is a no-op.
- A put of a known call id with a different payload is rejected and marks the rollout incomplete.
- An intent or cancel that repeats the call's last recorded operation is a no-op.
- An intent, cancel or put after the freeze is rejected, recorded as evidence and moves the version.
- An incomplete marker is accepted even after the freeze, and every one moves the version.
- An incomplete marker whose marker id was applied already is a no-op (a spilled marker forwarded twice).
- The version counts as Gym's does: one per accepted entry, per marker, per conflicting put, and the first freeze.
- Every event but delete is refused by a retired rollout's fence.
- A freeze records the calls whose intent has no entry and no cancel; they make the snapshot incomplete.
- A freeze records that the state covers every line written before it; only a later line raced it.
- A freeze is idempotent; its snapshot id comes from its log position, or from the caller without a log.
- A freeze applied at a log position records the version it answered, so later events never leak into it.
- A drop retires the rollout only while it is frozen in exactly that snapshot and version.
- A retire retires whatever the state; the retired state is the fence, durable before any record is removed.
- A delete forgets the rollout; applied from a log it leaves an empty state holding the verdict.
- A drop, retire or delete applied at a log position records its verdict there, as a freeze records its answer.
- A snapshot is incomplete when its freeze or any later marker says so; as of a freeze, it has that freeze's version.
- A cancel is a line of the intents file Gym reads as an intent that never got an entry (Gym masks; tokcap knows).
- The position of every applied event is recorded once, in the state the decision returns.
- A stage of a known staging key with the same stored line is a no-op; another line is rejected, changing nothing.
- A ledger row of a known call id with the same commit digest is a no-op; another is rejected, changing nothing.
- A ledger row naming a staged row of its rollout with another staged digest is rejected, changing nothing.
- A ledger failure of a known call id with the same reason is a no-op; another is rejected, changing nothing.
- A stage, ledger row or ledger failure is refused by the fence only (not the freeze), moves no version, and is
  durable before its caller returns. Read from a log, a conflicting one also marks the rollout incomplete: its
  writer was told ok before the conflict could be seen.

Two kinds of rule come before an event exists and live with what they judge: how a message becomes an
event, or a dead letter that masks its rollout (undecodable, newer schema, refused by the input rules of
``tokcap/log/input_rules.py``, wrong key, a chunk group that cannot complete or is still open at its rollout's
freeze), in ``transports/kafka/wire/router.py``; and how the files a crash left are read back, in
``tokcap/files/recovery.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from immutables import Map

from tokcap.errors import InvalidInputError, RolloutRetiredError
from tokcap.log.events import (
    LOG_READER_WRITER,
    CancelEvent,
    DeleteEvent,
    DropEvent,
    Event,
    EventType,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LedgerEvent,
    LedgerFailureEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
    StageEvent,
)
from tokcap.log.input_rules import check_line_call_id
from tokcap.log.records import entry_digest
from tokcap.log.state import (
    CommandVerdict,
    FreezeAnswer,
    IncompleteMark,
    IntentOp,
    Lifecycle,
    Rejection,
    RolloutState,
    StagedSlot,
)

__all__ = [
    "CANCEL_PREFIX",
    "AppendEntry",
    "AppendIncompleteMark",
    "AppendIntent",
    "AppendLedgerLine",
    "AppendStagedLine",
    "ApplyOutcome",
    "ApplyResult",
    "Barrier",
    "Decision",
    "Effect",
    "RemoveRecords",
    "RemoveState",
    "SnapshotAnswer",
    "WriteState",
    "cancel_line",
    "decide",
    "intent_line",
    "is_marked_incomplete",
    "mark_line",
    "record_freeze",
    "recorded_verdict",
    "snapshot_id_at",
    "snapshot_of",
]


class ApplyOutcome(enum.StrEnum):
    """What the apply step decided for one event."""

    ACCEPTED = "accepted"
    NOOP = "no-op"
    ALREADY_APPLIED = "already-applied"
    REJECTED_AFTER_FREEZE = "rejected-after-freeze"
    REJECTED_RETIRED = "rejected-retired"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class ApplyResult:
    """The verdict of applying one event, for callers and for the event timeline."""

    outcome: ApplyOutcome
    event_type: EventType
    rollout_id: str
    model_call_id: str = ""
    snapshot_id: str | None = None
    version: int | None = None
    dropped: bool | None = None
    removed: bool | None = None
    detail: str = ""


# --------------------------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class AppendEntry:
    """Append one canonical entry line to ``<id>.tokens.jsonl`` at byte ``start``."""

    line: bytes
    start: int
    model_call_id: str
    digest: str


@dataclass(frozen=True)
class AppendIntent:
    """Append one intent or cancel line to ``<id>.tokens.intents`` at byte ``start``."""

    line: bytes
    start: int


@dataclass(frozen=True)
class AppendIncompleteMark:
    """Append one marker line (the call id, as Gym writes it) to ``<id>.tokens.incomplete`` at byte ``start``."""

    line: bytes
    start: int


@dataclass(frozen=True)
class AppendStagedLine:
    """Append one staged row's line to ``<id>.tokens.staged`` at byte ``start``.

    Bytes past ``start`` were never acknowledged (every staging event writes its state durably before its
    caller returns), so they are cut first.
    """

    line: bytes
    start: int


@dataclass(frozen=True)
class AppendLedgerLine:
    """Append one ledger row or failure line to ``<id>.tokens.ledger`` at byte ``start`` (a longer file is cut)."""

    line: bytes
    start: int


@dataclass(frozen=True)
class WriteState:
    """Replace the state file with the decision's state.

    A durable write must be synced before the caller returns; an index-only one may lag,
    because recovery rebuilds it from the file tails. ``state``, when given, is written instead of the
    decision's state (a tombstone that stands while the files of a delete are removed).
    """

    durable: bool
    state: RolloutState | None = None


@dataclass(frozen=True)
class Barrier:
    """Everything before this effect must be durable before anything after it happens."""


@dataclass(frozen=True)
class RemoveRecords:
    """Remove the entries, intents and incomplete files."""


@dataclass(frozen=True)
class RemoveState:
    """Remove the state file."""


Effect = (
    AppendEntry
    | AppendIntent
    | AppendIncompleteMark
    | AppendStagedLine
    | AppendLedgerLine
    | WriteState
    | Barrier
    | RemoveRecords
    | RemoveState
)


@dataclass(frozen=True)
class Decision:
    """The outcome of one event: the new state, the effects carrying it out, the verdict.

    ``sync_even_if_unchanged`` asks the store to sync the directory before returning even when this
    instance wrote nothing: another process may have removed the files without syncing yet.
    """

    state: RolloutState
    verdict: ApplyResult
    effects: tuple[Effect, ...] = ()
    sync_even_if_unchanged: bool = False
    changed: bool = field(default=True)


# ------------------------------------------------------------------------------------------ encodings


def intent_line(model_call_id: str) -> bytes:
    """The stored line of one intent: the call id, as Gym writes it.

    Each line writer refuses a call id with a control character or over the length limit
    (``check_line_call_id``): whatever let it through, it must never become a line read as another call.
    """
    return check_line_call_id(model_call_id).encode() + b"\n"


CANCEL_PREFIX = "\x00"
"""Starts a cancel line; no call id can start with it (NUL is refused in call ids)."""


def cancel_line(model_call_id: str) -> bytes:
    """The stored line of one cancel: an id Gym reads as one more intent that never got an entry.

    Gym 0.7.0 has no cancel; to Gym such a line dangles, so Gym masks the rollout (never the reverse).
    """
    return (CANCEL_PREFIX + check_line_call_id(model_call_id)).encode() + b"\n"


def mark_line(model_call_id: str) -> bytes:
    """The stored line of one incomplete marker: the call id (maybe empty), as Gym writes it."""
    return check_line_call_id(model_call_id).encode() + b"\n"


def snapshot_id_at(position: LogPosition) -> str:
    """A snapshot id derived from the freeze's log position.

    A log position never repeats for a topic, so the id never repeats for a rollout id, even after delete and
    reuse, and every replay derives the same id.
    """
    return f"{position.topic}:{position.partition}:{position.offset}"


# ------------------------------------------------------------------------------------------- the rules


def decide(
    state: RolloutState, event: Event, position: LogPosition | None, *, new_snapshot_id: str = ""
) -> Decision:
    """Decide what one event does to a rollout; ``state`` is never mutated.

    ``new_snapshot_id`` names the snapshot a freeze without a log position creates; the caller draws it,
    so this function stays free of randomness.
    """
    if state.already_applied(position) or _applied_before_indexes(state, event, position):
        return Decision(
            state, ApplyResult(ApplyOutcome.ALREADY_APPLIED, event.type, state.rollout_id), changed=False
        )
    new = state.positioned(position)
    if isinstance(event, PutEvent):
        return _put(new, event, position)
    if isinstance(event, IntentEvent):
        return _intent_op(new, event.model_call_id, EventType.INTENT, IntentOp.INTENT, position)
    if isinstance(event, CancelEvent):
        return _intent_op(new, event.model_call_id, EventType.CANCEL, IntentOp.CANCEL, position)
    if isinstance(event, IncompleteEvent):
        return _incomplete(new, event, position)
    if isinstance(event, FreezeEvent):
        return _freeze(new, position, new_snapshot_id)
    if isinstance(event, DropEvent):
        return _drop(new, event, position)
    if isinstance(event, RetireEvent):
        return _retire(new, position)
    if isinstance(event, DeleteEvent):
        return _delete(state, position)
    if isinstance(event, StageEvent | LedgerEvent | LedgerFailureEvent):
        return _staging(new, event, position)
    raise InvalidInputError(f"no rule applies events of type {type(event).__name__}")


def _applied_before_indexes(state: RolloutState, event: Event, position: LogPosition | None) -> bool:
    """Whether a state written before positions had indexes already holds this event's decision.

    Such a state recorded every decision about a rollout that routing one message took at index 0, and a log
    reader's masks without a position, so a reader resumed over it cannot tell them applied by position alone.
    A freeze of a message whose answer the rollout holds was applied: a message freezes a rollout once.
    A log reader's mask identical to one the rollout holds was applied: its reason names the message or the
    chunk group it masks for, and masking again would add nothing but a second line.
    """
    if position is None:
        return False
    if isinstance(event, FreezeEvent):
        return state.answer_at(position) is not None
    if isinstance(event, IncompleteEvent) and event.writer == LOG_READER_WRITER and not event.marker_id:
        return any(
            not mark.marker_id and mark.model_call_id == event.model_call_id and mark.reason == event.reason
            for mark in state.incomplete_marks
        )
    return False


def _unchanged(state: RolloutState, verdict: ApplyResult, position: LogPosition | None) -> Decision:
    """A verdict that changes nothing but, applied from a log, the recorded position."""
    if position is None:
        return Decision(state, verdict, changed=False)
    return Decision(state, verdict, (WriteState(durable=False),))


def _refused_by_fence(state: RolloutState, event_type: EventType, call_id: str) -> ApplyResult:
    return ApplyResult(
        ApplyOutcome.REJECTED_RETIRED,
        event_type,
        state.rollout_id,
        call_id,
        snapshot_id=state.snapshot_id,
        version=state.version,
        detail="the rollout is retired; its fence refuses late writes",
    )


def _rejected_late(
    state: RolloutState, event_type: EventType, call_id: str, position: LogPosition | None
) -> Decision:
    """A write that raced the freeze: kept as evidence, and the version moves so the stale snapshot stays."""
    rejection = Rejection(event_type=event_type.value, model_call_id=call_id, position=position)
    state = state.evolve(rejections=(*state.rejections, rejection), version=state.version + 1)
    verdict = ApplyResult(
        ApplyOutcome.REJECTED_AFTER_FREEZE,
        event_type,
        state.rollout_id,
        call_id,
        snapshot_id=state.snapshot_id,
        version=state.version,
        detail=f"{event_type.value} arrived after the freeze of snapshot {state.snapshot_id}",
    )
    return Decision(state, verdict, (WriteState(durable=True),))


def _with_mark(state: RolloutState, mark: IncompleteMark) -> tuple[RolloutState, tuple[Effect, ...]]:
    """Mark the rollout incomplete: one line per marker, as Gym writes, and the version moves; a reason is kept once."""
    line = mark_line(mark.model_call_id)
    effect = AppendIncompleteMark(line, state.incomplete_size)
    marks = state.incomplete_marks if mark in state.incomplete_marks else (*state.incomplete_marks, mark)
    marked = state.evolve(
        incomplete=True,
        version=state.version + 1,
        incomplete_marks=marks,
        incomplete_size=state.incomplete_size + len(line),
    )
    return marked, (effect,)


def _put(state: RolloutState, event: PutEvent, position: LogPosition | None) -> Decision:
    call_id = event.entry.model_call_id
    if state.retired:
        return _unchanged(state, _refused_by_fence(state, EventType.PUT, call_id), position)
    canonical = event.entry_line
    digest = event.payload_digest
    known = state.entry_digests.get(call_id)
    if known == digest:
        verdict = ApplyResult(
            ApplyOutcome.NOOP, EventType.PUT, state.rollout_id, call_id, detail="same payload"
        )
        return _unchanged(state, verdict, position)
    if not state.is_open:
        return _rejected_late(state, EventType.PUT, call_id, position)
    if known is not None:
        state, marks = _with_mark(
            state,
            IncompleteMark(model_call_id=call_id, reason="conflicting payload for a call id already stored"),
        )
        verdict = ApplyResult(
            ApplyOutcome.CONFLICT,
            EventType.PUT,
            state.rollout_id,
            call_id,
            detail="a different payload was already stored for this call id; the rollout is incomplete",
        )
        return Decision(state, verdict, (*marks, WriteState(durable=True)))
    line = canonical + b"\n"
    append = AppendEntry(line, state.indexed_size, call_id, digest)
    state = state.evolve(
        entry_digests={**state.entry_digests, call_id: digest},
        indexed_size=state.indexed_size + len(line),
        version=state.version + 1,
    )
    verdict = ApplyResult(ApplyOutcome.ACCEPTED, EventType.PUT, state.rollout_id, call_id)
    return Decision(state, verdict, (append, WriteState(durable=False)))


def _intent_op(
    state: RolloutState, call_id: str, event_type: EventType, op: IntentOp, position: LogPosition | None
) -> Decision:
    if state.retired:
        return _unchanged(state, _refused_by_fence(state, event_type, call_id), position)
    if state.intents.get(call_id) is op:
        verdict = ApplyResult(
            ApplyOutcome.NOOP, event_type, state.rollout_id, call_id, detail=f"{op.value} already recorded"
        )
        return _unchanged(state, verdict, position)
    if not state.is_open:
        return _rejected_late(state, event_type, call_id, position)
    line = intent_line(call_id) if op is IntentOp.INTENT else cancel_line(call_id)
    append = AppendIntent(line, state.intents_size)
    state = state.evolve(intents=state.intents.set(call_id, op), intents_size=state.intents_size + len(line))
    verdict = ApplyResult(ApplyOutcome.ACCEPTED, event_type, state.rollout_id, call_id)
    return Decision(state, verdict, (append, WriteState(durable=False)))


def _incomplete(state: RolloutState, event: IncompleteEvent, position: LogPosition | None) -> Decision:
    call_id = event.model_call_id
    if state.retired:
        return _unchanged(state, _refused_by_fence(state, EventType.INCOMPLETE, call_id), position)
    if event.marker_id and any(mark.marker_id == event.marker_id for mark in state.incomplete_marks):
        verdict = ApplyResult(
            ApplyOutcome.NOOP,
            EventType.INCOMPLETE,
            state.rollout_id,
            call_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            detail=f"marker {event.marker_id} already applied",
        )
        return _unchanged(state, verdict, position)
    state, marks = _with_mark(
        state, IncompleteMark(model_call_id=call_id, reason=event.reason, marker_id=event.marker_id)
    )
    late = not state.is_open
    verdict = ApplyResult(
        ApplyOutcome.ACCEPTED,
        EventType.INCOMPLETE,
        state.rollout_id,
        call_id,
        snapshot_id=state.snapshot_id,
        version=state.version,
        detail="late incomplete after freeze; version moved" if late else "",
    )
    return Decision(state, verdict, (*marks, WriteState(durable=True)))


def _freeze(state: RolloutState, position: LogPosition | None, new_snapshot_id: str) -> Decision:
    if state.retired:
        return _unchanged(state, _refused_by_fence(state, EventType.FREEZE, ""), position)
    if not state.is_open:
        if position is not None:
            state = _with_answer(state, position)
        verdict = ApplyResult(
            ApplyOutcome.NOOP,
            EventType.FREEZE,
            state.rollout_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            detail="already frozen",
        )
        return _unchanged(state, verdict, position)
    if position is None and not new_snapshot_id:
        raise ValueError("a freeze without a log position needs a snapshot id drawn by the caller")
    state = record_freeze(state).advanced(
        Lifecycle.FROZEN,
        snapshot_id=snapshot_id_at(position) if position is not None else new_snapshot_id,
        version=state.version + 1,
    )
    if position is not None:
        state = _with_answer(state, position)
    verdict = ApplyResult(
        ApplyOutcome.ACCEPTED,
        EventType.FREEZE,
        state.rollout_id,
        snapshot_id=state.snapshot_id,
        version=state.version,
    )
    return Decision(state, verdict, (WriteState(durable=True),))


def record_freeze(state: RolloutState) -> RolloutState:
    """Record what a freeze fixes: the calls whose intent has no entry and no cancel, which make the snapshot
    incomplete, and that the state's sizes cover every line written before it.

    tokcap's freeze calls it, and so does recovery for a freeze Gym's store made (which records neither).
    """
    dangling = tuple(
        sorted(
            call_id
            for call_id, op in state.intents.items()
            if op is IntentOp.INTENT and call_id not in state.entry_digests
        )
    )
    return state.evolve(
        dangling_intents=dangling,
        incomplete=state.incomplete or bool(dangling) or bool(state.incomplete_marks),
        covers_freeze=True,
    )


def _with_answer(state: RolloutState, position: LogPosition) -> RolloutState:
    answer = FreezeAnswer(position=position, version=state.version, incomplete=state.incomplete)
    return state.evolve(freeze_answers=(*state.freeze_answers, answer))


def _with_verdict(state: RolloutState, verdict: ApplyResult, position: LogPosition | None) -> RolloutState:
    """Record a command's verdict at its log position (none without a log)."""
    if position is None:
        return state
    recorded = CommandVerdict(
        position=position,
        event_type=verdict.event_type.value,
        dropped=verdict.dropped,
        removed=verdict.removed,
    )
    return state.evolve(command_verdicts=(*state.command_verdicts, recorded))


def _retired(state: RolloutState) -> tuple[RolloutState, tuple[Effect, ...]]:
    """The retired state is the fence: durable first, then the records go; a crash in between still refuses writes.

    Like Gym's drop, it keeps the snapshot id, version and incomplete flag, and forgets the entry index.
    """
    retired = state.advanced(
        Lifecycle.RETIRED,
        removed_records=state.holds_records,
        entry_digests={},
        indexed_size=0,
        intents=Map(),
        intents_size=0,
        incomplete_marks=(),
        incomplete_size=0,
        staged=Map(),
        staged_size=0,
        ledger=Map(),
        ledger_failures=Map(),
        ledger_size=0,
    )
    return retired, (WriteState(durable=True), Barrier(), RemoveRecords())


def _drop(state: RolloutState, event: DropEvent, position: LogPosition | None) -> Decision:
    matches = state.snapshot_id == event.snapshot_id and state.version == event.version
    if state.retired or state.is_open or not matches:
        dropped = state.retired and matches
        verdict = ApplyResult(
            ApplyOutcome.NOOP,
            EventType.DROP,
            state.rollout_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            dropped=dropped,
            detail="already dropped" if dropped else "the rollout is not in that exact frozen state",
        )
        return _unchanged(_with_verdict(state, verdict, position), verdict, position)
    state, effects = _retired(state)
    verdict = ApplyResult(
        ApplyOutcome.ACCEPTED,
        EventType.DROP,
        state.rollout_id,
        snapshot_id=state.snapshot_id,
        version=state.version,
        dropped=True,
        removed=state.removed_records,
    )
    return Decision(_with_verdict(state, verdict, position), verdict, effects)


def _retire(state: RolloutState, position: LogPosition | None) -> Decision:
    if state.retired:
        verdict = ApplyResult(ApplyOutcome.NOOP, EventType.RETIRE, state.rollout_id, removed=False)
        return _unchanged(_with_verdict(state, verdict, position), verdict, position)
    state, effects = _retired(state)
    verdict = ApplyResult(
        ApplyOutcome.ACCEPTED, EventType.RETIRE, state.rollout_id, removed=state.removed_records
    )
    return Decision(_with_verdict(state, verdict, position), verdict, effects)


def _delete(state: RolloutState, position: LogPosition | None) -> Decision:
    """Forget the rollout; applied from a log, leave an empty open state that remembers the delete.

    That state keeps a resumed projection from applying the delete twice and lets a source in another
    process read the verdict; the rollout id is reusable and starts empty either way. It replaces the old
    state before any file is removed, so a crash anywhere leaves the same verdict. Without a log, a rollout
    holding records is retired first, so a crash half-way leaves it fenced, never half-open.
    """
    removed = state.holds_records or state.retired
    verdict = ApplyResult(
        ApplyOutcome.ACCEPTED if removed else ApplyOutcome.NOOP,
        EventType.DELETE,
        state.rollout_id,
        removed=removed,
    )
    if position is not None:
        fresh = RolloutState(
            rollout_id=state.rollout_id, removed_records=removed, command_verdicts=state.command_verdicts
        )
        fresh = _with_verdict(fresh.positioned(position), verdict, position)
        effects: tuple[Effect, ...] = (WriteState(durable=True), Barrier(), RemoveRecords())
        return Decision(fresh, verdict, effects, sync_even_if_unchanged=True)
    if not state.holds_records:
        effects = (RemoveRecords(), RemoveState())
        return Decision(
            RolloutState(rollout_id=state.rollout_id), verdict, effects, sync_even_if_unchanged=True
        )
    tombstone, _ = _retired(state)
    effects = (WriteState(durable=True, state=tombstone), Barrier(), RemoveRecords(), RemoveState())
    return Decision(RolloutState(rollout_id=state.rollout_id), verdict, effects, sync_even_if_unchanged=True)


# ------------------------------------------------------------------------------------- what is recorded


@dataclass(frozen=True)
class SnapshotAnswer:
    """What a frozen state answers as a snapshot, its entries aside: they are the store's to read."""

    snapshot_id: str
    version: int
    incomplete: bool


def is_marked_incomplete(state: RolloutState) -> bool:
    """Whether any call of the rollout failed to capture (or, once frozen, was left dangling)."""
    return state.incomplete or bool(state.incomplete_marks)


def snapshot_of(state: RolloutState, as_of: LogPosition | None) -> SnapshotAnswer:
    """The snapshot a frozen state answers; ``as_of``, the freeze of that log position answered.

    As of a freeze its version stands, so a write that raced the freeze keeps the drop of that snapshot from
    succeeding; a marker applied later still masks it (failing closed).
    """
    rollout_id = state.rollout_id
    if state.retired:
        raise RolloutRetiredError(
            f"rollout {rollout_id!r} is retired (snapshot {state.snapshot_id}); its records are gone. "
            "Delete it before reusing the id",
            rollout_id=rollout_id,
        )
    if state.is_open or state.snapshot_id is None:
        raise InvalidInputError(
            f"rollout {rollout_id!r} is not frozen; freeze it first", rollout_id=rollout_id
        )
    if as_of is None:
        return SnapshotAnswer(state.snapshot_id, state.version, is_marked_incomplete(state))
    answer = state.answer_at(as_of)
    if answer is None:
        raise InvalidInputError(
            f"rollout {rollout_id!r} has no freeze applied at {as_of}; the directory was not projected "
            "from this log, or the rollout was deleted since",
            rollout_id=rollout_id,
        )
    return SnapshotAnswer(state.snapshot_id, answer.version, is_marked_incomplete(state) or answer.incomplete)


def recorded_verdict(state: RolloutState, event: Event, position: LogPosition) -> ApplyResult:
    """The verdict of a command applied at ``position``, read back from the state it left.

    A drop, retire or delete finds its own record, however many events came after it; one without a record
    (applied by a tokcap that recorded none) dropped and removed nothing. A freeze's answer is its snapshot,
    which ``snapshot_of`` reads; a freeze with no answer of a retired rollout was refused by its fence.
    """
    recorded = state.verdict_at(position)
    if isinstance(event, DropEvent):
        dropped = recorded is not None and bool(recorded.dropped)
        return ApplyResult(
            ApplyOutcome.NOOP, event.type, event.rollout_id, dropped=dropped, detail="recorded verdict"
        )
    if isinstance(event, RetireEvent | DeleteEvent):
        removed = recorded is not None and bool(recorded.removed)
        return ApplyResult(
            ApplyOutcome.NOOP, event.type, event.rollout_id, removed=removed, detail="recorded verdict"
        )
    if isinstance(event, FreezeEvent) and state.retired and state.answer_at(position) is None:
        return _refused_by_fence(state, event.type, "")
    return ApplyResult(ApplyOutcome.NOOP, event.type, event.rollout_id, detail="recorded in the state")


def _names_other_staged_row(state: RolloutState, event: LedgerEvent) -> str | None:
    """Why a ledger row cannot commit the staged row its key names here, or ``None`` when it can.

    A key staged elsewhere (another rollout, or storage other than this store) is not judged.
    """
    key, committed = event.row.get("staging_key"), event.row.get("staging_digest")
    slot = state.staged.get(key) if isinstance(key, str) else None
    if slot is None or slot.record_digest is None or slot.record_digest == committed:
        return None
    return (
        f"the ledger row commits {key!r} with staged digest {committed!r}, but the row staged under that key has "
        f"digest {slot.record_digest!r}; the call was staged twice with different payloads"
    )


def _staging(
    state: RolloutState, event: StageEvent | LedgerEvent | LedgerFailureEvent, position: LogPosition | None
) -> Decision:
    """A staged row, ledger row or ledger failure: write-once per key, refused only by the fence."""
    call_id = event.model_call_id
    if state.retired:
        return _unchanged(state, _refused_by_fence(state, event.type, call_id), position)
    line = event.stored_line
    if isinstance(event, StageEvent):
        key, known_slot = event.staging_key, state.staged.get(event.staging_key)
        known, digest = (known_slot.digest if known_slot else None), entry_digest(line)
    elif isinstance(event, LedgerEvent):
        key, known_slot = call_id, state.ledger.get(call_id)
        known, digest = (known_slot.digest if known_slot else None), event.commit_digest
    else:
        key, known, digest = call_id, state.ledger_failures.get(call_id), event.reason
    if known == digest:
        verdict = ApplyResult(
            ApplyOutcome.NOOP, event.type, state.rollout_id, call_id, detail="identical repeat"
        )
        return _unchanged(state, verdict, position)
    judged = known is None and isinstance(event, LedgerEvent)
    mismatch = _names_other_staged_row(state, event) if judged and isinstance(event, LedgerEvent) else None
    if known is not None or mismatch is not None:
        verdict = ApplyResult(
            ApplyOutcome.CONFLICT,
            event.type,
            state.rollout_id,
            call_id,
            detail=mismatch or f"{key!r} was already recorded with a different payload; the first one stands",
        )
        if position is None:
            return _unchanged(state, verdict, position)
        # Read from a log, the writer was already told ok: its copy differs from the one kept, so the rollout
        # is masked rather than trained on a row its writer never staged.
        state, marks = _with_mark(
            state,
            IncompleteMark(
                model_call_id=call_id, reason=f"conflicting {event.type.value} for {key!r}: {verdict.detail}"
            ),
        )
        return Decision(state, verdict, (*marks, WriteState(durable=True)))
    effect: Effect
    if isinstance(event, StageEvent):
        effect = AppendStagedLine(line, state.staged_size)
        record_digest = event.row.get("digest")
        slot = StagedSlot(
            start=state.staged_size,
            length=len(line),
            digest=digest,
            record_digest=record_digest if isinstance(record_digest, str) else None,
            offset=None if position is None else position.offset,
        )
        state = state.evolve(staged=state.staged.set(key, slot), staged_size=state.staged_size + len(line))
    else:
        effect = AppendLedgerLine(line, state.ledger_size)
        if isinstance(event, LedgerEvent):
            slot = StagedSlot(start=state.ledger_size, length=len(line), digest=digest)
            state = state.evolve(
                ledger=state.ledger.set(key, slot), ledger_size=state.ledger_size + len(line)
            )
        else:
            state = state.evolve(
                ledger_failures=state.ledger_failures.set(key, digest),
                ledger_size=state.ledger_size + len(line),
            )
    verdict = ApplyResult(ApplyOutcome.ACCEPTED, event.type, state.rollout_id, call_id)
    return Decision(state, verdict, (effect, WriteState(durable=True)))
