"""The file store: a durable, rollout-keyed projection of capture events.

It carries out the decisions of ``tokcap.log.rules``; it holds no rule of its own. It serves a directory several
processes may write (Gym's store among them): the files are the truth, so every operation builds an event,
recovers the rollout's state from the files (``tokcap.files.recovery``; cached only while the files are exactly as
the store left them), asks ``tokcap.log.rules.decide`` what the event does, and carries out the effects in order.
Every file operation, the effects' interpreter included, is ``tokcap.files.rollout_files``'s, which a single writer
that owns its directory and keeps the truth in memory (``tokcap.files.log_projection``) stands on too. File names
live in ``tokcap.files.layout``, the writer thread's batches in ``tokcap.files.write_queue``.

Durability:

- Every entry, intent and incomplete line is synced before its call returns.
- The state file is replaced atomically; it is synced on lifecycle transitions and late changes.
  Index-only changes may lag: the file tails past the state are folded in when the rollout is next read.
- Retire makes the retired state (the fence) durable before removing records, and syncs before it returns.
- Delete syncs the directory before it returns, even when it found nothing.

Reads never write: they recover the state in memory and leave repairs to the next writer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tokcap.errors import (
    ConflictingEntryError,
    RolloutFrozenError,
    RolloutRetiredError,
    StoreWriteError,
)
from tokcap.files.kept_entries import KEPT_ENTRY_TOKENS, KeptEntries
from tokcap.files.layout import (
    ENTRIES_SUFFIX,
    INCOMPLETE_SUFFIX,
    INTENTS_SUFFIX,
    LOCK_SUFFIX,
    STATE_SUFFIX,
    RolloutPaths,
    rollout_ids_in,
)
from tokcap.files.recovery import Recovered
from tokcap.files.rollout_files import (
    AcceptedEntries,
    FilesIdentity,
    RolloutFiles,
    appended_entry,
    files_identity,
    snapshot_from,
)
from tokcap.files.write_queue import WriteQueue
from tokcap.log.checked_puts import accept_put
from tokcap.log.events import (
    CancelEvent,
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
    StageEvent,
)
from tokcap.log.input_rules import check_call_id
from tokcap.log.records import TokenEntry
from tokcap.log.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.log.rules import (
    ApplyOutcome,
    ApplyResult,
    Decision,
    decide,
    is_marked_incomplete,
)
from tokcap.log.state import IncompleteMark, IntentOp, RolloutState
from tokcap.metrics import sink_timed, source_timed
from tokcap.protocols import RolloutRemovalPayload, TokenCaptureSnapshot

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

logger = logging.getLogger(__name__)

INDEX_FLUSH_ENTRIES = 16
"""Index-only state updates of the file store are written once this many lines lag behind the files.

