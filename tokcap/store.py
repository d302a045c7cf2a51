"""The file store: a durable, rollout-keyed projection of capture events.

It carries out the decisions of ``tokcap.rules``; it holds no rule of its own. It serves a directory several
processes may write (Gym's store among them): the files are the truth, so every operation builds an event,
recovers the rollout's state from the files (``tokcap.recovery``; cached only while the files are exactly as
the store left them), asks ``tokcap.rules.decide`` what the event does, and carries out the effects in order.
A single writer that owns its directory and keeps the truth in memory (``tokcap.log_projection``) decides
itself and uses the few functions of the section "a single writer", which are given what to write.
File names live in ``tokcap.layout``, locks in ``tokcap.locks``, durability in ``tokcap.group_commit``,
``tokcap.write_queue`` and ``tokcap.durable_io``.

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
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import orjson

from tokcap.checked_puts import accept_put
from tokcap.durable_io import (
    append_durably,
    fsync_directory,
    open_no_follow,
    read_no_follow,
    remove_if_exists,
    remove_stale_temp_files,
    rename_over,
    replace_atomically,
    truncate_no_follow,
    write_temp_sibling,
)
from tokcap.errors import (
    ConflictingEntryError,
    RolloutFrozenError,
    RolloutRetiredError,
    StoreCorruptionError,
    StoreWriteError,
)
from tokcap.events import (
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
from tokcap.group_commit import GroupCommitter, filesystem_sync_for
from tokcap.input_rules import check_call_id
from tokcap.kept_entries import KEPT_ENTRY_TOKENS, KeptEntries
from tokcap.layout import (
    ENTRIES_SUFFIX,
    INCOMPLETE_SUFFIX,
    INTENTS_SUFFIX,
    LOCK_SUFFIX,
    STATE_SUFFIX,
    RolloutPaths,
    rollout_ids_in,
)
from tokcap.locks import RolloutHold, RolloutLocks
from tokcap.metrics import sink_timed, source_timed
from tokcap.protocols import RolloutRemovalPayload, TokenCaptureSnapshot
from tokcap.records import TokenEntry
from tokcap.recovery import CutTail, FinishRetire, Recovered, recover
from tokcap.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.rules import (
    AppendEntry,
    AppendIncompleteMark,
    AppendIntent,
    AppendLedgerLine,
    AppendStagedLine,
    ApplyOutcome,
    ApplyResult,
    Barrier,
    Decision,
    RemoveRecords,
    RemoveState,
    WriteState,
    decide,
    is_marked_incomplete,
    snapshot_of,
)
from tokcap.state import IncompleteMark, IntentOp, RolloutState
from tokcap.write_queue import WriteQueue

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

_REMEMBERED_PATHS = 65_536
"""How many validated rollout file sets a store remembers."""

_REMEMBERED_STATES = 4_096
"""How many recovered rollout states a store keeps, to skip parsing a state file no one changed."""

_REMEMBERED_LINES = 65_536
"""How many appended lines' call ids a store remembers to re-index its lagging tails without parsing them."""


_PENDING_STATE_LOCKS = 64
"""Most rollout locks a writer thread's batch holds for states it has not renamed yet; past it (a retire of many
rollouts), the states written so far are synced and renamed, so a batch never needs a descriptor per rollout."""


class _WriterBatch(threading.local):
    """Whether this thread is running an operation of the writer thread's batch, whose one barrier makes it
    durable before its caller is answered; and the state files this thread wrote but has not renamed yet.

    ``deferring`` says a single writer's block (``TokenCaptureStore.deferred_state_files``) is running, whose
    states are renamed together at its end. ``pending`` maps a rollout id to its new state file's temporary
    path, its files, in a batch the hold on its lock (kept until the rename so no other thread or process writes
    the rollout in between), and whether its rename must be durable before the caller is answered. A single
    writer's block owns its rollouts, so it keeps no descriptor per rollout and takes each lock again for the
    rename.
    """

    running: bool = False
    deferring: bool = False
    holding: bool = False
    failure: BaseException | None = None

    def __init__(self) -> None:
        self.pending: dict[str, _PendingState] = {}


@dataclass
class _PendingState:
    """A state file written beside its target and not renamed yet (``_WriterBatch.pending``).

    ``durable``: its rename must be durable before the caller is answered. ``index_only``: it only indexes
    lines already in the files, so it may be dropped instead of renamed, as if its write had been skipped.
    """

    tmp: Path
    paths: RolloutPaths
    hold: RolloutHold | None
    durable: bool
    index_only: bool

    def drop(self) -> None:
        """Remove the temporary file and let go of the lock."""
        self.tmp.unlink(missing_ok=True)
        if self.hold is not None:
            self.hold.__exit__()


