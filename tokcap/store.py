"""The file store: a durable, rollout-keyed projection of capture events.

Per rollout the store keeps, in one directory:

- ``<id>.tokens.jsonl``: one canonical JSON line per accepted entry (keys sorted).
- ``<id>.tokens.state.json``: the typed ``RolloutState`` (lifecycle, snapshot id, version,
  entry digests, how many bytes of the JSONL are indexed, rejections, last applied log position).
- ``<id>.tokens.intents``: JSON lines ``{"op": "intent"|"cancel", "model_call_id": ...}``.
- ``<id>.tokens.incomplete``: JSON lines naming each lost call; its presence masks the rollout.
- ``<id>.tokens.fence``: written on retire or drop, kept until ``delete``; late writers fail on it.
- ``<id>.tokens.lock``: the per-rollout file lock; never removed, so two lockers never hold different inodes.

Every change goes through one deterministic step, ``apply``.
The file store's own methods build an event and apply it at once.
The Kafka materializer applies events read from the log, with their log position.

Durability:

- Every entry line is fsynced before ``put`` returns.
- Every intent and incomplete line is fsynced before its call returns.
- The state file is replaced atomically; it is fsynced on lifecycle transitions and late changes.
  After a crash it is rebuilt from the durable JSONL tail, parsing only the tail.
- Retire makes its fences durable before removing records, and syncs the directory before it returns.
- Delete syncs the directory before it returns, even when it found nothing.
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from tokcap.durable_io import append_durably, remove_if_exists, replace_atomically
from tokcap.errors import (
    ConflictingEntryError,
    InvalidInputError,
    NewerSchemaError,
    RecordValidationError,
    RolloutFrozenError,
    RolloutRetiredError,
    StoreCorruptionError,
)
from tokcap.events import (
    CancelEvent,
    DeleteEvent,
    DropEvent,
    Event,
    EventType,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
)
from tokcap.group_commit import GroupCommitter, filesystem_sync_for
from tokcap.protocols import RolloutRemovalPayload, TokenCaptureSnapshot
from tokcap.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, TokenEntry, entry_digest
from tokcap.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.state import Lifecycle, Rejection, RolloutState
from tokcap.write_queue import WriteQueue

__all__ = [
    "ENTRIES_SUFFIX",
    "INDEX_FLUSH_ENTRIES",
    "FENCE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "INTENTS_SUFFIX",
    "LOCK_SUFFIX",
    "STATE_SUFFIX",
    "ApplyOutcome",
    "ApplyResult",
    "TokenCaptureStore",
    "logger",
    "make_token_store",
    "validate_rollout_id",
    "validate_rollout_ids",
]

logger = logging.getLogger(__name__)

ENTRIES_SUFFIX = ".tokens.jsonl"
STATE_SUFFIX = ".tokens.state.json"
INTENTS_SUFFIX = ".tokens.intents"
INCOMPLETE_SUFFIX = ".tokens.incomplete"
LOCK_SUFFIX = ".tokens.lock"
FENCE_SUFFIX = ".tokens.fence"

INDEX_FLUSH_ENTRIES = 8
"""Index-only state updates are written once this many entries lag behind the JSONL file.

Renaming a state file costs about as much as an fsync on ext4; the JSONL line is the durable record and the
index is rebuilt from the tail, so puts skip most index writes and never parse more than this many lines.
"""

_Result = TypeVar("_Result")

_REMEMBERED_PATHS = 65_536
"""How many validated rollout file paths a store remembers."""

_REMEMBERED_LINES = 65_536
"""How many appended lines' call ids a store remembers to re-index its lagging tails without parsing them."""


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