Renaming a state file over the old one costs about as much as an fsync on ext4 (it flushes the new file's
data first); the lines are the durable record and the index is rebuilt from the tails, so writes skip most
index writes and never parse more than this many lines. At 16 an 8-turn rollout (an intent and an entry line
per turn) renames its state once before its freeze instead of twice; a reader in another process parses at
most 16 lines it did not write (about 1.5 ms at 3k tokens per entry).
"""

_Result = TypeVar("_Result")

_REMEMBERED_STATES = 4_096
"""How many recovered rollout states a store keeps, to skip parsing a state file no one changed."""


class TokenCaptureStore:
    """Durable, rollout-keyed JSONL sink and source for ``TokenEntry`` records.

    Writers to the same rollout are serialized by a file lock; different rollouts write concurrently.
    Async methods run their blocking work on the store's writer thread, never on the event loop.
    """

    def __init__(self, root: str | Path, *, kept_entry_tokens: int = KEPT_ENTRY_TOKENS) -> None:
        """Open (or create) the store in ``root``.

        ``kept_entry_tokens`` bounds the tokens of entries kept in memory for freezes (``tokcap.files.kept_entries``);
        0 keeps none, and every freeze parses its rollout's file.
        """
        self._kept_entries = KeptEntries(kept_entry_tokens)
        self._files = RolloutFiles(Path(root), on_records_removed=self._kept_entries.forget)
        self._writes = WriteQueue(self._run_without_own_barrier, self._barrier, name="tokcap-store-writer")
        self._recovered_states: dict[str, tuple[FilesIdentity, Recovered]] = {}

    @property
    def commit_stats(self) -> dict[str, int]:
        """How many filesystem syncs this store instance has run; benchmarks report it."""
        return {"syncs": self._files.syncs}

    @property
    def root(self) -> Path:
        """The directory holding every rollout's files."""
        return self._files.root

    @property
    def files(self) -> RolloutFiles:
        """The directory's files, for a single writer that owns them (``tokcap.files.log_projection``)."""
        return self._files

    async def _in_thread(self, function: Callable[..., _Result], *args: Any, urgent: bool = False) -> _Result:
        """Run blocking file work off the event loop, on the store's writer thread.

        Operations queued together run as one batch that shares one durability barrier;
        each caller resumes only after that barrier, so each still returns only once durable.
        Source operations are urgent: they go ahead of queued writes.
        """
        return await self._writes.submit(function, *args, urgent=urgent)

    def _run_without_own_barrier(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one queued operation; its writes become durable at the end of its batch."""
        return self._files.run_in_batch(function, args)

    def _barrier(self) -> None:
        """Wait until every write noted so far is durable, sharing one sync with concurrent writers."""
        self._files.barrier()

    def sync(self) -> None:
        """Make every write this store made durable, with one filesystem sync shared with concurrent writers."""
        self._files.forced_barrier()

    # ----------------------------------------------------------------- paths

    def path_for(self, rollout_id: str) -> Path:
        """The rollout's JSONL file of entries."""
        return self._files.paths_of(rollout_id).entries

    def state_path_for(self, rollout_id: str) -> Path:
        """The rollout's state index."""
        return self._files.paths_of(rollout_id).state

    def intents_path_for(self, rollout_id: str) -> Path:
        """The rollout's durable per-call intents."""
        return self._files.paths_of(rollout_id).intents

    def incomplete_path_for(self, rollout_id: str) -> Path:
        """Marker that at least one call of this rollout failed to capture."""
        return self._files.paths_of(rollout_id).incomplete

    def staged_path_for(self, rollout_id: str) -> Path:
        """The staged rows of this rollout (engine-side staging), one line per staged call."""
        return self._files.paths_of(rollout_id).staged

    def blob_path_for(self, rollout_id: str, sha256: str) -> Path:
        """The file holding a staged call's extras or attachment with this SHA-256 (``tokcap.files.layout``)."""
        return self._files.paths_of(rollout_id).blob(sha256)

    def lock_path_for(self, rollout_id: str) -> Path:
        """The rollout's file lock."""
        return self._files.paths_of(rollout_id).lock

    def write_blobs(self, rollout_id: str, blobs: Mapping[str, bytes], *, wait: bool = True) -> list[Path]:
        """Write blobs (bytes by their SHA-256) and return once every one is durable; return the files created.

        Many stagers share one filesystem sync. Without ``wait`` the sync is left to the stage applied next: an
        accepted one syncs them with its row before its state is renamed, any other verdict syncs before it is
        answered (``apply``).
        """
        return self._files.write_blobs(rollout_id, blobs, wait=wait)

    # -------------------------------------------------------------- recovery

    def _recovered(self, paths: RolloutPaths, *, replaying: bool, writing: bool) -> Recovered:
        """The rollout's state; a writer also carries out the repairs recovery asks for."""
        return self._recovered_with_identity(paths, replaying=replaying, writing=writing)[0]

    def _recovered_with_identity(
        self, paths: RolloutPaths, *, replaying: bool, writing: bool
    ) -> tuple[Recovered, FilesIdentity]:
        """The rollout's state and the identity of the files it was recovered from (after any repair).

        A state this store recovered or wrote is reused while the rollout's files are exactly as it left them,
        so an operation costs a few ``stat`` calls, not a parse of a state that grows with the rollout.
        """
        identity = files_identity(paths)
        cached = self._recovered_states.get(paths.rollout_id)
        if cached is not None and cached[0] == identity and (cached[1].lagging_lines == 0 or not replaying):
            return cached[1], identity
        recovered = self._files.recover(paths, replaying=replaying)
        if writing and recovered.repairs:
            self._kept_entries.forget(paths.rollout_id)
            recovered = self._files.repaired(paths, recovered)
            identity = files_identity(paths)
        if not recovered.repairs:
            self._remember_state(paths.rollout_id, identity, recovered)
        return recovered, identity

    def _remember_state(self, rollout_id: str, identity: FilesIdentity, recovered: Recovered) -> None:
        if len(self._recovered_states) >= _REMEMBERED_STATES:
            self._recovered_states.clear()
        self._recovered_states[rollout_id] = (identity, recovered)

    # --------------------------------------------------------- carrying out

    def _apply_locked(
        self, paths: RolloutPaths, event: Event, position: LogPosition | None, *, fence_only: bool = False
    ) -> Decision:
        """Recover, decide, carry out; the caller holds the rollout's lock.

        ``fence_only`` stops before the decision's first barrier (phase one of a batch retire, whose caller
        syncs once for all); the next writer's recovery finishes the rest.
        """
        recovered, identity = self._recovered_with_identity(
            paths, replaying=position is not None, writing=True
        )
        new_snapshot_id = uuid.uuid4().hex if position is None and isinstance(event, FreezeEvent) else ""
        decision = decide(recovered.state, event, position, new_snapshot_id=new_snapshot_id)
        if (
            isinstance(event, StageEvent)
            and event.blob_bytes
            and decision.verdict.outcome is ApplyOutcome.ACCEPTED
        ):
            self._files.write_carried_blobs(paths, event)
        if decision.changed:
            carried = self._files.carry_out(
                paths,
                decision.effects,
                decision.state,
                identity=identity,
                index_write_due=_index_write_due(recovered),
                stop_at_barrier=fence_only,
            )
            if position is None and isinstance(event, PutEvent):
                appended = appended_entry(decision.effects)
                if appended is not None:
                    self._kept_entries.appended(
                        paths.rollout_id, event.entry, appended.start, len(appended.line), appended.digest
                    )
            if not fence_only:
                state_written, known = carried.state_written, carried.identity
                lagging = 0 if state_written else recovered.lagging_lines + 1
                if known is None:
                    exists = state_written or (recovered.state_file_exists and paths.state.exists())
                    known = files_identity(paths)
                else:
                    exists = state_written or recovered.state_file_exists
                after = Recovered(decision.state, (), lagging, exists)
                self._remember_state(paths.rollout_id, known, after)
        return decision

    # ------------------------------------------------------------- the apply step

    def apply(self, event: Event, position: LogPosition | None = None) -> ApplyResult:
        """Apply one event under the rollout's lock; the only way the store changes.

        With a log position, an event at or before the rollout's last applied position is skipped,
        so a resumed projection never applies anything twice.
        Rejections are returned, never raised; the file store's methods raise them to their callers.
        A failed write or sync raises ``StoreWriteError`` naming the operation, the rollout and the file.
        A verdict that changes nothing (an identical repeat, a refusal) still waits for a sync: it was decided
        from files another process's writer may not have synced yet, and a power loss must not undo it.
        """
        with self._files.locked(event.rollout_id) as paths:
            try:
                decision = self._apply_locked(paths, event, position)
                self._files.end_of_operation(forced=decision.sync_even_if_unchanged or not decision.changed)
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _named_write_error(event, exc) from exc
            return decision.verdict

    # ------------------------------------------------------------------ reads

    def _read(self, rollout_id: str) -> RolloutState:
        with self._files.locked(rollout_id) as paths:
            return self._recovered(paths, replaying=False, writing=False).state

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """Every accepted entry of a rollout, in file order (which carries no meaning)."""
        with self._files.locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return self._files.entries_of(paths, state)

    def read_staged_lines(self, rollout_id: str, keys: Sequence[str]) -> list[bytes | None]:
        """The stored line of each staged key (``None`` for a key never staged), read without parsing others."""
        with self._files.locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return self._files.staged_lines(paths, state, keys)

    def read_ledger_lines(self, rollout_id: str) -> list[bytes]:
        """Every committed ledger line of a rollout (rows and failures), in the order they were recorded."""
        with self._files.locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return self._files.ledger_lines(paths, state)

    @contextmanager
    def accepted_entries(self, rollout_id: str) -> Iterator[AcceptedEntries]:
        """Hold the rollout's lock and open the part of its entries file its state accepts.

        For readers that keep what they parsed and read only what was appended since (the lineage resolver):
        the file's identity, accepted size and per-call line digests tell them whether what they kept still
        describes the file. A retired or absent rollout accepts nothing.
        """
        with self._files.locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            with self._files.accepted_entries(paths, state) as accepted:
                yield accepted

    def read_state(self, rollout_id: str) -> RolloutState:
        """The rollout's current state, reconciled in memory with its file tails."""
        return self._read(rollout_id)

    def read_intents(self, rollout_id: str) -> dict[str, IntentOp]:
        """The last recorded operation (intent or cancel) of every call of the rollout."""
        return dict(self._read(rollout_id).intents)

    def read_incomplete_marks(self, rollout_id: str) -> list[IncompleteMark]:
        """Why the rollout is masked: one marker per lost call and reason."""
        return list(self._read(rollout_id).incomplete_marks)

    def snapshot(self, rollout_id: str, *, as_of: LogPosition | None = None) -> TokenCaptureSnapshot:
        """The snapshot of a rollout that is already frozen; used after a freeze applied elsewhere.

        With ``as_of``, the snapshot is the one the freeze applied at that log position answered: its version
        as of that position, so a write that raced the freeze keeps its drop from succeeding.
        A late incomplete marker still masks it (failing closed).
        """
        with self._files.locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return snapshot_from(rollout_id, state, lambda: self._files.entries_of(paths, state), as_of)

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether any call of the rollout failed to capture (or, once frozen, was left dangling)."""
        return is_marked_incomplete(self._read(rollout_id))

    def rollout_ids(self) -> list[str]:
        """Every rollout id that has a state, entries, intents or marker here, sorted."""
        return rollout_ids_in(self._files.root)

    # ------------------------------------------------------ sink, synchronous

    def append(self, entry: TokenEntry) -> None:
        """Idempotently append one entry and sync it before returning; a Gym entry is taken as is."""
        _raise_for(self.apply(accept_put(entry)))

    def begin_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that a call is about to be dispatched; a lost entry then masks the rollout."""
        check_call_id(rollout_id, model_call_id)
        _raise_for(self.apply(IntentEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def cancel_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably close an intent whose call ended without generation."""
        check_call_id(rollout_id, model_call_id)
        _raise_for(self.apply(CancelEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def mark_incomplete_now(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Durably record that a call was lost."""
        check_call_id(rollout_id, model_call_id, may_be_empty=True)
        _raise_for(
            self.apply(IncompleteEvent(rollout_id=rollout_id, model_call_id=model_call_id, reason=reason))
        )

    # ---------------------------------------------------- source, synchronous

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze one rollout and return its stable snapshot; freezing again returns the same snapshot."""
        event = FreezeEvent(rollout_id=validate_rollout_id(rollout_id))
        with self._files.locked(rollout_id) as paths, _write_errors_named(event):
            decision = self._apply_locked(paths, event, None)
            # On the writer thread the batch's one barrier makes it durable before the caller is answered, so
            # a batch of freezes (a trainer freezing its batch) shares one sync instead of one sync each. A
            # freeze answered again waits for a sync too, as a repeat does (``apply``).
            self._files.end_of_operation(forced=not decision.changed)
            _raise_for(decision.verdict)
            state = decision.state
            return snapshot_from(
                rollout_id,
                state,
                lambda: self._kept_entries.take(rollout_id, state) or self._files.entries_of(paths, state),
                None,
            )

    def drop_now(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot if nothing changed since; keep the fence either way."""
        result = self.apply(DropEvent(rollout_id=rollout_id, snapshot_id=snapshot_id, version=version))
        return bool(result.dropped)

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove records and keep fences, whatever the state, in two phases.

        Phase one writes every missing fence, then syncs the directory, even when it wrote none:
        a fence found here may come from an overlapping retire that has not synced yet.
        Phase two finishes each retire (recovery removes the records of a fenced rollout) and syncs again,
        so nothing is removed before its fence is durable.
        """
        ids = validate_rollout_ids(rollout_ids)
        if not ids:
            return RolloutRemovalPayload()
        removed: dict[str, bool] = {}
        with self._files.deferred_state_files(hold_locks=True):
            for rollout_id in ids:
                with self._files.locked(rollout_id) as paths:
                    decision = self._apply_locked(
                        paths, RetireEvent(rollout_id=rollout_id), None, fence_only=True
                    )
                    removed[rollout_id] = bool(decision.verdict.removed)
        self._files.forced_barrier()
        for rollout_id in ids:
            with self._files.locked(rollout_id) as paths:
                self._recovered(paths, replaying=False, writing=True)
        self._barrier()
        return _removal_payload(ids, removed)

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
            delete = DeleteEvent(rollout_id=rollout_id)
            with self._files.locked(rollout_id) as paths, _write_errors_named(delete):
                decision = self._apply_locked(paths, delete, None)
                removed[rollout_id] = bool(decision.verdict.removed)
        with _write_errors_named(DeleteEvent(rollout_id=ids[0])):
            self._files.forced_barrier()
        return _removal_payload(ids, removed)

    # --------------------------------------------------------- async surface

    @sink_timed("file", "put")
    async def put(self, entry: TokenEntry) -> None:
        """Store an entry durably without blocking the event loop."""
        await self._in_thread(self.append, entry)

    @sink_timed("file", "intent")
    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record a call's intent before dispatch; a failure here happens before generation."""
        await self._in_thread(self.begin_call_now, rollout_id, model_call_id)

    @sink_timed("file", "cancel")
    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Close a call's intent when it ended without generation."""
        await self._in_thread(self.cancel_call_now, rollout_id, model_call_id)

    @sink_timed("file", "mark")
    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Durably record that a call was lost."""
        await self._in_thread(self.mark_incomplete_now, rollout_id, model_call_id, reason)

    @source_timed("file", "freeze")
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


def _index_write_due(recovered: Recovered) -> bool:
    """An index-only change of the file store is written every few lines, or when there is no state file."""
    return recovered.lagging_lines + 1 >= INDEX_FLUSH_ENTRIES or not recovered.state_file_exists


def _raise_for(result: ApplyResult) -> None:
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


@contextmanager
def _write_errors_named(event: Event) -> Iterator[None]:
    """Turn an operating-system error of one operation into a tokcap error that says what failed where."""
    try:
        yield
    except StoreWriteError:
        raise
    except OSError as exc:
        raise _named_write_error(event, exc) from exc


def _named_write_error(event: Event, exc: OSError) -> StoreWriteError:
    """The tokcap error for an operating-system error of one operation: what failed, where, what to do."""
    call_id = getattr(event, "model_call_id", "") or (
        event.entry.model_call_id if isinstance(event, PutEvent) else ""
    )
    call = f" call {call_id!r}" if call_id else ""
    where = exc.filename or "the store directory (sync)"
    error = StoreWriteError(
        f"{event.type.value} of rollout {event.rollout_id!r}{call} failed writing {where}: "
        f"{exc.strerror or exc}; nothing of it was acknowledged and the files stay readable. "
        "Free space or fix the device, then retry",
        rollout_id=event.rollout_id,
        model_call_id=call_id or None,
    )
    error.errno, error.filename = exc.errno, exc.filename
    return error


def _removal_payload(ids: Sequence[str], removed: dict[str, bool]) -> RolloutRemovalPayload:
    return RolloutRemovalPayload(
        removed=tuple(rid for rid in ids if removed[rid]),
        not_found=tuple(rid for rid in ids if not removed[rid]),
    )
