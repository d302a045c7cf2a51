"""A journal behind any staging store: stage into tokcap first, restore a trainer's in-memory store from it.

A trainer that keeps staged calls in memory (NeMo RL over TransferQueue) makes them durable only when it
snapshots, so a crash loses every call staged since. ``JournaledStagingSink(inner, journal)`` stages each call
in a tokcap staging sink (the journal) and then in the trainer's own store (``inner``). Just before each
snapshot the trainer takes ``cursor(label)`` and keeps its JSON inside the snapshot. After a restore,
``restage(source, inner, after=cursor)`` gives the fresh store every call staged after the cursor, exactly.

Why no acknowledged call is lost, one claim per sentence:

- A stage is ok only once the journal made the call durable and the inner store then accepted it.
- A stage that is not ok gets a ledger failure row for its call (``worker_capture_failed``, the row Gym's model
  server records for it too), whether the journal or the inner store refused it, and restage skips every call
  with a failure row.
- The journal keeps a staged call until its rollout is retired or deleted; restage reads only what it keeps.
- On Kafka the journal's order is the log's: each staged row's slot keeps the offset of its stage, and a cursor
  is the end offset of every partition, so a stage acknowledged after the cursor sits at or past it.
- On the file store a rollout's staged rows are appended in stage order and only retire or delete removes them,
  so a cursor holds, per rollout, the size of its staged rows and a digest of their slots, and restage gives
  back the rows past that size; a rollout whose rows before that size changed (deleted and staged again) is
  given back whole.
- Taking a file cursor reads the rollouts' states and adds nothing to a stage, no fsync and no write.
- A call whose journal stage is before the cursor's position but whose inner stage was still running is
  covered because ``cursor`` waits, after reading the position, until every stage this sink had started has
  returned, so the snapshot taken after ``cursor`` holds it.
- A call staged in between the cursor and the snapshot may therefore come back once more, identical, never
  zero times.
- A repeat of an identical stage keeps the call's place from its first stage; when that place is before the
  cursor, the first stage either was acknowledged before the snapshot (so the snapshot holds the call) or was
  not ok (so the call has a failure row and its rollout is poisoned).
- The wait covers stages through this sink object; a store written through several sinks in several processes
  takes its cursor where the writes stop for the snapshot.

Restage stages each call with Gym's ``StagedCallRecord`` (tokcap's without Gym), its extras and attachments as
staged; the inner store's own staging key is what its ``StageResult`` says, as on the first stage.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson

from tokcap.errors import InvalidInputError, StoreCorruptionError
from tokcap.files.durable_io import fsync_directory, read_no_follow
from tokcap.files.layout import JOURNAL_CURSORS_NAME
from tokcap.files.store import TokenCaptureStore
from tokcap.log.state import RolloutState, StagedSlot
from tokcap.staging.gym_types import build

__all__ = [
    "REFUSED_STAGE_REASON",
    "JournalCursor",
    "JournalSource",
    "JournaledStagingSink",
    "RestageRefusal",
    "RestageReport",
    "RolloutMark",
    "StagedRollout",
    "StagingJournal",
    "cursors_taken",
    "file_cursor",
    "kafka_cursor",
    "read_blob",
    "record_cursor",
    "restage",
    "slots_digest",
    "staged_rollouts",
]

REFUSED_STAGE_REASON = "worker_capture_failed"
"""The failure reason the journal records for a stage that was not ok: Gym's ``WORKER_CAPTURE_FAILED_REASON``,
which Gym's model server records for the same call next, so the two rows are one identical repeat."""

_CURSOR_VERSION = 1
_Transport = Literal["file", "kafka"]


@dataclass(frozen=True)
class RolloutMark:
    """Where one rollout's staged rows ended when a file cursor was taken, and a digest of their slots."""

    staged_size: int
    slots_digest: str