@dataclass(frozen=True)
class AcceptedEntries:
    """A rollout's entries file, open under its lock, as far as its state accepts it.

    ``identity`` is the open file's device and inode (``None`` when nothing is accepted), ``size`` the bytes
    the state covers (complete lines only: a torn or unaccepted tail is past it), and ``digests`` the sha256
    of each call's accepted line, by call id.
    """

    identity: tuple[int, int] | None
    size: int
    digests: Mapping[str, str]
    handle: BinaryIO | None
    path: Path | None = None

    def read(self, start: int, end: int) -> bytes:
        """The accepted bytes from ``start`` to ``end``; a range past the accepted size is refused."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"bytes {start}..{end} are outside the {self.size} accepted bytes")
        if self.handle is None or start == end:
            return b""
        self.handle.seek(start)
        data = self.handle.read(end - start)
        if len(data) != end - start:
            raise StoreCorruptionError(
                f"{self.path} ended at byte {start + len(data)} inside the {self.size} bytes its state "
                "covers; the file was truncated outside tokcap; restore it from a backup or delete the rollout"
            )
        return data


class TokenCaptureStore:
    """Durable, rollout-keyed JSONL sink and source for ``TokenEntry`` records.

    Writers to the same rollout are serialized by a file lock; different rollouts write concurrently.
    Async methods run their blocking work on the store's writer thread, never on the event loop.
    """

    def __init__(self, root: str | Path, *, kept_entry_tokens: int = KEPT_ENTRY_TOKENS) -> None:
        """Open (or create) the store in ``root``.

        ``kept_entry_tokens`` bounds the tokens of entries kept in memory for freezes (``tokcap.kept_entries``);
        0 keeps none, and every freeze parses its rollout's file.
        """
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self._root)
        self._commit = GroupCommitter(filesystem_sync_for(self._root))
        self._batch = _WriterBatch()
        self._writes = WriteQueue(self._run_without_own_barrier, self._barrier, name="tokcap-store-writer")
        self._rollout_locks = RolloutLocks()
        self._call_ids_of_written_lines: dict[str, str] = {}
        self._paths: dict[str, RolloutPaths] = {}
        self._recovered_states: dict[str, tuple[_FilesIdentity, Recovered]] = {}
        self._kept_entries = KeptEntries(kept_entry_tokens)

    @property
    def commit_stats(self) -> dict[str, int]:
        """How many filesystem syncs this store instance has run; benchmarks report it."""
        return {"syncs": self._commit.syncs}

    @property
    def root(self) -> Path:
        """The directory holding every rollout's files."""
        return self._root

    async def _in_thread(self, function: Callable[..., _Result], *args: Any, urgent: bool = False) -> _Result:
        """Run blocking file work off the event loop, on the store's writer thread.

        Operations queued together run as one batch that shares one durability barrier;
        each caller resumes only after that barrier, so each still returns only once durable.
        Source operations are urgent: they go ahead of queued writes.
        """
        return await self._writes.submit(function, *args, urgent=urgent)

    def _run_without_own_barrier(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one queued operation; its writes become durable at the end of its batch."""
        self._batch.running = True
        try:
            return function(*args)
        finally:
            self._batch.running = False

    # ------------------------------------------------------------ durability

    def _barrier(self) -> None:
        """Wait until every write noted so far is durable, sharing one sync with concurrent writers.

        State files this thread left to rename are renamed first, after a sync of them and what they cover.
        """
        if self._batch.pending:
            self._rename_pending_states()
        failure = self._batch.failure
        if failure is not None and not self._batch.running:
            self._batch.failure = None
            raise failure
        self._commit.wait_durable()

    def _rename_pending_states(self) -> None:
        """Sync the state files this thread wrote and every line they cover, then rename them into place.

        One sync for all of them keeps a batch of freezes (or a single writer's block) at two syncs, where
        syncing before each rename would cost one per state; a batch whose states are all index-only (puts and
        intents) stays at one, its renames made durable by a later sync. A durable state's rename is noted for
        the next barrier. A failed sync or rename removes the temporary files left; the old states stand.
        """
        pending, self._batch.pending = self._batch.pending, {}
        try:
            self._commit.note_write()
            self._commit.wait_durable()
            for rollout_id in list(pending):
                state = pending[rollout_id]
                if state.hold is None:
                    with self._rollout_locks.hold(state.paths.lock):
                        rename_over(state.tmp, state.paths.state)
                else:
                    rename_over(state.tmp, state.paths.state)
                    state.hold.__exit__()
                del pending[rollout_id]
                if state.durable:
                    self._commit.note_write()
        except BaseException as exc:
            # Every operation of the batch that left a state here must fail, not only the one that noticed.
            if self._batch.running:
                self._batch.failure = exc
            raise
        finally:
            for state in pending.values():
                state.drop()

    def _forced_barrier(self) -> None:
        """Sync even if this instance wrote nothing: another process may have removed files without syncing yet."""
        self._commit.note_write()
        self._barrier()

    def _end_of_operation(self, *, forced: bool = False) -> None:
        """Make the operation durable now, unless the writer thread's batch does it before answering its caller."""
        if forced:
            self._commit.note_write()
        if not self._batch.running:
            self._barrier()

    def sync(self) -> None:
        """Make every write this store made durable, with one filesystem sync shared with concurrent writers.

        A single writer that leaves syncs to the end of its block (``tokcap.log_projection``) calls it there.
        """
        self._forced_barrier()

    # ----------------------------------------------------------------- paths

    def _paths_of(self, rollout_id: str) -> RolloutPaths:
        """A rollout's files; remembered because building them showed up in every operation's profile."""
        paths = self._paths.get(rollout_id)
        if paths is None:
            if len(self._paths) >= _REMEMBERED_PATHS:
                self._paths.clear()
            paths = self._paths[rollout_id] = RolloutPaths.of(self._root, rollout_id)
        return paths

    def path_for(self, rollout_id: str) -> Path:
        """The rollout's JSONL file of entries."""
        return self._paths_of(rollout_id).entries

    def state_path_for(self, rollout_id: str) -> Path:
        """The rollout's state index."""
        return self._paths_of(rollout_id).state

    def intents_path_for(self, rollout_id: str) -> Path:
        """The rollout's durable per-call intents."""
        return self._paths_of(rollout_id).intents

    def incomplete_path_for(self, rollout_id: str) -> Path:
        """Marker that at least one call of this rollout failed to capture."""
        return self._paths_of(rollout_id).incomplete

    def staged_path_for(self, rollout_id: str) -> Path:
        """The staged rows of this rollout (engine-side staging), one line per staged call."""
        return self._paths_of(rollout_id).staged

    def blob_path_for(self, rollout_id: str, sha256: str) -> Path:
        """The file holding a staged call's extras or attachment with this SHA-256 (``tokcap.layout``)."""
        return self._paths_of(rollout_id).blob(sha256)

    def write_blobs(self, rollout_id: str, blobs: Mapping[str, bytes], *, wait: bool = True) -> list[Path]:
        """Write blobs (bytes by their SHA-256) and return once every one is durable; return the files created.

        The files are written without syncs of their own and become durable in one filesystem sync shared with
        every concurrent writer of this store, so many stagers pay for one sync instead of three each. A blob
        already on disk is kept only if it holds exactly these bytes (a crash before the sync may have left a
        file of the right name and size with other contents). It may be another writer's still in flight, so the
        sync is waited for even when nothing was written, and a row naming the blob is never durable before it.
        Without ``wait`` the sync is left to the stage applied next: an accepted one syncs them with its row
        before its state is renamed, any other verdict syncs before it is answered (``apply``).
        """
        created: list[Path] = []
        if not blobs:
            return created
        for sha256, data in blobs.items():
            path = self._paths_of(rollout_id).blob(sha256)
            if _holds(path, data):
                continue
            path.parent.mkdir(exist_ok=True)
            replace_atomically(path, data, durable=False)
            created.append(path)
        self._commit.note_write()
        if wait:
            self._barrier()
        return created

    def lock_path_for(self, rollout_id: str) -> Path:
        """The rollout's file lock."""
        return self._paths_of(rollout_id).lock

    @contextmanager
    def _locked(self, rollout_id: str) -> Iterator[RolloutPaths]:
        """Hold the rollout's exclusive file lock; it serializes threads and processes alike.

        A state file of the rollout this thread has not renamed yet is renamed first (or dropped when it only
        indexes lines, as an index write the store skips), so the files are the rollout's truth again.
        """
        paths = self._paths_of(rollout_id)
        with self._rollout_locks.hold(paths.lock):
            pending = self._batch.pending.get(rollout_id)
            if pending is not None and pending.index_only:
                self._batch.pending.pop(rollout_id).drop()
            elif pending is not None:
                self._rename_pending_states()
            yield paths

    @contextmanager
    def deferred_state_files(self, *, hold_locks: bool = False) -> Iterator[None]:
        """Leave the state files written in the block unrenamed until its end, then sync once and rename them.

        For a single writer's flush (``tokcap.log_projection``), which replaces many rollouts' states at once:
        a state may only be renamed once it and the lines it covers are durable, and one sync for the whole
        block is much cheaper than one per state. The caller syncs after the block to make the renames durable.
        ``hold_locks`` keeps each rollout's lock until its rename, for a writer that does not own its rollouts.
        Inside a writer thread's batch or another such block, the renames are left to it. A block that fails
        on its own renames nothing.
        """
        deferring, holding = self._batch.deferring, self._batch.holding
        outermost = not (deferring or self._batch.running)
        self._batch.deferring, self._batch.holding = True, holding or hold_locks
        try:
            yield
        except BaseException:
            if outermost:
                pending, self._batch.pending = self._batch.pending, {}
                for state in pending.values():
                    state.drop()
            raise
        finally:
            self._batch.deferring, self._batch.holding = deferring, holding
        if outermost and self._batch.pending:
            self._rename_pending_states()

    # -------------------------------------------------------------- recovery

    def _recovered(self, paths: RolloutPaths, *, replaying: bool, writing: bool) -> Recovered:
        """The rollout's state; a writer also carries out the repairs recovery asks for."""
        return self._recovered_with_identity(paths, replaying=replaying, writing=writing)[0]

    def _recovered_with_identity(
        self, paths: RolloutPaths, *, replaying: bool, writing: bool
    ) -> tuple[Recovered, _FilesIdentity]:
        """The rollout's state and the identity of the files it was recovered from (after any repair).

        A state this store recovered or wrote is reused while the rollout's files are exactly as it left them,
        so an operation costs a few ``stat`` calls, not a parse of a state that grows with the rollout.
        """
        identity = _files_identity(paths)
        cached = self._recovered_states.get(paths.rollout_id)
        if cached is not None and cached[0] == identity and (cached[1].lagging_lines == 0 or not replaying):
            return cached[1], identity
        recovered = recover(paths, replaying=replaying, remembered_lines=self._call_ids_of_written_lines)
        if writing:
            self._repair(paths, recovered)
            if recovered.repairs:
                identity = _files_identity(paths)
                recovered = Recovered(
                    recovered.state, (), recovered.lagging_lines, recovered.state_file_exists
                )
        if not recovered.repairs:
            self._remember_state(paths.rollout_id, identity, recovered)
        return recovered, identity

    def _remember_state(self, rollout_id: str, identity: _FilesIdentity, recovered: Recovered) -> None:
        if len(self._recovered_states) >= _REMEMBERED_STATES:
            self._recovered_states.clear()
        self._recovered_states[rollout_id] = (identity, recovered)

    def _repair(self, paths: RolloutPaths, recovered: Recovered) -> None:
        if recovered.repairs:
            self._kept_entries.forget(paths.rollout_id)
        for repair in recovered.repairs:
            if isinstance(repair, CutTail):
                self._cut(repair)
            elif isinstance(repair, FinishRetire):
                self._remove_records(paths)

    def _cut(self, cut: CutTail) -> None:
        """Cut bytes no state covers: a torn line never acknowledged, or a projection's unapplied tail."""
        logger.warning("cutting %s back to %d bytes: they were never committed", cut.path, cut.size)
        if cut.size == 0:
            remove_if_exists(cut.path)
        else:
            truncate_no_follow(cut.path, cut.size)
        self._commit.note_write()

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
            self._write_carried_blobs(paths, event)
        if decision.changed:
            state_written, known = self._carry_out(
                paths, decision, recovered, identity, fence_only=fence_only
            )
            if position is None and isinstance(event, PutEvent):
                self._keep_appended_entry(paths.rollout_id, event, decision)
            if not fence_only:
                lagging = 0 if state_written else recovered.lagging_lines + 1
                if known is None:
                    exists = state_written or (recovered.state_file_exists and paths.state.exists())
                    known = _files_identity(paths)
                else:
                    exists = state_written or recovered.state_file_exists
                after = Recovered(decision.state, (), lagging, exists)
                self._remember_state(paths.rollout_id, known, after)
        return decision

    def _write_carried_blobs(self, paths: RolloutPaths, event: StageEvent) -> None:
        """Write the blobs a stage read from a log brought, durably, before the row that names them.

        Only an accepted stage writes them, so a refused one (a conflict, a retired rollout) leaves no file. A
        blob already on disk is kept only if it holds exactly these bytes, as in ``write_blobs``.
        """
        written = False
        for ref in event.blob_refs():
            path = paths.blob(ref.sha256)
            data = event.blob_bytes[ref.sha256]
            if _holds(path, data):
                continue
            paths.blobs.mkdir(exist_ok=True)
            replace_atomically(path, data, durable=True)
            written = True
        if written:
            fsync_directory(paths.blobs)
            fsync_directory(paths.blobs.parent)

    def _carry_out(
        self,
        paths: RolloutPaths,
        decision: Decision,
        recovered: Recovered,
        identity: _FilesIdentity,
        *,
        fence_only: bool,
    ) -> tuple[bool, _FilesIdentity | None]:
        """Carry out the decision's effects in order.

        Return whether the state file now holds the decision's state, and the identity of the files after the
        effects when this operation knows it without asking the filesystem again: it started from ``identity``
        and only appended (at the sizes it checked) and replaced the state file (with bytes it wrote). After a
        removal it returns ``None`` and the caller takes the identity from the files.
        """
        state = decision.state
        state_written, exact = False, True
        known_state, entries_size, intents_size, incomplete_size = identity
        for effect in decision.effects:
            if isinstance(effect, AppendEntry):
                entries_size = self._append_line(paths, effect)
            elif isinstance(effect, AppendIntent):
                intents_size = self._append_line(paths, effect)
            elif isinstance(effect, AppendIncompleteMark):
                incomplete_size = self._append_line(paths, effect)
            elif isinstance(effect, AppendStagedLine | AppendLedgerLine):
                self._append_line(paths, effect)
            elif isinstance(effect, WriteState) and effect.state is not None:
                self._replace_state_file(paths, effect.state, durable=True)
                exact = False
            elif isinstance(effect, WriteState):
                if effect.durable or state.last_position is not None or self._index_write_due(recovered):
                    known_state = self._replace_state_file(
                        paths,
                        state,
                        durable=effect.durable,
                        index_only=not effect.durable and state.last_position is None,
                    )
                    state_written = True
            elif isinstance(effect, Barrier):
                if fence_only:
                    return state_written, None
                self._barrier()
            elif isinstance(effect, RemoveRecords):
                self._remove_records(paths)
                exact = False
            elif isinstance(effect, RemoveState):
                self._remove(paths.state)
                state_written = False
                exact = False
        if not exact:
            return state_written, None
        return state_written, (known_state, entries_size, intents_size, incomplete_size)

    def _keep_appended_entry(self, rollout_id: str, event: PutEvent, decision: Decision) -> None:
        """Keep an exact copy of the entry a put of the store's own appended, for the rollout's freeze."""
        for effect in decision.effects:
            if isinstance(effect, AppendEntry):
                self._kept_entries.appended(
                    rollout_id, event.entry, effect.start, len(effect.line), effect.digest
                )

    def _index_write_due(self, recovered: Recovered) -> bool:
        """An index-only change of the file store is written every few lines, or when there is no state file."""
        return recovered.lagging_lines + 1 >= INDEX_FLUSH_ENTRIES or not recovered.state_file_exists

    def _append_line(
        self,
        paths: RolloutPaths,
        effect: AppendEntry | AppendIntent | AppendIncompleteMark | AppendStagedLine | AppendLedgerLine,
    ) -> int:
        """Append one decided line to its file at the byte it was decided at; return the file's size after it.

        A staged or ledger file longer than that holds bytes never acknowledged, so it is cut first.
        """
        if isinstance(effect, AppendEntry):
            size = self._append(paths.entries, effect.line, effect.start, paths.rollout_id)
            self._remember_written_line(effect.digest, effect.model_call_id)
            return size
        if isinstance(effect, AppendIntent):
            path = paths.intents
        elif isinstance(effect, AppendIncompleteMark):
            path = paths.incomplete
        else:
            path = paths.staged if isinstance(effect, AppendStagedLine) else paths.ledger
            if _size_of(path) > effect.start:
                self._cut(CutTail(path, effect.start))
        return self._append(path, effect.line, effect.start, paths.rollout_id)

    def _append(self, path: Path, line: bytes, expected_start: int, rollout_id: str) -> int:
        """Append one line and return the file's size after it.

        The line becomes durable at the operation's barrier, before the caller returns.
        """
        start = append_durably(path, line, durable=False)
        self._commit.note_write()
        if start != expected_start:
            raise StoreCorruptionError(
                f"{path} grew outside the rollout lock (expected {expected_start} bytes, found {start}); "
                "another program is writing to the store",
                rollout_id=rollout_id,
            )
        return start + len(line)

    def _replace_state_file(
        self, paths: RolloutPaths, state: RolloutState, *, durable: bool, index_only: bool = False
    ) -> bytes:
        """Replace the state file atomically; return the bytes it now holds.

        The rename waits for a filesystem sync (shared with concurrent writers) of the new file and of every
        line it covers. A power loss may keep a rename and lose bytes written before it that were not synced:
        the state file would be found empty, or naming lines that are gone, and recovery would call a rollout
        corrupt whose operations had returned ok. A ``durable`` state is synced again at the operation's
        barrier; an ``index_only`` one need not be (its lines are the record, folded in while it lags).
        A writer thread's batch (and a single writer's block) renames its states together at its end, under
        their locks (``_rename_pending_states``).
        """
        data = state.encode()
        if not (self._batch.running or self._batch.deferring):
            replace_atomically(paths.state, data, durable=False, before_rename=self._forced_barrier)
            if durable:
                self._commit.note_write()
            return data
        pending = self._batch.pending.pop(paths.rollout_id, None)
        hold: RolloutHold | None = None
        if pending is not None:
            pending.tmp.unlink(missing_ok=True)
            hold, durable = pending.hold, durable or pending.durable
            index_only = index_only and pending.index_only
        elif self._batch.running or self._batch.holding:
            if len(self._batch.pending) >= _PENDING_STATE_LOCKS:
                self._rename_pending_states()
            hold = self._rollout_locks.hold(paths.lock)
            hold.__enter__()
        try:
            tmp = write_temp_sibling(paths.state, data, durable=False)
        except BaseException:
            if hold is not None:
                hold.__exit__()
            raise
        self._batch.pending[paths.rollout_id] = _PendingState(tmp, paths, hold, durable, index_only)
        return data

    def _remove(self, path: Path) -> None:
        """Remove a file if it exists; the removal becomes durable at the operation's barrier."""
        if remove_if_exists(path):
            self._commit.note_write()

    def _remove_records(self, paths: RolloutPaths) -> None:
        """Remove the record files; the blob directory goes first, so a crash leaves a staged file to finish it."""
        self._kept_entries.forget(paths.rollout_id)
        if os.path.isdir(paths.blobs) and not os.path.islink(paths.blobs):
            for name in os.listdir(paths.blobs):
                self._remove(paths.blobs / name)
            try:
                os.rmdir(paths.blobs)
            except OSError as exc:
                # A late stage racing the retire wrote a blob after the listing; its row is refused by the
                # fence, and the blob goes with the rollout's delete.
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise
            self._commit.note_write()
        for path in paths.records:
            self._remove(path)

    def _remember_written_line(self, digest: str, call_id: str) -> None:
        """Remember the call id of a line this store appended, keyed by the line's sha256.

        Re-indexing a lagging tail then hashes each line instead of parsing it: equal digests mean equal bytes,
        so the call id is the one this store wrote. Bounded: forgotten lines are simply parsed again.
        """
        if len(self._call_ids_of_written_lines) >= _REMEMBERED_LINES:
            self._call_ids_of_written_lines.clear()
        self._call_ids_of_written_lines[digest] = call_id

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
        with self._locked(event.rollout_id) as paths:
            try:
                decision = self._apply_locked(paths, event, position)
                self._end_of_operation(forced=decision.sync_even_if_unchanged or not decision.changed)
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _named_write_error(event, exc) from exc
            return decision.verdict

    # ------------------------------------------------------------------ a single writer

    def recovered_for_block(self, rollout_id: str) -> RolloutState:
        """A rollout's state as a single writer resumes it in an open block, its files repaired first.

        For ``tokcap.log_projection`` applying a rollout it holds no state of: bytes no state covers (a tail
        appended before a crash) are cut, so its appends start where the state says. A rollout with no file
        yet starts empty without its lock being taken, so creating the lock file, the costliest step of a new
        rollout's first event on ext4, is left to the flush. Every file is looked for, not the lock file alone:
        writers create it before any record file, but a power loss may keep a record file and lose the lock
        file's creation, which was never synced.
        """
        paths = self._paths_of(rollout_id)
        if not any(os.path.lexists(path) for path in (paths.lock, paths.state, *paths.records, paths.fence)):
            return RolloutState(rollout_id=rollout_id)
        with self._locked(rollout_id) as paths:
            try:
                return self._recovered(paths, replaying=True, writing=True).state
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc

    def write_block_appends(
        self,
        rollout_id: str,
        appends: Sequence[AppendEntry | AppendIntent | AppendIncompleteMark],
        state: RolloutState | None,
    ) -> None:
        """Carry out a single writer's appends of one rollout, in order and one write per file, then its state.

        Each file's lines must follow one another from the first one's start, which must be the file's size:
        the writer decided them one after another from the state its files hold.
        """
        with self._locked(rollout_id) as paths:
            by_file: dict[Path, tuple[int, list[bytes]]] = {}
            for effect in appends:
                if isinstance(effect, AppendEntry):
                    path = paths.entries
                elif isinstance(effect, AppendIntent):
                    path = paths.intents
                else:
                    path = paths.incomplete
                start, lines = by_file.setdefault(path, (effect.start, []))
                if effect.start != start + sum(len(line) for line in lines):
                    raise StoreCorruptionError(
                        f"a block's appends to {path} do not follow one another (a line at byte {effect.start}); "
                        "this is a bug in the projection: restart it, it applies the block again",
                        rollout_id=rollout_id,
                    )
                lines.append(effect.line)
            try:
                for path, (start, lines) in by_file.items():
                    self._append(path, b"".join(lines), start, rollout_id)
                if state is not None:
                    self._replace_state_file(paths, state, durable=True)
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc

    def carry_out_decided(self, event: Event, decision: Decision) -> bool:
        """Carry out what a single writer decided from the state it keeps, under the rollout's lock.

        For ``tokcap.log_projection``: what it does not keep in memory until its flush (a drop, retire or delete,
        a staged or ledger row). The decided state is written where a barrier needs it on disk first (the fence
        before the removals it guards) and synced there; otherwise the writer writes it at its flush. Return
        whether the state is left for the flush. The writer owns the rollout's files: nothing is recovered here.
        """
        rollout_id = event.rollout_id
        state, state_due = decision.state, False
        with self._locked(rollout_id) as paths:
            try:
                if (
                    isinstance(event, StageEvent)
                    and event.blob_bytes
                    and decision.verdict.outcome is ApplyOutcome.ACCEPTED
                ):
                    self._write_carried_blobs(paths, event)
                for effect in decision.effects:
                    if isinstance(effect, WriteState) and effect.state is None:
                        state_due = True
                    elif isinstance(effect, WriteState):
                        self._replace_state_file(paths, effect.state or state, durable=True)
                    elif isinstance(effect, Barrier):
                        if state_due:
                            self._replace_state_file(paths, state, durable=True)
                            state_due = False
                        self._barrier()
                    elif isinstance(effect, RemoveRecords):
                        self._remove_records(paths)
                    elif isinstance(effect, RemoveState):
                        self._remove(paths.state)
                    else:
                        self._append_line(paths, effect)
                if decision.sync_even_if_unchanged:
                    self._commit.note_write()
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc
        return state_due

    # ------------------------------------------------------------------ reads

    def _read(self, rollout_id: str) -> RolloutState:
        with self._locked(rollout_id) as paths:
            return self._recovered(paths, replaying=False, writing=False).state

    def _entries_of(self, paths: RolloutPaths, state: RolloutState) -> list[TokenEntry]:
        if state.retired or state.indexed_size == 0:
            return []
        with os.fdopen(open_no_follow(paths.entries, os.O_RDONLY), "rb") as handle:
            data = handle.read(state.indexed_size)
        return [TokenEntry.from_json(line) for line in data.split(b"\n") if line]

    def read_entries_of(self, state: RolloutState) -> list[TokenEntry]:
        """The entries ``state`` accepts, read from its rollout's file under the lock.

        For a single writer whose state in memory is ahead of the state file (``tokcap.log_projection``):
        its lines are written, its state is not yet.
        """
        with self._locked(state.rollout_id) as paths:
            return self._entries_of(paths, state)

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """Every accepted entry of a rollout, in file order (which carries no meaning)."""
        with self._locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return self._entries_of(paths, state)

    def read_staged_lines(self, rollout_id: str, keys: Sequence[str]) -> list[bytes | None]:
        """The stored line of each staged key (``None`` for a key never staged), read without parsing others."""
        with self._locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            slots = [state.staged.get(key) for key in keys]
            if not any(slots):
                return [None for _ in keys]
            fd = open_no_follow(paths.staged, os.O_RDONLY)
            try:
                lines = [None if slot is None else os.pread(fd, slot.length, slot.start) for slot in slots]
            finally:
                os.close(fd)
        for key, slot, line in zip(keys, slots, lines, strict=True):
            if slot is not None and (line is None or len(line) != slot.length):
                raise StoreCorruptionError(
                    f"{paths.staged} is shorter than its state says (staged key {key!r}); restore the file "
                    "from a backup or replay the run, the staged row cannot be read",
                    rollout_id=rollout_id,
                )
        return lines

    def read_ledger_lines(self, rollout_id: str) -> list[bytes]:
        """Every committed ledger line of a rollout (rows and failures), in the order they were recorded."""
        with self._locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            if state.ledger_size == 0:
                return []
            with os.fdopen(open_no_follow(paths.ledger, os.O_RDONLY), "rb") as handle:
                data = handle.read(state.ledger_size)
        if len(data) != state.ledger_size:
            raise StoreCorruptionError(
                f"{paths.ledger} holds {len(data)} bytes, its state says {state.ledger_size}; restore it or "
                "replay the run",
                rollout_id=rollout_id,
            )
        lines = data.splitlines(keepends=True)
        _check_ledger_lines(paths.ledger, state, lines)
        return [line.rstrip(b"\n") for line in lines]

    @contextmanager
    def accepted_entries(self, rollout_id: str) -> Iterator[AcceptedEntries]:
        """Hold the rollout's lock and open the part of its entries file its state accepts.

        For readers that keep what they parsed and read only what was appended since (the lineage resolver):
        the file's identity, accepted size and per-call line digests tell them whether what they kept still
        describes the file. A retired or absent rollout accepts nothing.
        """
        with self._locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            if state.retired or state.indexed_size == 0:
                yield AcceptedEntries(None, 0, {}, None)
                return
            with os.fdopen(open_no_follow(paths.entries, os.O_RDONLY), "rb") as handle:
                found = os.fstat(handle.fileno())
                yield AcceptedEntries(
                    (found.st_dev, found.st_ino),
                    state.indexed_size,
                    state.entry_digests,
                    handle,
                    paths.entries,
                )

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
        with self._locked(rollout_id) as paths:
            state = self._recovered(paths, replaying=False, writing=False).state
            return self._snapshot_of(paths, state, as_of)

    def _snapshot_of(
        self, paths: RolloutPaths, state: RolloutState, as_of: LogPosition | None
    ) -> TokenCaptureSnapshot:
        return self._snapshot_from(paths.rollout_id, state, lambda: self._entries_of(paths, state), as_of)

    def _snapshot_from(
        self,
        rollout_id: str,
        state: RolloutState,
        entries: Sequence[TokenEntry] | Callable[[], Sequence[TokenEntry]],
        as_of: LogPosition | None,
    ) -> TokenCaptureSnapshot:
        """The snapshot a frozen state answers (``rules.snapshot_of``), with its entries, read only once it answers."""
        answer = snapshot_of(state, as_of)
        return TokenCaptureSnapshot(
            rollout_id=rollout_id,
            entries=tuple(entries() if callable(entries) else entries),
            incomplete=answer.incomplete,
            snapshot_id=answer.snapshot_id,
            version=answer.version,
        )

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether any call of the rollout failed to capture (or, once frozen, was left dangling)."""
        return is_marked_incomplete(self._read(rollout_id))

    def rollout_ids(self) -> list[str]:
        """Every rollout id that has a state, entries, intents or marker here, sorted."""
        return rollout_ids_in(self._root)

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
        """Idempotently append one entry and sync it before returning; a Gym entry is taken as is."""
        self._raise_for(self.apply(accept_put(entry)))

    def begin_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that a call is about to be dispatched; a lost entry then masks the rollout."""
        check_call_id(rollout_id, model_call_id)
        self._raise_for(self.apply(IntentEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def cancel_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably close an intent whose call ended without generation."""
        check_call_id(rollout_id, model_call_id)
        self._raise_for(self.apply(CancelEvent(rollout_id=rollout_id, model_call_id=model_call_id)))

    def mark_incomplete_now(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Durably record that a call was lost."""
        check_call_id(rollout_id, model_call_id, may_be_empty=True)
        self._raise_for(
            self.apply(IncompleteEvent(rollout_id=rollout_id, model_call_id=model_call_id, reason=reason))
        )

    # ---------------------------------------------------- source, synchronous

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze one rollout and return its stable snapshot; freezing again returns the same snapshot."""
        event = FreezeEvent(rollout_id=validate_rollout_id(rollout_id))
        with self._locked(rollout_id) as paths, _write_errors_named(event):
            decision = self._apply_locked(paths, event, None)
            # On the writer thread the batch's one barrier makes it durable before the caller is answered, so
            # a batch of freezes (a trainer freezing its batch) shares one sync instead of one sync each. A
            # freeze answered again waits for a sync too, as a repeat does (``apply``).
            self._end_of_operation(forced=not decision.changed)
            self._raise_for(decision.verdict)
            state = decision.state
            return self._snapshot_from(
                rollout_id,
                state,
                lambda: self._kept_entries.take(rollout_id, state) or self._entries_of(paths, state),
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
        with self.deferred_state_files(hold_locks=True):
            for rollout_id in ids:
                with self._locked(rollout_id) as paths:
                    decision = self._apply_locked(
                        paths, RetireEvent(rollout_id=rollout_id), None, fence_only=True
                    )
                    removed[rollout_id] = bool(decision.verdict.removed)
        self._forced_barrier()
        for rollout_id in ids:
            with self._locked(rollout_id) as paths:
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
            with self._locked(rollout_id) as paths, _write_errors_named(delete):
                decision = self._apply_locked(paths, delete, None)
                removed[rollout_id] = bool(decision.verdict.removed)
        with _write_errors_named(DeleteEvent(rollout_id=ids[0])):
            self._forced_barrier()
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


_FilesIdentity = tuple[bytes | None, int, int, int]
"""What a cached state was recovered from: the state file's bytes and the side files' sizes.

The bytes, not the inode and times: a rename can reuse an inode within one timestamp tick, and comparing a
few kilobytes costs far less than parsing them.
"""


def _size_of(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return -1


def _files_identity(paths: RolloutPaths, state_bytes: bytes | None = None) -> _FilesIdentity:
    """Enough to tell that no one changed a rollout's files since a state was cached.

    ``state_bytes`` are what this store just wrote to the state file under the lock, so it is not read back.
    """
    return (
        read_no_follow(paths.state) if state_bytes is None else state_bytes,
        _size_of(paths.entries),
        _size_of(paths.intents),
        _size_of(paths.incomplete),
    )


def _check_ledger_lines(path: Path, state: RolloutState, lines: list[bytes]) -> None:
    """Every committed row sits where the state put it, under its own call id; the other lines are the failures.

    A ledger row lost, moved or swapped with another after it was written would otherwise be read as a
    manifest the ledger never recorded.
    """
    slots = {slot.start: (call_id, slot.length) for call_id, slot in state.ledger.items()}
    offset, rows, failures = 0, 0, 0
    for line in lines:
        found = slots.get(offset)
        if found is None:
            failures += 1
        elif len(line) != found[1] or b'"model_call_id":' + orjson.dumps(found[0]) not in line:
            raise StoreCorruptionError(
                f"{path} does not hold the ledger row of call {found[0]!r} at byte {offset} where its state "
                "says it was written; the ledger was changed outside tokcap, so the rollout cannot be trusted",
                rollout_id=state.rollout_id,
            )
        else:
            rows += 1
        offset += len(line)
    if rows != len(state.ledger) or failures != len(state.ledger_failures):
        raise StoreCorruptionError(
            f"{path} holds {rows} ledger rows and {failures} other lines where its state recorded "
            f"{len(state.ledger)} rows and {len(state.ledger_failures)} failures; the ledger was changed "
            "outside tokcap, so the rollout cannot be trusted",
            rollout_id=state.rollout_id,
        )


def _holds(path: Path, data: bytes) -> bool:
    """Whether a regular file holds exactly ``data``; its size is compared before its bytes are read."""
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    with os.fdopen(fd, "rb") as file:
        if os.fstat(file.fileno()).st_size != len(data):
            return False
        return file.read() == data


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


def _block_write_error(rollout_id: str, exc: OSError) -> StoreWriteError:
    """The tokcap error for an operating-system error while a single writer's block writes a rollout."""
    error = StoreWriteError(
        f"writing the projected block of rollout {rollout_id!r} failed at {exc.filename or 'a sync'}: "
        f"{exc.strerror or exc}; nothing past the last checkpoint was acknowledged to other processes, and the "
        "projection applies those events again when restarted. Free space or fix the device, then restart it",
        rollout_id=rollout_id,
    )
    error.errno, error.filename = exc.errno, exc.filename
    return error


def _removal_payload(ids: Sequence[str], removed: dict[str, bool]) -> RolloutRemovalPayload:
    return RolloutRemovalPayload(
        removed=tuple(rid for rid in ids if removed[rid]),
        not_found=tuple(rid for rid in ids if not removed[rid]),
    )