def _call_id_of_line(line: bytes) -> str:
    """Read just the call id of a stored line; full validation happens when entries are read."""
    try:
        raw = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise RecordValidationError(f"entry line is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecordValidationError("entry line is not a JSON object")
    version = raw.get("schema_version")
    if isinstance(version, int) and version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"entry line has schema_version {version}, newer than {TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; "
            "upgrade tokcap on the reading side"
        )
    call_id = raw.get("model_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RecordValidationError("entry line has no model_call_id")
    return call_id


def _snapshot_id_for(position: LogPosition | None) -> str:
    """Derive a snapshot id from the freeze's log position, or draw one when there is no log.

    A log position never repeats for a topic, so the id never repeats for a rollout id,
    even after delete and reuse, and every replay derives the same id.
    """
    if position is None:
        return uuid.uuid4().hex
    return f"{position.topic}:{position.partition}:{position.offset}"


@dataclass
class _HeldLock:
    """One rollout's lock inside this process: who waits for it, and the locked file while held."""

    thread_lock: threading.RLock
    users: int = 0
    depth: int = 0
    fd: int = -1


class _RolloutLocks:
    """Per-rollout exclusive locks: a thread lock within the process, ``flock`` on the lock file across processes.

    It is the same ``flock`` on the same ``.tokens.lock`` file that the ``filelock`` package takes, so processes
    using either interoperate; it costs a few microseconds where ``filelock`` 4 costs over 100.
    A waiting process blocks in ``flock`` and wakes as soon as the holder releases, instead of polling.
    Re-entry by the thread that holds the lock is allowed, as with ``filelock``.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, _HeldLock] = {}

    @contextmanager
    def hold(self, path: Path) -> Iterator[None]:
        """Hold the lock of ``path`` for the duration of the block."""
        key = str(path)
        with self._guard:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _HeldLock(threading.RLock())
            held.users += 1
        try:
            with held.thread_lock:
                if held.depth == 0:
                    held.fd = self._lock_file(key)
                held.depth += 1
                try:
                    yield
                finally:
                    held.depth -= 1
                    if held.depth == 0:
                        fd, held.fd = held.fd, -1
                        os.close(fd)
        finally:
            with self._guard:
                held.users -= 1
                if held.users == 0:
                    del self._held[key]

    @staticmethod
    def _lock_file(path: str) -> int:
        """Open the lock file (never removed, so every locker shares one inode) and wait for its ``flock``."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd


class TokenCaptureStore:
    """Durable, rollout-keyed JSONL sink and source for ``TokenEntry`` records.

    Writers to the same rollout are serialized by a file lock; different rollouts write concurrently.
    Async methods run their blocking work in a thread, never on the event loop.
    """

    def __init__(self, root: str | Path) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._commit = GroupCommitter(filesystem_sync_for(self._root))
        self._deferral = threading.local()
        self._writes = WriteQueue(self._run_without_own_barrier, self._barrier, name="tokcap-store-writer")
        self._rollout_locks = _RolloutLocks()
        self._call_ids_of_written_lines: dict[str, str] = {}
        self._paths: dict[tuple[str, str], Path] = {}

    @property
    def commit_stats(self) -> dict[str, int]:
        """How many filesystem syncs this store instance has run; benchmarks report it."""
        return {"syncs": self._commit.syncs}

    async def _in_thread(self, function: Callable[..., _Result], *args: Any, urgent: bool = False) -> _Result:
        """Run blocking file work off the event loop, on the store's writer thread.

        Operations queued together run as one batch that shares one durability barrier;
        each caller resumes only after that barrier, so each still returns only once durable.
        Source operations are urgent: they go ahead of queued writes.
        """
        return await self._writes.submit(function, *args, urgent=urgent)

    def _run_without_own_barrier(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one queued operation; its writes become durable at the end of its batch."""
        self._deferral.barrier_deferred = True
        try:
            return function(*args)
        finally:
            self._deferral.barrier_deferred = False

    # ------------------------------------------------------------ durability

    def _append(self, path: Path, data: bytes) -> int:
        """Append one line; it becomes durable at the operation's barrier, before the caller returns."""
        start = append_durably(path, data, durable=False)
        self._commit.note_write()
        return start

    def _barrier(self) -> None:
        """Wait until every write noted so far is durable, sharing one sync with concurrent writers."""
        self._commit.wait_durable()

    def _forced_barrier(self) -> None:
        """Sync even if this instance wrote nothing: another process may have removed files without syncing yet."""
        self._commit.note_write()
        self._commit.wait_durable()

    def _end_of_operation(self) -> None:
        """Make the operation durable now, unless its batch (writer thread or materializer) does it later."""
        if not getattr(self._deferral, "active", False) and not getattr(
            self._deferral, "barrier_deferred", False
        ):
            self._barrier()

    @contextmanager
    def deferred_durability(self) -> Iterator[None]:
        """Apply many events and make them durable together at the end of the block.

        Inside the block, operations return before their writes are durable.
        Ordering barriers (a fence before the removals it guards) still sync at once.
        Puts, intents and cancels keep their rollout's state in memory for the rest of the block;
        their non-durable state changes (index, last position) are written once per rollout at its end.
        Any other event first writes that state out and reads the file, as outside a block.
        Only a single-writer projection that records its own checkpoint after the block should use this.
        """
        previous = getattr(self._deferral, "active", False)
        self._deferral.active = True
        if not previous:
            self._deferral.states = {}
            self._deferral.dirty = set()
        try:
            yield
        finally:
            self._deferral.active = previous
            if not previous:
                states: dict[str, RolloutState] = self._deferral.states
                dirty: set[str] = self._deferral.dirty
                self._deferral.states, self._deferral.dirty = {}, set()
        if not previous:
            for rollout_id in sorted(dirty):
                with self._locked(rollout_id):
                    self._replace_state_file(states[rollout_id])
            self._barrier()

    def _deferred_state(self, rollout_id: str, event: Event) -> RolloutState:
        """The state an event applies to inside a deferred block; the caller holds the rollout's lock.

        Puts, intents and cancels reuse the state earlier events of the block left in memory.
        Any other event writes that state out first, so it reads, and acts on, exactly what is on disk.
        """
        states: dict[str, RolloutState] = self._deferral.states
        if isinstance(event, PutEvent | IntentEvent | CancelEvent):
            state = states.get(rollout_id)
            if state is None:
                state = states[rollout_id] = self._read_state(rollout_id)
            return state
        cached = states.pop(rollout_id, None)
        if cached is not None and rollout_id in self._deferral.dirty:
            self._deferral.dirty.discard(rollout_id)
            self._replace_state_file(cached)
        return self._read_state(rollout_id)

    def _index_write_due(self, state: RolloutState, lagging_lines: int, position: LogPosition | None) -> bool:
        """Decide whether an index-only change is written now.

        Applied from a log, it is written at once (inside a deferred block: at the end of the block),
        so the state a projection leaves depends only on the log.
        Otherwise it is written every ``INDEX_FLUSH_ENTRIES`` entries, or when the rollout has no state file yet.
        """
        if position is not None or getattr(self._deferral, "active", False):
            return True
        return lagging_lines >= INDEX_FLUSH_ENTRIES or not self.state_path_for(state.rollout_id).exists()

    @property
    def root(self) -> Path:
        """The directory holding every rollout's files."""
        return self._root

    # ----------------------------------------------------------------- paths

    def _path(self, rollout_id: str, suffix: str) -> Path:
        """A rollout's file; paths are remembered because building them showed up in every operation's profile."""
        key = (rollout_id, suffix)
        path = self._paths.get(key)
        if path is None:
            if len(self._paths) >= _REMEMBERED_PATHS:
                self._paths.clear()
            path = self._paths[key] = self._root / f"{validate_rollout_id(rollout_id)}{suffix}"
        return path

    def path_for(self, rollout_id: str) -> Path:
        """The rollout's JSONL file of entries."""
        return self._path(rollout_id, ENTRIES_SUFFIX)

    def state_path_for(self, rollout_id: str) -> Path:
        """The rollout's state index."""
        return self._path(rollout_id, STATE_SUFFIX)

    def intents_path_for(self, rollout_id: str) -> Path:
        """The rollout's durable per-call intents."""
        return self._path(rollout_id, INTENTS_SUFFIX)

    def incomplete_path_for(self, rollout_id: str) -> Path:
        """Marker that at least one call of this rollout failed to capture."""
        return self._path(rollout_id, INCOMPLETE_SUFFIX)

    def lock_path_for(self, rollout_id: str) -> Path:
        """The rollout's file lock."""
        return self._path(rollout_id, LOCK_SUFFIX)

    def fence_path_for(self, rollout_id: str) -> Path:
        """The fence that outlives retire and drop and refuses late writes."""
        return self._path(rollout_id, FENCE_SUFFIX)

    # --------------------------------------------------------------- locking

    @contextmanager
    def _locked(self, rollout_id: str) -> Iterator[None]:
        """Hold the rollout's exclusive file lock; it serializes threads and processes alike."""
        with self._rollout_locks.hold(self.lock_path_for(rollout_id)):
            yield

    # ----------------------------------------------------------------- state

    def _read_state(self, rollout_id: str) -> RolloutState:
        """Load the rollout's state; a fence always wins, so a crashed retire still refuses writes."""
        state_path = self.state_path_for(rollout_id)
        fence_path = self.fence_path_for(rollout_id)
        state: RolloutState | None = None
        try:
            state = RolloutState.decode(state_path.read_bytes(), str(state_path))
        except FileNotFoundError:
            state = None
        if state is not None and state.retired:
            return state
        try:
            fence_bytes = fence_path.read_bytes()
        except FileNotFoundError:
            return state if state is not None else RolloutState(rollout_id=rollout_id)
        return RolloutState.decode(fence_bytes, str(fence_path))

    def _write_state(self, state: RolloutState, *, durable: bool) -> None:
        """Replace the state file atomically; a durable change is synced before the operation returns.

        A non-durable change (a new entry's index) can be rebuilt from the JSONL tail after a crash.
        Inside a deferred block, a non-durable change to a state the block keeps in memory waits for its end.
        """
        deferred = (
            getattr(self._deferral, "active", False) and self._deferral.states.get(state.rollout_id) is state
        )
        if deferred and not durable:
            self._deferral.dirty.add(state.rollout_id)
            return
        if deferred:
            self._deferral.dirty.discard(state.rollout_id)
        self._replace_state_file(state)
        if durable:
            self._commit.note_write()

    def _replace_state_file(self, state: RolloutState) -> None:
        replace_atomically(self.state_path_for(state.rollout_id), state.encode(), durable=False)

    def _sync_entry_index(self, state: RolloutState) -> int:
        """Reconcile the entry index with the JSONL tail; return how many lines were indexed.

        The entry line is the durable record; the index in the state file may lag behind it,
        after a crash or because index-only updates are written every few entries (``INDEX_FLUSH_ENTRIES``).
        Only the tail past ``indexed_size`` is parsed, and only for its call id and digest.
        A torn final line (no newline) was never acknowledged and is cut off.
        A malformed line followed by more content is corruption and raises.
        """
        path = self.path_for(state.rollout_id)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size == state.indexed_size:
            return 0
        if size < state.indexed_size:
            raise StoreCorruptionError(
                f"{path} is {size} bytes but {state.indexed_size} bytes were indexed; the file was truncated "
                "outside tokcap; restore it from a backup or delete the rollout",
                rollout_id=state.rollout_id,
            )
        with path.open("rb") as handle:
            handle.seek(state.indexed_size)
            tail = handle.read()
        pieces = tail.split(b"\n")
        complete, remainder = pieces[:-1], pieces[-1]
        consumed = 0
        indexed_lines = 0
        for index, line in enumerate(complete):
            digest = entry_digest(line)
            known_call_id = self._call_ids_of_written_lines.get(digest)
            try:
                call_id = known_call_id if known_call_id is not None else _call_id_of_line(line)
            except RecordValidationError as exc:
                if type(exc) is not RecordValidationError:
                    raise
                is_last = index == len(complete) - 1 and not remainder
                if is_last:
                    break
                raise StoreCorruptionError(
                    f"{path} has a malformed line at byte {state.indexed_size + consumed} followed by more "
                    f"content: {exc}; the file is corrupt",
                    rollout_id=state.rollout_id,
                ) from exc
            state.entry_digests[call_id] = digest
            consumed += len(line) + 1
            indexed_lines += 1
        indexed = state.indexed_size + consumed
        if indexed != size:
            logger.warning(
                "rollout %s: cutting %d unacknowledged bytes of a torn final line from %s",
                state.rollout_id,
                size - indexed,
                path,
            )
            with path.open("r+b") as handle:
                handle.truncate(indexed)
                os.fsync(handle.fileno())
        state.indexed_size = indexed
        return indexed_lines

    def _remember_written_line(self, digest: str, call_id: str) -> None:
        """Remember the call id of a line this store appended, keyed by the line's sha256.

        Re-indexing a lagging tail then hashes each line instead of parsing it: equal digests mean equal bytes,
        so the call id is the one this store wrote. Bounded: forgotten lines are simply parsed again.
        """
        if len(self._call_ids_of_written_lines) >= _REMEMBERED_LINES:
            self._call_ids_of_written_lines.clear()
        self._call_ids_of_written_lines[digest] = call_id

    def _intent_status(self, rollout_id: str) -> dict[str, str]:
        """Last intent/cancel operation per call id."""
        status: dict[str, str] = {}
        for record in self._read_json_lines(self.intents_path_for(rollout_id)):
            status[str(record["model_call_id"])] = str(record["op"])
        return status

    def _incomplete_marks(self, rollout_id: str) -> list[dict[str, Any]]:
        return self._read_json_lines(self.incomplete_path_for(rollout_id))

    @staticmethod
    def _read_json_lines(path: Path) -> list[dict[str, Any]]:
        """Parse a small append-only side file; a torn last line was never acknowledged."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        records: list[dict[str, Any]] = []
        for index, line in enumerate(lines):
            if not line:
                continue
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                if index == len(lines) - 1:
                    break
                raise StoreCorruptionError(f"{path} has a malformed line {index + 1}: {exc}") from exc
        return records

    # ------------------------------------------------------------- the apply step

    def apply(self, event: Event, position: LogPosition | None = None) -> ApplyResult:
        """Apply one event under the rollout's lock; the only way the store changes.

        With a log position, an event at or before the rollout's last applied position is skipped,
        so a resumed materializer never applies anything twice.
        Rejections are returned, never raised; the file store's methods raise them to their callers.
        """
        rollout_id = validate_rollout_id(event.rollout_id)
        with self._locked(rollout_id):
            if getattr(self._deferral, "active", False):
                state = self._deferred_state(rollout_id, event)
            else:
                state = self._read_state(rollout_id)
            if state.retired and self._retire_unfinished(rollout_id):
                self._finish_retire_unlocked(state)
            if self._is_interrupted_delete(state, event, position):
                self._remove_delete_leftovers(rollout_id)
            if state.already_applied(position):
                return ApplyResult(ApplyOutcome.ALREADY_APPLIED, event.type, rollout_id)
            result = self._dispatch(state, event, position)
            self._end_of_operation()
            return result

    def _dispatch(self, state: RolloutState, event: Event, position: LogPosition | None) -> ApplyResult:
        """Route an event to the rule that applies it; the caller holds the lock."""
        rollout_id = state.rollout_id
        if isinstance(event, PutEvent):
            return self._apply_put(state, event.entry, position)
        if isinstance(event, IntentEvent | CancelEvent):
            return self._apply_intent_op(state, event, position)
        if isinstance(event, IncompleteEvent):
            return self._apply_incomplete(state, event, position)
        if isinstance(event, FreezeEvent):
            return self._apply_freeze(state, position)
        if isinstance(event, DropEvent):
            return self._apply_drop(state, event, position)
        if isinstance(event, RetireEvent):
            return self._apply_retire(state, position)
        if isinstance(event, DeleteEvent):
            return self._apply_delete(rollout_id, position)
        raise InvalidInputError(f"cannot apply an event of type {type(event).__name__}")

    def _reject_late(
        self, state: RolloutState, event_type: EventType, call_id: str, position: LogPosition | None
    ) -> ApplyResult:
        """Record a write that raced the freeze and move the version, so the stale snapshot is kept."""
        position_dict = position.to_dict() if position is not None else None
        state.rejections.append(
            Rejection(event_type=event_type.value, model_call_id=call_id, position=position_dict)
        )
        state.version += 1
        state.record_position(position)
        self._write_state(state, durable=True)
        return ApplyResult(
            ApplyOutcome.REJECTED_AFTER_FREEZE,
            event_type,
            state.rollout_id,
            call_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            detail=f"{event_type.value} arrived after the freeze of snapshot {state.snapshot_id}",
        )

    def _retired_result(self, state: RolloutState, event_type: EventType, call_id: str = "") -> ApplyResult:
        return ApplyResult(
            ApplyOutcome.REJECTED_RETIRED,
            event_type,
            state.rollout_id,
            call_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            detail="the rollout is retired; its fence refuses late writes",
        )

    def _apply_put(self, state: RolloutState, entry: TokenEntry, position: LogPosition | None) -> ApplyResult:
        call_id = entry.model_call_id
        if state.retired:
            return self._retired_result(state, EventType.PUT, call_id)
        lagging_lines = self._sync_entry_index(state)
        canonical = entry.canonical_json()
        digest = entry_digest(canonical)
        known = state.entry_digests.get(call_id)
        if known == digest:
            if lagging_lines and self._index_write_due(state, lagging_lines, position):
                self._write_state(state, durable=False)
            return ApplyResult(
                ApplyOutcome.NOOP, EventType.PUT, state.rollout_id, call_id, detail="same payload"
            )
        if not state.is_open:
            return self._reject_late(state, EventType.PUT, call_id, position)
        if known is not None:
            self._add_incomplete_mark(state, call_id, "conflicting payload for a call id already stored")
            state.record_position(position)
            self._write_state(state, durable=True)
            return ApplyResult(
                ApplyOutcome.CONFLICT,
                EventType.PUT,
                state.rollout_id,
                call_id,
                detail="a different payload was already stored for this call id; the rollout is incomplete",
            )
        start = self._append(self.path_for(state.rollout_id), canonical + b"\n")
        if start != state.indexed_size:
            raise StoreCorruptionError(
                f"{self.path_for(state.rollout_id)} grew outside the rollout lock (expected {state.indexed_size} "
                f"bytes, found {start}); another program is writing to the store",
                rollout_id=state.rollout_id,
                model_call_id=call_id,
            )
        state.entry_digests[call_id] = digest
        state.indexed_size = start + len(canonical) + 1
        self._remember_written_line(digest, call_id)
        if self._index_write_due(state, lagging_lines + 1, position):
            self._write_state(state, durable=False)
        return ApplyResult(ApplyOutcome.ACCEPTED, EventType.PUT, state.rollout_id, call_id)

    def _apply_intent_op(
        self, state: RolloutState, event: IntentEvent | CancelEvent, position: LogPosition | None
    ) -> ApplyResult:
        op = event.type.value
        call_id = event.model_call_id
        if state.retired:
            return self._retired_result(state, event.type, call_id)
        if self._intent_status(state.rollout_id).get(call_id) == op:
            if position is not None:
                # A resumed materializer re-applies an intent whose state write a crash lost; record it now.
                state.record_position(position)
                self._write_state(state, durable=False)
            return ApplyResult(
                ApplyOutcome.NOOP, event.type, state.rollout_id, call_id, detail=f"{op} already recorded"
            )
        if not state.is_open:
            return self._reject_late(state, event.type, call_id, position)
        line = orjson.dumps({"model_call_id": call_id, "op": op}, option=orjson.OPT_SORT_KEYS) + b"\n"
        self._append(self.intents_path_for(state.rollout_id), line)
        if position is not None:
            state.record_position(position)
            self._write_state(state, durable=False)
        return ApplyResult(ApplyOutcome.ACCEPTED, event.type, state.rollout_id, call_id)

    def _add_incomplete_mark(self, state: RolloutState, call_id: str, reason: str) -> None:
        """Durably mark the rollout incomplete; a repeated identical mark adds no line."""
        mark = {"model_call_id": call_id, "reason": reason}
        if mark not in self._incomplete_marks(state.rollout_id):
            line = orjson.dumps(mark, option=orjson.OPT_SORT_KEYS) + b"\n"
            self._append(self.incomplete_path_for(state.rollout_id), line)
        state.incomplete = True

    def _apply_incomplete(
        self, state: RolloutState, event: IncompleteEvent, position: LogPosition | None
    ) -> ApplyResult:
        call_id = event.model_call_id
        if state.retired:
            return self._retired_result(state, EventType.INCOMPLETE, call_id)
        self._add_incomplete_mark(state, call_id, event.reason)
        late = not state.is_open
        if late:
            state.version += 1
        state.record_position(position)
        self._write_state(state, durable=late)
        return ApplyResult(
            ApplyOutcome.ACCEPTED,
            EventType.INCOMPLETE,
            state.rollout_id,
            call_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            detail="late incomplete after freeze; version moved" if late else "",
        )

    def _apply_freeze(self, state: RolloutState, position: LogPosition | None) -> ApplyResult:
        if state.retired:
            return self._retired_result(state, EventType.FREEZE)
        index_changed = self._sync_entry_index(state)
        if not state.is_open:
            if index_changed:
                self._write_state(state, durable=False)
            return ApplyResult(
                ApplyOutcome.NOOP,
                EventType.FREEZE,
                state.rollout_id,
                snapshot_id=state.snapshot_id,
                version=state.version,
                detail="already frozen",
            )
        status = self._intent_status(state.rollout_id)
        dangling = sorted(
            call_id for call_id, op in status.items() if op == "intent" and call_id not in state.entry_digests
        )
        state.dangling_intents = dangling
        state.incomplete = (
            state.incomplete or bool(dangling) or bool(self._incomplete_marks(state.rollout_id))
        )
        state.snapshot_id = _snapshot_id_for(position)
        state.advance(Lifecycle.FROZEN)
        state.version += 1
        state.record_position(position)
        self._write_state(state, durable=True)
        return ApplyResult(
            ApplyOutcome.ACCEPTED,
            EventType.FREEZE,
            state.rollout_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
        )

    def _apply_drop(self, state: RolloutState, event: DropEvent, position: LogPosition | None) -> ApplyResult:
        matches = state.snapshot_id == event.snapshot_id and state.version == event.version
        if state.retired or state.is_open or not matches:
            dropped = state.retired and matches
            return ApplyResult(
                ApplyOutcome.NOOP,
                EventType.DROP,
                state.rollout_id,
                snapshot_id=state.snapshot_id,
                version=state.version,
                dropped=dropped,
                detail="already dropped" if dropped else "the rollout is not in that exact frozen state",
            )
        removed = self._retire_locked(state, position)
        return ApplyResult(
            ApplyOutcome.ACCEPTED,
            EventType.DROP,
            state.rollout_id,
            snapshot_id=state.snapshot_id,
            version=state.version,
            dropped=True,
            removed=removed,
        )

    def _apply_retire(self, state: RolloutState, position: LogPosition | None) -> ApplyResult:
        if state.retired:
            return ApplyResult(ApplyOutcome.NOOP, EventType.RETIRE, state.rollout_id, removed=False)
        removed = self._retire_locked(state, position)
        return ApplyResult(ApplyOutcome.ACCEPTED, EventType.RETIRE, state.rollout_id, removed=removed)

    def _retire_locked(self, state: RolloutState, position: LogPosition | None) -> bool:
        """Fence, make the fence durable, then remove the records; return whether anything was removed."""
        had_records = self._has_records(state.rollout_id)
        state.removed_records = had_records
        self._write_fence_unlocked(state, position)
        self._barrier()
        self._finish_retire_unlocked(state)
        return had_records

    @staticmethod
    def _is_interrupted_delete(state: RolloutState, event: Event, position: LogPosition | None) -> bool:
        """True when this very delete was applied before, up to its fresh state, and may have left files.

        Only the re-applied delete itself finishes the removals: any later event of the rollout may own
        the files by now.
        """
        return (
            isinstance(event, DeleteEvent)
            and position is not None
            and state.is_pristine
            and state.last_position == position.to_dict()
        )

    def _retire_unfinished(self, rollout_id: str) -> bool:
        """True when a fence exists but a crash stopped the retire before its records were removed."""
        try:
            data = self.state_path_for(rollout_id).read_bytes()
        except FileNotFoundError:
            return True
        return not RolloutState.decode(data, str(self.state_path_for(rollout_id))).retired

    def _write_fence_unlocked(self, state: RolloutState, position: LogPosition | None) -> None:
        """Turn the state into its retired form and write it as the fence, fsynced."""
        state.advance(Lifecycle.RETIRED)
        state.record_position(position)
        replace_atomically(self.fence_path_for(state.rollout_id), state.encode(), durable=False)
        self._commit.note_write()

    def _finish_retire_unlocked(self, state: RolloutState) -> None:
        """Remove payloads and record the retired state; safe to repeat after a crash."""
        self._remove_record_files(state.rollout_id)
        state.entry_digests = {}
        state.indexed_size = 0
        self._write_state(state, durable=True)

    def _has_records(self, rollout_id: str) -> bool:
        """Whether the rollout holds anything a retire or delete would remove.

        An empty open state left by a log-applied delete holds nothing.
        """
        record_paths = (
            self.path_for(rollout_id),
            self.intents_path_for(rollout_id),
            self.incomplete_path_for(rollout_id),
        )
        if any(path.exists() for path in record_paths):
            return True
        try:
            data = self.state_path_for(rollout_id).read_bytes()
        except FileNotFoundError:
            return False
        return not RolloutState.decode(data, str(self.state_path_for(rollout_id))).is_pristine

    def _remove_record_files(self, rollout_id: str) -> bool:
        """Remove a rollout's entries, intents and incomplete marker, whichever exist."""
        removed = False
        for path in (
            self.path_for(rollout_id),
            self.intents_path_for(rollout_id),
            self.incomplete_path_for(rollout_id),
        ):
            removed = remove_if_exists(path) or removed
        if removed:
            self._commit.note_write()
        return removed

    def _apply_delete(self, rollout_id: str, position: LogPosition | None) -> ApplyResult:
        """Forget the rollout; applied from a log, leave an empty open state that remembers the delete.

        That state keeps a resumed materializer from applying the delete twice and lets a source in another
        process read the verdict; the rollout id is reusable and starts empty either way.
        """
        if position is None:
            removed = self._delete_unlocked(rollout_id)
        else:
            # The fresh state replaces the old one first and carries the verdict, so a crash anywhere below
            # leaves the same verdict, and re-applying this delete only finishes the removals.
            removed = self._has_records(rollout_id) or self.fence_path_for(rollout_id).exists()
            fresh = RolloutState(rollout_id=rollout_id, removed_records=removed)
            fresh.record_position(position)
            self._write_state(fresh, durable=True)
            self._barrier()
            self._remove_delete_leftovers(rollout_id)
        self._forced_barrier()
        return ApplyResult(
            ApplyOutcome.ACCEPTED if removed else ApplyOutcome.NOOP,
            EventType.DELETE,
            rollout_id,
            removed=removed,
        )

    def _remove_delete_leftovers(self, rollout_id: str) -> None:
        """Remove what a log-applied delete removes besides the state it replaced; safe to repeat."""
        removed_files = self._remove_record_files(rollout_id)
        if remove_if_exists(self.fence_path_for(rollout_id)) or removed_files:
            self._commit.note_write()

    def _delete_unlocked(self, rollout_id: str) -> bool:
        """Remove every file of the rollout but its lock; return whether it held records or a fence."""
        had_anything = self._has_records(rollout_id) or self.fence_path_for(rollout_id).exists()
        removed_files = self._remove_record_files(rollout_id)
        for path in (self.state_path_for(rollout_id), self.fence_path_for(rollout_id)):
            removed_files = remove_if_exists(path) or removed_files
        if removed_files:
            self._commit.note_write()
        return had_anything

    # ------------------------------------------------------------------ reads

    def _read_entries_unlocked(self, rollout_id: str, state: RolloutState) -> list[TokenEntry]:
        if state.retired or state.indexed_size == 0:
            return []
        with self.path_for(rollout_id).open("rb") as handle:
            data = handle.read(state.indexed_size)
        return [TokenEntry.from_json(line) for line in data.split(b"\n") if line]

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """Every accepted entry of a rollout, in file order (which carries no meaning)."""
        with self._locked(rollout_id):
            state = self._read_state(rollout_id)
            if self._sync_entry_index(state) >= INDEX_FLUSH_ENTRIES:
                self._write_state(state, durable=False)
            return self._read_entries_unlocked(rollout_id, state)

    def read_state(self, rollout_id: str) -> RolloutState:
        """The rollout's current state, reconciled with its JSONL tail."""
        with self._locked(rollout_id):
            state = self._read_state(rollout_id)
            if not state.retired and self._sync_entry_index(state) >= INDEX_FLUSH_ENTRIES:
                self._write_state(state, durable=False)
            return state

    def reconcile_indexes(self) -> int:
        """Bring every rollout's state index up to date with its JSONL file; return how many were rewritten.

        A projection calls this when it stops, so the state files it leaves depend only on the events applied,
        not on where index-only writes happened to fall.
        """
        rewritten = 0
        for rollout_id in self.rollout_ids():
            with self._locked(rollout_id):
                state = self._read_state(rollout_id)
                if state.retired:
                    continue
                lagging = self._sync_entry_index(state)
                if lagging or (state.indexed_size and not self.state_path_for(rollout_id).exists()):
                    self._write_state(state, durable=True)
                    rewritten += 1
        self._barrier()
        return rewritten

    def snapshot(self, rollout_id: str) -> TokenCaptureSnapshot:
        """The frozen snapshot of a rollout that is already frozen; used after a freeze applied elsewhere."""
        with self._locked(rollout_id):
            return self._snapshot_locked(rollout_id)

    def _snapshot_locked(self, rollout_id: str) -> TokenCaptureSnapshot:
        state = self._read_state(rollout_id)
        if state.retired:
            raise RolloutRetiredError(
                f"rollout {rollout_id!r} is retired (snapshot {state.snapshot_id}); its records are gone. "
                "Delete it before reusing the id",
                rollout_id=rollout_id,
            )
        if state.is_open:
            raise InvalidInputError(
                f"rollout {rollout_id!r} is not frozen; freeze it first", rollout_id=rollout_id
            )
        if self._sync_entry_index(state) >= INDEX_FLUSH_ENTRIES:
            self._write_state(state, durable=False)
        entries = tuple(self._read_entries_unlocked(rollout_id, state))
        assert state.snapshot_id is not None
        return TokenCaptureSnapshot(
            rollout_id=rollout_id,
            entries=entries,
            incomplete=state.incomplete or self.incomplete_path_for(rollout_id).exists(),
            snapshot_id=state.snapshot_id,
            version=state.version,
        )

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether any call of the rollout failed to capture (or, once frozen, was left dangling)."""
        if self.incomplete_path_for(rollout_id).exists():
            return True
        with self._locked(rollout_id):
            return self._read_state(rollout_id).incomplete

    def rollout_ids(self) -> list[str]:
        """Every rollout id that has a state, entries, intents, marker or fence here, sorted."""
        ids: set[str] = set()
        for path in self._root.iterdir():
            for suffix in (ENTRIES_SUFFIX, STATE_SUFFIX, INTENTS_SUFFIX, INCOMPLETE_SUFFIX, FENCE_SUFFIX):
                if path.name.endswith(suffix):
                    ids.add(path.name[: -len(suffix)])
        return sorted(ids)

    # ------------------------------------------------------ sink, synchronous

    def _raise_for(self, result: ApplyResult) -> None:
        """Turn a rejection into the error the spec's callers catch."""
        rollout_id, call_id = result.rollout_id, result.model_call_id
        if result.outcome is ApplyOutcome.REJECTED_AFTER_FREEZE:
            raise RolloutFrozenError(
                f"rollout {rollout_id!r} is frozen (snapshot {result.snapshot_id}); {result.event_type.value} "
                f"for call {call_id!r} was rejected and is not part of the snapshot. A write racing the freeze "
                "means an attempt was still running; the version moved so the stale snapshot is kept",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )
        if result.outcome is ApplyOutcome.REJECTED_RETIRED:
            raise RolloutRetiredError(
                f"rollout {rollout_id!r} is retired; {result.event_type.value} for call {call_id!r} was refused by "
                "its fence. Delete the rollout before reusing its id",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )
        if result.outcome is ApplyOutcome.CONFLICT:
            raise ConflictingEntryError(
                f"call {call_id!r} of rollout {rollout_id!r} was already stored with a different payload; "
                "the rollout is marked incomplete and will be masked",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )

    def append(self, entry: TokenEntry) -> None:
        """Idempotently append one entry and fsync it before returning."""
        self._raise_for(self.apply(PutEvent(rollout_id=entry.rollout_id, entry=entry)))

    def begin_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that a call is about to be dispatched; a lost entry then masks the rollout."""
        self._raise_for(self.apply(IntentEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def cancel_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably close an intent whose call ended without generation."""
        self._raise_for(self.apply(CancelEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def mark_incomplete_now(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Durably record that a call was lost."""
        self._raise_for(
            self.apply(IncompleteEvent(rollout_id=rollout_id, model_call_id=model_call_id, reason=reason))
        )

    # ---------------------------------------------------- source, synchronous

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze one rollout and return its stable snapshot; freezing again returns the same snapshot."""
        rollout_id = validate_rollout_id(rollout_id)
        with self._locked(rollout_id):
            state = self._read_state(rollout_id)
            result = self._apply_freeze(state, None)
            self._raise_for(result)
            self._barrier()
            return self._snapshot_locked(rollout_id)

    def drop_now(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot if nothing changed since; keep the fence either way."""
        result = self.apply(DropEvent(rollout_id=rollout_id, snapshot_id=snapshot_id, version=version))
        return bool(result.dropped)

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove records and keep fences, whatever the state, in two phases.

        Phase one writes every missing fence, then syncs the directory, even when it wrote none:
        a fence found here may come from an overlapping retire that has not synced yet.
        Phase two removes the records and syncs again, so nothing is removed before its fence is durable.
        """
        ids = validate_rollout_ids(rollout_ids)
        if not ids:
            return RolloutRemovalPayload()
        had_records: dict[str, bool] = {}
        for rollout_id in ids:
            with self._locked(rollout_id):
                state = self._read_state(rollout_id)
                had_records[rollout_id] = not state.retired and self._has_records(rollout_id)
                if not self.fence_path_for(rollout_id).exists():
                    self._write_fence_unlocked(state, None)
        self._forced_barrier()
        for rollout_id in ids:
            with self._locked(rollout_id):
                state = self._read_state(rollout_id)
                self._finish_retire_unlocked(state)
        self._barrier()
        return RolloutRemovalPayload(
            removed=tuple(rid for rid in ids if had_records[rid]),
            not_found=tuple(rid for rid in ids if not had_records[rid]),
        )

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove records and fences so the ids can be reused; repeat deletes are no-ops.

        The directory is synced before returning even when nothing was found: an overlapping delete may
        have removed the files without syncing yet, and a reused id must not see old files return after a crash.
        """
        ids = validate_rollout_ids(rollout_ids)
        if not ids:
            return RolloutRemovalPayload()
        removed: dict[str, bool] = {}
        for rollout_id in ids:
            with self._locked(rollout_id):
                removed[rollout_id] = self._delete_unlocked(rollout_id)
        self._forced_barrier()
        return RolloutRemovalPayload(
            removed=tuple(rid for rid in ids if removed[rid]),
            not_found=tuple(rid for rid in ids if not removed[rid]),
        )

    # --------------------------------------------------------- async surface

    async def put(self, entry: TokenEntry) -> None:
        """Store an entry durably without blocking the event loop."""
        await self._in_thread(self.append, entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record a call's intent before dispatch; a failure here happens before generation."""
        await self._in_thread(self.begin_call_now, rollout_id, model_call_id)

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Close a call's intent when it ended without generation."""
        await self._in_thread(self.cancel_call_now, rollout_id, model_call_id)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Durably record that a call was lost."""
        await self._in_thread(self.mark_incomplete_now, rollout_id, model_call_id, reason)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze a rollout and return its snapshot without blocking the event loop."""
        return await self._in_thread(self.freeze_now, rollout_id, urgent=True)

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact consumed snapshot, keeping its fence."""
        return await self._in_thread(self.drop_now, rollout_id, snapshot_id, version, urgent=True)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and keep fences, whatever their state; retiring again is a no-op."""
        return await self._in_thread(self.retire_now, rollout_ids, urgent=True)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' records and fences so ids can be reused; deleting again is a no-op."""
        return await self._in_thread(self.delete_now, rollout_ids, urgent=True)

    async def close(self) -> None:
        """Finish queued operations and stop the writer thread; no files stay open, and closing again is a no-op."""
        await asyncio.to_thread(self._writes.close)

    # ------------------------------------------------ read API for transports (h-kafka; lead to reconcile)
    # Transports ask these instead of reading the store's files, so they never learn its file names.

    def holds_anything(self, rollout_id: str) -> bool:
        """Whether the rollout has anything a delete would remove: records, state or a fence."""
        return not self.read_state(rollout_id).is_pristine or self.fence_path_for(rollout_id).exists()

    def has_incomplete_mark(self, rollout_id: str, model_call_id: str, reason: str) -> bool:
        """Whether this exact incomplete mark was already applied; guards marks applied without a log position."""
        wanted = {"model_call_id": model_call_id, "reason": reason}
        return any(mark == wanted for mark in self._incomplete_marks(rollout_id))


def make_token_store(global_config_dict: Any) -> TokenCaptureStore | None:
    """Build the training-token file store from a global config.

    Return ``None`` when capture is disabled, when a custom sink owns the records, or when no directory resolves.
    """
    from tokcap.config import token_id_capture_config

    config = token_id_capture_config(global_config_dict)
    if not config.enabled or config.token_id_capture.sink:
        return None
    directory = config.resolved_dir()
    if directory is None:
        return None
    return TokenCaptureStore(directory)