@dataclass(frozen=True)
class JournalCursor:
    """A position in a journal's order, taken just before a snapshot; the trainer keeps its JSON in the snapshot.

    On Kafka it is the end offset of every partition of ``topic`` (``offsets``); on the file store, a
    ``RolloutMark`` per rollout holding staged rows (``rollouts``). ``taken_at`` (seconds since the epoch) is
    for people reading it; no decision uses it.
    """

    label: str
    transport: _Transport
    taken_at: float
    topic: str | None = None
    offsets: Mapping[int, int] = field(default_factory=dict)
    rollouts: Mapping[str, RolloutMark] = field(default_factory=dict)

    def to_json(self) -> str:
        """The cursor as one JSON object with sorted keys."""
        document: dict[str, Any] = {
            "label": self.label,
            "taken_at": self.taken_at,
            "transport": self.transport,
            "version": _CURSOR_VERSION,
        }
        if self.transport == "kafka":
            document["topic"] = self.topic
            document["offsets"] = {
                str(partition): offset for partition, offset in sorted(self.offsets.items())
            }
        else:
            document["rollouts"] = {
                rollout_id: {"size": mark.staged_size, "slots": mark.slots_digest}
                for rollout_id, mark in sorted(self.rollouts.items())
            }
        return orjson.dumps(document, option=orjson.OPT_SORT_KEYS).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> JournalCursor:
        """Read ``to_json``'s form back; anything else raises ``InvalidInputError`` saying what is wrong."""
        try:
            raw = orjson.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            version = raw["version"]
            if version != _CURSOR_VERSION:
                raise ValueError(f"version {version!r}, this tokcap reads version {_CURSOR_VERSION}")
            label, transport, taken_at = raw["label"], raw["transport"], raw["taken_at"]
            if not isinstance(label, str) or not isinstance(taken_at, int | float):
                raise TypeError("label must be a string and taken_at a number")
            if transport == "kafka":
                topic = raw["topic"]
                if not isinstance(topic, str):
                    raise TypeError("topic must be a string")
                offsets = {int(partition): _count(offset) for partition, offset in raw["offsets"].items()}
                return cls(label, "kafka", float(taken_at), topic=topic, offsets=offsets)
            if transport == "file":
                rollouts = {
                    str(rollout_id): RolloutMark(_count(mark["size"]), _digest(mark["slots"]))
                    for rollout_id, mark in raw["rollouts"].items()
                }
                return cls(label, "file", float(taken_at), rollouts=rollouts)
            raise ValueError(f"transport {transport!r} is neither 'file' nor 'kafka'")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidInputError(
                f"not a journal cursor ({type(exc).__name__}: {exc}); pass the text JournalCursor.to_json returned"
            ) from exc

    def restages(self, state: RolloutState, slot: StagedSlot) -> bool:
        """Whether the staged row in ``slot`` of ``state`` was staged after this cursor (so restage gives it)."""
        if self.transport == "kafka":
            position = state.last_position
            if slot.offset is None or position is None or position.topic != self.topic:
                return True
            return slot.offset >= self.offsets.get(position.partition, 0)
        mark = self.rollouts.get(state.rollout_id)
        if mark is None or slot.start >= mark.staged_size:
            return True
        return slots_digest(state, mark.staged_size) != mark.slots_digest


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is no non-negative integer")
    return value


def _digest(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 64:
        raise ValueError(f"{value!r} is no SHA-256 hex digest")
    return value


def slots_digest(state: RolloutState, size: int) -> str:
    """A digest of the staged slots that start before ``size``: equal only when those rows are the same rows."""
    hasher = hashlib.sha256()
    for key, slot in sorted(state.staged.items(), key=lambda item: item[1].start):
        if slot.start < size:
            hasher.update(f"{slot.start} {slot.length} {slot.digest} {key}\n".encode())
    return hasher.hexdigest()


def file_cursor(store: TokenCaptureStore, label: str) -> JournalCursor:
    """A file-store cursor: each rollout holding staged rows, with their size and slots' digest, read now."""
    rollouts = {}
    for rollout_id in store.rollout_ids():
        state = store.read_state(rollout_id)
        if state.retired or not state.staged:
            continue
        rollouts[rollout_id] = RolloutMark(state.staged_size, slots_digest(state, state.staged_size))
    return JournalCursor(label, "file", time.time(), rollouts=rollouts)


def record_cursor(directory: Path, cursor: JournalCursor) -> None:
    """Append the cursor to the directory's list of cursors taken, durably (once per snapshot).

    The file is synced, and the directory too when this append created the file: a new name survives a power
    loss only once its directory is synced.
    """
    path = directory / JOURNAL_CURSORS_NAME
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, cursor.to_json().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_directory(directory)


def cursors_taken(directory: str | Path) -> list[JournalCursor]:
    """The cursors recorded in ``directory``, oldest first (a line a crash cut short is skipped)."""
    data = read_no_follow(Path(directory) / JOURNAL_CURSORS_NAME)
    if data is None:
        return []
    cursors = []
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            cursors.append(JournalCursor.from_json(line))
        except InvalidInputError:
            if not data.endswith(line):
                raise
    return cursors


class StagingJournal(Protocol):
    """What a tokcap staging sink gives a ``JournaledStagingSink``: ``FileStagingSink`` and ``KafkaStagingSink``."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any: ...

    def journal_cursor(self, label: str) -> JournalCursor: ...

    def record_refusal(self, rollout_id: str, model_call_id: str) -> None: ...

    def journal_dir(self) -> Path | None: ...


class JournalSource(Protocol):
    """What a tokcap staging source gives ``restage``: ``FileStagingSource`` and ``KafkaStagingSource``."""

    def journal_store(self) -> TokenCaptureStore: ...

    def journal_topic(self) -> str | None: ...


class _InFlight:
    """The stages a sink has started and not finished, so a cursor can wait for those running when it is taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._running: dict[int, threading.Event] = {}

    def enter(self) -> int:
        with self._lock:
            number = next(self._numbers)
            self._running[number] = threading.Event()
            return number

    def leave(self, number: int) -> None:
        with self._lock:
            self._running.pop(number).set()

    def running(self) -> list[threading.Event]:
        with self._lock:
            return list(self._running.values())


def _failed(error: str) -> Any:
    return build("StageResult", {"ok": False, "error": error})


def _identity(record: Any) -> tuple[Any, Any]:
    if isinstance(record, Mapping):
        return record.get("rollout_id"), record.get("model_call_id")
    return getattr(record, "rollout_id", None), getattr(record, "model_call_id", None)


def _stage_into(inner: Any, record: Any, attachments: Mapping[str, Any] | None) -> Any:
    """``inner.stage`` with the attachments keyword only when there are attachments, as Gym's capture core calls it."""
    keywords = {} if attachments is None else {"attachments": attachments}
    return inner.stage(record, **keywords)


def _require_staging_sink_shape(inner: Any) -> None:
    """Refuse an inner store without Gym's ``StagingSink`` shape before anything is staged into it."""
    stage = getattr(inner, "stage", None)
    if not callable(stage) or inspect.iscoroutinefunction(stage):
        raise InvalidInputError(
            "inner must have Gym's StagingSink shape (a synchronous stage method, which Gym's inference workers "
            f"call from their own threads); got {inner!r}"
        )


def _refusal_of(result: Any) -> str | None:
    """Why a ``StageResult`` (or its mapping) is not ok, or ``None`` when it is."""
    ok = result.get("ok") if isinstance(result, Mapping) else getattr(result, "ok", None)
    if ok is True:
        return None
    error = result.get("error") if isinstance(result, Mapping) else getattr(result, "error", None)
    return str(error or f"the stage answered {result!r}")


class JournaledStagingSink:
    """Gym's ``StagingSink`` in front of any staging store: durable in a tokcap journal first, then in ``inner``.

    It has that shape itself, so an inference worker stages through it as through any staging sink. ``inner``
    has Gym's ``StagingSink`` shape (a synchronous ``stage(record, *, attachments=None) -> StageResult``);
    ``journal`` is a ``FileStagingSink`` or ``KafkaStagingSink``. ``cursor_dir`` is where cursors
    taken are recorded; by default the journal's own directory (the file store, or a Kafka sink's
    ``store_dir``), and none when the journal has none.
    """

    def __init__(self, inner: Any, journal: StagingJournal, *, cursor_dir: str | Path | None = None) -> None:
        _require_staging_sink_shape(inner)
        for name in ("stage", "journal_cursor", "record_refusal", "journal_dir"):
            if not callable(getattr(journal, name, None)):
                raise InvalidInputError(
                    f"journal must be a tokcap staging sink (FileStagingSink or KafkaStagingSink); {journal!r} has "
                    f"no {name}"
                )
        self._inner = inner
        self._journal = journal
        self._cursor_dir = Path(cursor_dir) if cursor_dir is not None else journal.journal_dir()
        self._in_flight = _InFlight()

    def __repr__(self) -> str:
        return f"JournaledStagingSink(inner={self._inner!r}, journal={self._journal!r})"

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Stage in the journal, then in the inner store; a ``StageResult`` ok only when both accepted the call.

        The inner store's own result is returned when ok (its staging key is the one its trainer reads). A
        refusal or error of either is a failed result with the reason, and records the call's failure row in the
        journal, as Gym's model server does next, so ``restage`` never gives the call back. Input that is no
        valid staged record raises ``InvalidInputError`` before anything is staged, as the journal's ``stage`` does.
        """
        number = self._in_flight.enter()
        try:
            keywords = {} if attachments is None else {"attachments": attachments}
            journaled = self._journal.stage(record, **keywords)
            refused = _refusal_of(journaled)
            if refused is not None:
                why = f"the journal refused the call, so the inner store was not asked: {refused}"
                return _failed(self._recorded_refusal(record, why))
            try:
                result = _stage_into(self._inner, record, attachments)
                refused = _refusal_of(result)
            except Exception as exc:  # any error of a foreign store is its refusal, recorded and answered
                result, refused = None, f"the inner store raised {type(exc).__name__}: {exc}"
            if refused is None:
                return result
            why = f"the call is durable in the journal but the inner store refused it: {refused}"
            return _failed(self._recorded_refusal(record, why))
        finally:
            self._in_flight.leave(number)

    def _recorded_refusal(self, record: Any, why: str) -> str:
        """Record the call's failure row in the journal; say in the reason whether that worked."""
        rollout_id, call_id = _identity(record)
        try:
            self._journal.record_refusal(str(rollout_id), str(call_id))
        except Exception as exc:  # reported in the failed result; Gym records the same failure row next
            return (
                f"{why}; recording the refusal in the journal failed too ({type(exc).__name__}: {exc}), so until "
                "Gym's model server records the call's failure row a restage would give it back"
            )
        return f"{why}; the journal recorded the refusal, so a restage skips it"

    def cursor(self, label: str) -> JournalCursor:
        """A position in the journal's order for the snapshot about to be taken; keep ``to_json()`` in it.

        It reads the position, then waits until every stage this sink had started has returned, so that each
        call before the position is in the inner store (or refused) before the snapshot. The cursor is
        recorded in ``cursor_dir`` when there is one.
        """
        cursor = self._journal.journal_cursor(label)
        for running in self._in_flight.running():
            running.wait()
        if self._cursor_dir is not None:
            record_cursor(self._cursor_dir, cursor)
        return cursor


@dataclass(frozen=True)
class RestageRefusal:
    """A call the inner store refused when it was restaged, and why."""

    staging_key: str
    reason: str


@dataclass(frozen=True)
class RestageReport:
    """What a restage did.

    ``restaged`` calls the inner store accepted; ``retired`` rollouts skipped because retired or deleted (their
    rows are gone, so their calls cannot be counted); ``failed`` calls skipped because their call has a failure
    row (a stage that was not ok); ``refused`` calls the inner store refused, each in ``refusals``.
    """

    restaged: int = 0
    retired: int = 0
    refused: int = 0
    failed: int = 0
    refusals: tuple[RestageRefusal, ...] = ()
    retired_rollouts: tuple[str, ...] = ()


@dataclass(frozen=True)
class _JournalCall:
    order: tuple[int, int, str, int]
    rollout_id: str
    staging_key: str


def _journal_calls(
    store: TokenCaptureStore,
    after: JournalCursor | None,
    rollout_ids: Sequence[str] | None,
    retired: list[str],
    failed: list[str],
) -> list[_JournalCall]:
    """The calls to restage, in journal order; retired rollouts and calls with failure rows go to the lists."""
    calls = []
    asked = rollout_ids is not None
    for rollout_id in store.rollout_ids() if rollout_ids is None else dict.fromkeys(rollout_ids):
        state = store.read_state(rollout_id)
        if state.retired or (asked and not state.staged and not state.ledger and not state.ledger_failures):
            retired.append(rollout_id)
            continue
        for key, slot in state.staged.items():
            if after is not None and not after.restages(state, slot):
                continue
            if key.partition("/")[2] in state.ledger_failures:
                failed.append(key)
                continue
            position = state.last_position
            if slot.offset is not None and position is not None:
                order = (position.partition, slot.offset, rollout_id, slot.start)
            else:
                order = (-1, 0, rollout_id, slot.start)
            calls.append(_JournalCall(order, rollout_id, key))
    calls.sort(key=lambda call: call.order)
    return calls


def _read_call(store: TokenCaptureStore, call: _JournalCall) -> tuple[Any, dict[str, bytes]] | None:
    """The staged record (Gym's class when Gym imports) and attachments of a call; ``None`` once it is retired."""
    (line,) = store.read_staged_lines(call.rollout_id, [call.staging_key])
    if line is None:
        return None
    stored = orjson.loads(line)
    try:
        extras_ref = stored["extras"]
        extras = None if extras_ref is None else orjson.loads(read_blob(store, call.rollout_id, extras_ref))
        attachments = {
            name: read_blob(store, call.rollout_id, ref)
            for name, ref in sorted(stored["attachments"].items())
        }
    except StoreCorruptionError:
        if store.read_state(call.rollout_id).retired:
            return None
        raise
    return build("StagedCallRecord", {**stored["row"], "extras": extras}), attachments


def read_blob(store: TokenCaptureStore, rollout_id: str, ref: Mapping[str, Any]) -> bytes:
    """The bytes a staged row names (extras or one attachment), checked against its SHA-256 and size."""
    path = store.blob_path_for(rollout_id, ref["sha256"])
    data = read_no_follow(path)
    if data is None or len(data) != ref["size"] or hashlib.sha256(data).hexdigest() != ref["sha256"]:
        raise StoreCorruptionError(
            f"{path} is missing or does not hold the {ref['size']} bytes its staged row names; the staged "
            "call's extras or attachment are damaged, so the rollout must be masked",
            rollout_id=rollout_id,
        )
    return data


def _check_cursor(source: JournalSource, after: JournalCursor) -> None:
    topic = source.journal_topic()
    transport = "file" if topic is None else "kafka"
    if after.transport != transport or (topic is not None and after.topic != topic):
        raise InvalidInputError(
            f"the cursor {after.label!r} was taken on the {after.transport} journal"
            f"{'' if after.topic is None else f' of topic {after.topic!r}'}, not on {source!r}; restage from the "
            "journal the cursor was taken on"
        )


def restage(
    source: JournalSource,
    inner: Any,
    *,
    after: JournalCursor | None = None,
    rollout_ids: Iterable[str] | None = None,
) -> RestageReport:
    """Stage into ``inner`` every journaled call staged after ``after`` (every one without it), in journal order.

    Only the given rollouts' calls with ``rollout_ids``. Each goes with its exact record, extras and attachments
    (the attachments keyword only when the call had attachments). Retired or deleted rollouts and calls with a
    failure row are skipped; what the inner store refuses (or raises) is counted with its reason. It only reads
    the journal.
    """
    _require_staging_sink_shape(inner)
    if after is not None:
        _check_cursor(source, after)
    asked = None if rollout_ids is None else list(rollout_ids)
    store = source.journal_store()
    retired: list[str] = []
    failed: list[str] = []
    calls = _journal_calls(store, after, asked, retired, failed)
    restaged = 0
    refusals: list[RestageRefusal] = []
    for call in calls:
        read = _read_call(store, call)
        if read is None:
            if call.rollout_id not in retired:
                retired.append(call.rollout_id)
            continue
        record, attachments = read
        try:
            result = _stage_into(inner, record, attachments or None)
            refused = _refusal_of(result)
        except Exception as exc:  # counted and reported with its reason, never dropped silently
            refused = f"the inner store raised {type(exc).__name__}: {exc}"
        if refused is None:
            restaged += 1
        else:
            refusals.append(RestageRefusal(call.staging_key, refused))
    return RestageReport(
        restaged=restaged,
        retired=len(retired),
        refused=len(refusals),
        failed=len(failed),
        refusals=tuple(refusals),
        retired_rollouts=tuple(retired),
    )


@dataclass(frozen=True)
class StagedRollout:
    """A rollout's staged calls not yet retired, for an operator: how many, how many bytes, how old.

    ``unledgered_calls`` have neither a ledger row nor a failure row: their model server may have died.
    ``last_staged_at`` is when its newest row was written to this directory (seconds since the epoch); on Kafka,
    when the projection applied it.
    """

    rollout_id: str
    staged_calls: int
    staged_bytes: int
    unledgered_calls: int
    ledger_rows: int
    failure_rows: int
    last_staged_at: float
    age_s: float


def _staged_rollout(store: TokenCaptureStore, rollout_id: str, now: float) -> StagedRollout | None:
    state = store.read_state(rollout_id)
    if state.retired or not state.staged:
        return None
    blobs = 0
    blob_dir = store.blob_path_for(rollout_id, "0" * 64).parent
    try:
        with os.scandir(blob_dir) as entries:
            blobs = sum(entry.stat(follow_symlinks=False).st_size for entry in entries if entry.is_file())
    except FileNotFoundError:
        pass
    try:
        written = os.stat(store.staged_path_for(rollout_id), follow_symlinks=False).st_mtime
    except FileNotFoundError:
        written = now
    calls = [key.partition("/")[2] for key in state.staged]
    unledgered = sum(1 for call in calls if call not in state.ledger and call not in state.ledger_failures)
    return StagedRollout(
        rollout_id=rollout_id,
        staged_calls=len(calls),
        staged_bytes=state.staged_size + blobs,
        unledgered_calls=unledgered,
        ledger_rows=len(state.ledger),
        failure_rows=len(state.ledger_failures),
        last_staged_at=written,
        age_s=max(0.0, now - written),
    )


def staged_rollouts(source: JournalSource, *, now: float | None = None) -> list[StagedRollout]:
    """Every rollout with staged calls not retired, by rollout id, read current (``tokcap staging status``)."""
    store = source.journal_store()
    moment = time.time() if now is None else now
    found = (_staged_rollout(store, rollout_id, moment) for rollout_id in store.rollout_ids())
    return [rollout for rollout in found if rollout is not None]


def kafka_cursor(topic: str, label: str, offsets: Mapping[int, int]) -> JournalCursor:
    """A Kafka cursor: the end offset of every partition of ``topic``, read now."""
    return JournalCursor(label, "kafka", time.time(), topic=topic, offsets=dict(offsets))
