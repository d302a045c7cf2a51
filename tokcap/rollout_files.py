"""A rollout's files: the only code that writes them, and the one interpreter of the rules' effects.

``tokcap.rules`` decides what an event does as a list of effects; ``RolloutFiles.carry_out`` is the one place
they become file operations: appends at the byte they were decided at, state replacements, removals and
barriers. Both writers stand on it side by side. ``tokcap.store`` serves a directory several processes share
(recover, decide, carry out, under each rollout's lock); ``tokcap.log_projection`` owns its directory (decide,
queue in memory, carry out at its flush or at a barrier).

Durability rules kept here, whoever writes:

- Appends and blobs are written without syncs of their own and become durable in one filesystem sync shared
  with every concurrent writer (``tokcap.group_commit``).
- A state file is renamed only after a sync of it and of every line it covers: a power loss may keep a rename
  and lose unsynced bytes written before it, leaving a state that names lines that are gone.
- Blobs a row names are synced before the row's state is renamed.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tokcap.errors import StoreCorruptionError
from tokcap.events import LogPosition, StageEvent
from tokcap.group_commit import GroupCommitter, filesystem_sync_for
from tokcap.layout import RolloutPaths
from tokcap.locks import RolloutHold, RolloutLocks
from tokcap.protocols import TokenCaptureSnapshot
from tokcap.records import TokenEntry
from tokcap.recovery import CutTail, FinishRetire, Recovered, recover
from tokcap.rules import (
    AppendEntry,
    AppendIncompleteMark,
    AppendIntent,
    AppendLedgerLine,
    AppendStagedLine,
    Barrier,
    Effect,
    RemoveRecords,
    RemoveState,
    WriteState,
    snapshot_of,
)
from tokcap.state import RolloutState

__all__ = ["Carried", "FilesIdentity", "RolloutFiles", "files_identity", "logger", "snapshot_from"]

logger = logging.getLogger(__name__)

_REMEMBERED_PATHS = 65_536
"""How many validated rollout file sets are remembered."""

_REMEMBERED_LINES = 65_536
"""How many appended lines' call ids are remembered to re-index lagging tails without parsing them."""

_PENDING_STATE_LOCKS = 64
"""Most rollout locks a writer thread's batch holds for states it has not renamed yet; past it (a retire of many
rollouts), the states written so far are synced and renamed, so a batch never needs a descriptor per rollout."""

_Append = AppendEntry | AppendIntent | AppendIncompleteMark | AppendStagedLine | AppendLedgerLine

FilesIdentity = tuple[bytes | None, int, int, int]
"""What a cached state was recovered from: the state file's bytes and the side files' sizes.

The bytes, not the inode and times: a rename can reuse an inode within one timestamp tick, and comparing a
few kilobytes costs far less than parsing them.
"""


class _WriterBatch(threading.local):
    """Whether this thread is running an operation of a batch whose one barrier makes it durable before its
    caller is answered; and the state files this thread wrote but has not renamed yet.

    ``deferring`` says a block of deferred state files (``RolloutFiles.deferred_state_files``) is running, whose
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


@dataclass(frozen=True, slots=True)
class Carried:
    """What ``RolloutFiles.carry_out`` left behind.

    ``state_written``: the state file holds the decided state. ``identity``: the files' identity after the
    effects when it is known without asking the filesystem again (only appends at checked sizes and a state
    written from known bytes); ``None`` after anything else. ``state_due``: a deferred state change is left for
    the caller's flush.
    """

    state_written: bool
    identity: FilesIdentity | None
    state_due: bool


class RolloutFiles:
    """Every rollout's files in one directory: locks, appends, states, blobs, removals, syncs, identities."""

    def __init__(self, root: Path, *, on_records_removed: Callable[[str], None] | None = None) -> None:
        """Open (or create) the directory; ``on_records_removed`` hears of every rollout whose records go."""
        self._root = root
        self._on_records_removed = on_records_removed
        self._root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self._root)
        self._commit = GroupCommitter(filesystem_sync_for(self._root))
        self._batch = _WriterBatch()
        self._rollout_locks = RolloutLocks()
        self._call_ids_of_written_lines: dict[str, str] = {}
        self._paths: dict[str, RolloutPaths] = {}

    @property
    def root(self) -> Path:
        """The directory holding every rollout's files."""
        return self._root

    @property
    def syncs(self) -> int:
        """How many filesystem syncs these files have cost; benchmarks report it."""
        return self._commit.syncs

    # ------------------------------------------------------------ durability

    def run_in_batch(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one operation of a batch; its writes become durable at the batch's ``barrier``."""
        self._batch.running = True
        try:
            return function(*args)
        finally:
            self._batch.running = False

    def note_write(self) -> None:
        """Note a change the next barrier must make durable, even one made by another process."""
        self._commit.note_write()

    def barrier(self) -> None:
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

    def forced_barrier(self) -> None:
        """Sync even if nothing was written here: another process may have removed files without syncing yet."""
        self._commit.note_write()
        self.barrier()

    def end_of_operation(self, *, forced: bool = False) -> None:
        """Make the operation durable now, unless the batch running it does so before answering its caller."""
        if forced:
            self._commit.note_write()
        if not self._batch.running:
            self.barrier()

    # ----------------------------------------------------------------- paths

    def paths_of(self, rollout_id: str) -> RolloutPaths:
        """A rollout's files; remembered because building them showed up in every operation's profile."""
        paths = self._paths.get(rollout_id)
        if paths is None:
            if len(self._paths) >= _REMEMBERED_PATHS:
                self._paths.clear()
            paths = self._paths[rollout_id] = RolloutPaths.of(self._root, rollout_id)
        return paths

    def has_files(self, rollout_id: str) -> bool:
        """Whether any file of the rollout exists, its lock file included.

        Every file is looked for, not the lock file alone: writers create it before any record file, but a
        power loss may keep a record file and lose the lock file's creation, which was never synced.
        """
        paths = self.paths_of(rollout_id)
        return any(os.path.lexists(path) for path in (paths.lock, paths.state, *paths.records, paths.fence))

    @contextmanager
    def locked(self, rollout_id: str) -> Iterator[RolloutPaths]:
        """Hold the rollout's exclusive file lock; it serializes threads and processes alike.

        A state file of the rollout this thread has not renamed yet is renamed first (or dropped when it only
        indexes lines, as an index write that is skipped), so the files are the rollout's truth again.
        """
        paths = self.paths_of(rollout_id)
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

        A state may only be renamed once it and the lines it covers are durable, and one sync for many states is
        much cheaper than one per state. The caller syncs after the block to make the renames durable.
        ``hold_locks`` keeps each rollout's lock until its rename, for a writer that does not own its rollouts.
        Inside a batch or another such block, the renames are left to it. A block that fails on its own renames
        nothing.
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

    def recover(self, paths: RolloutPaths, *, replaying: bool) -> Recovered:
        """The rollout's state from its files and the repairs that make them agree with it; only reads."""
        return recover(paths, replaying=replaying, remembered_lines=self._call_ids_of_written_lines)

    def repaired(self, paths: RolloutPaths, recovered: Recovered) -> Recovered:
        """Carry out the repairs recovery asked for; the caller holds the rollout's lock."""
        for repair in recovered.repairs:
            if isinstance(repair, CutTail):
                self._cut(repair)
            elif isinstance(repair, FinishRetire):
                self.remove_records(paths)
        return Recovered(recovered.state, (), recovered.lagging_lines, recovered.state_file_exists)

    def read_state(self, rollout_id: str) -> RolloutState:
        """The rollout's state from its files, under its lock, without repairing anything."""
        with self.locked(rollout_id) as paths:
            return self.recover(paths, replaying=False).state

    def _cut(self, cut: CutTail) -> None:
        """Cut bytes no state covers: a torn line never acknowledged, or a projection's unapplied tail."""
        logger.warning("cutting %s back to %d bytes: they were never committed", cut.path, cut.size)
        if cut.size == 0:
            remove_if_exists(cut.path)
        else:
            truncate_no_follow(cut.path, cut.size)
        self._commit.note_write()

    # ----------------------------------------------------------------- blobs

    def write_blobs(self, rollout_id: str, blobs: Mapping[str, bytes], *, wait: bool = True) -> list[Path]:
        """Write blobs (bytes by their SHA-256) without syncs of their own; return the files created.

        A blob already on disk is kept only if it holds exactly these bytes (a crash before the sync may have
        left a file of the right name and size with other contents). It may be another writer's still in flight,
        so the sync is waited for even when nothing was written. Without ``wait`` the sync is left to the
        caller's next barrier.
        """
        created: list[Path] = []
        if not blobs:
            return created
        for sha256, data in blobs.items():
            path = self.paths_of(rollout_id).blob(sha256)
            if _holds(path, data):
                continue
            path.parent.mkdir(exist_ok=True)
            replace_atomically(path, data, durable=False)
            created.append(path)
        self._commit.note_write()
        if wait:
            self.barrier()
        return created

    def write_carried_blobs(self, paths: RolloutPaths, event: StageEvent) -> None:
        """Write the blobs a stage read from a log brought, durably, before the row that names them.

        The caller writes them only for an accepted stage, so a refused one leaves no file. A blob already on
        disk is kept only if it holds exactly these bytes, as in ``write_blobs``.
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

    # ------------------------------------------------------------ carrying out

    def carry_out(
        self,
        paths: RolloutPaths,
        effects: Sequence[Effect],
        state: RolloutState,
        *,
        identity: FilesIdentity | None = None,
        index_write_due: bool = False,
        defer_state: bool = False,
        stop_at_barrier: bool = False,
    ) -> Carried:
        """Carry out effects on one rollout's files, in order; the caller holds the rollout's lock.

        ``state`` is the decided state an index write (``WriteState`` without a state of its own) writes. A
        writer that keeps the truth in memory passes ``defer_state``: such a write is left for its flush, unless
        a barrier needs the state on disk first (the fence before the removals it guards). Otherwise it is
        written when durable, when the state records a log position, or when ``index_write_due`` says the index
        lags enough. Consecutive appends to one file are written at once; each must start where the previous
        one ended, the first at the file's size. ``stop_at_barrier`` stops before the first barrier (phase
        one of a retire whose caller syncs once for all). With the files' ``identity`` before the effects, the
        identity after them is returned when it is known without asking the filesystem again.
        """
        state_written, state_due, exact = False, False, identity is not None
        known_state, entries_size, intents_size, incomplete_size = identity or (None, -1, -1, -1)
        run: list[_Append] = []
        for effect in effects:
            if isinstance(effect, _Append):
                run.append(effect)
                continue
            if run:
                entries_size, intents_size, incomplete_size = self._append_run(
                    paths, run, entries_size, intents_size, incomplete_size
                )
                run = []
            if isinstance(effect, WriteState) and effect.state is not None:
                self.replace_state_file(paths, effect.state, durable=True)
                exact = False
            elif isinstance(effect, WriteState) and defer_state:
                state_due = True
            elif isinstance(effect, WriteState):
                if effect.durable or state.last_position is not None or index_write_due:
                    known_state = self.replace_state_file(
                        paths,
                        state,
                        durable=effect.durable,
                        index_only=not effect.durable and state.last_position is None,
                    )
                    state_written = True
            elif isinstance(effect, Barrier):
                if state_due:
                    self.replace_state_file(paths, state, durable=True)
                    state_due, exact = False, False
                if stop_at_barrier:
                    return Carried(state_written, None, state_due)
                self.barrier()
            elif isinstance(effect, RemoveRecords):
                self.remove_records(paths)
                exact = False
            elif isinstance(effect, RemoveState):
                self.remove(paths.state)
                state_written, exact = False, False
        if run:
            entries_size, intents_size, incomplete_size = self._append_run(
                paths, run, entries_size, intents_size, incomplete_size
            )
        if not exact:
            return Carried(state_written, None, state_due)
        return Carried(state_written, (known_state, entries_size, intents_size, incomplete_size), state_due)

    def _append_run(
        self, paths: RolloutPaths, run: list[_Append], entries: int, intents: int, incomplete: int
    ) -> tuple[int, int, int]:
        """Append consecutive decided lines, one write per file; return the three side files' sizes after."""
        by_file: dict[Path, tuple[int, list[bytes]]] = {}
        for effect in run:
            if isinstance(effect, AppendEntry):
                path = paths.entries
                self._remember_written_line(effect.digest, effect.model_call_id)
            elif isinstance(effect, AppendIntent):
                path = paths.intents
            elif isinstance(effect, AppendIncompleteMark):
                path = paths.incomplete
            else:
                path = paths.staged if isinstance(effect, AppendStagedLine) else paths.ledger
            found = by_file.get(path)
            if found is None:
                by_file[path] = (effect.start, [effect.line])
                continue
            start, lines = found
            if effect.start != start + sum(len(line) for line in lines):
                raise StoreCorruptionError(
                    f"appends to {path} do not follow one another (a line at byte {effect.start}); this is a bug "
                    "in the writer that decided them: restart it, it applies the events again",
                    rollout_id=paths.rollout_id,
                )
            lines.append(effect.line)
        for path, (start, lines) in by_file.items():
            if (path == paths.staged or path == paths.ledger) and _size_of(path) > start:
                # Bytes past a staged or ledger line's start were never acknowledged.
                self._cut(CutTail(path, start))
            size = self._append(path, b"".join(lines), start, paths.rollout_id)
            if path == paths.entries:
                entries = size
            elif path == paths.intents:
                intents = size
            elif path == paths.incomplete:
                incomplete = size
        return entries, intents, incomplete

    def _append(self, path: Path, line: bytes, expected_start: int, rollout_id: str) -> int:
        """Append bytes and return the file's size after them; they become durable at the next barrier."""
        start = append_durably(path, line, durable=False)
        self._commit.note_write()
        if start != expected_start:
            raise StoreCorruptionError(
                f"{path} grew outside the rollout lock (expected {expected_start} bytes, found {start}); "
                "another program is writing to the store",
                rollout_id=rollout_id,
            )
        return start + len(line)

    def replace_state_file(
        self, paths: RolloutPaths, state: RolloutState, *, durable: bool, index_only: bool = False
    ) -> bytes:
        """Replace the state file atomically; return the bytes it now holds.

        The rename waits for a filesystem sync (shared with concurrent writers) of the new file and of every
        line it covers. A power loss may keep a rename and lose bytes written before it that were not synced:
        the state file would be found empty, or naming lines that are gone, and recovery would call a rollout
        corrupt whose operations had returned ok. A ``durable`` state is synced again at the operation's
        barrier; an ``index_only`` one need not be (its lines are the record, folded in while it lags).
        A batch (and a block of deferred state files) renames its states together at its end, under their locks.
        """
        data = state.encode()
        if not (self._batch.running or self._batch.deferring):
            replace_atomically(paths.state, data, durable=False, before_rename=self.forced_barrier)
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

    def remove(self, path: Path) -> None:
        """Remove a file if it exists; the removal becomes durable at the next barrier."""
        if remove_if_exists(path):
            self._commit.note_write()

    def remove_records(self, paths: RolloutPaths) -> None:
        """Remove the record files; the blob directory goes first, so a crash leaves a staged file to finish it."""
        if self._on_records_removed is not None:
            self._on_records_removed(paths.rollout_id)
        if os.path.isdir(paths.blobs) and not os.path.islink(paths.blobs):
            for name in os.listdir(paths.blobs):
                self.remove(paths.blobs / name)
            try:
                os.rmdir(paths.blobs)
            except OSError as exc:
                # A late stage racing the retire wrote a blob after the listing; its row is refused by the
                # fence, and the blob goes with the rollout's delete.
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise
            self._commit.note_write()
        for path in paths.records:
            self.remove(path)

    def _remember_written_line(self, digest: str, call_id: str) -> None:
        """Remember the call id of a line appended here, keyed by the line's sha256.

        Re-indexing a lagging tail then hashes each line instead of parsing it: equal digests mean equal bytes,
        so the call id is the one written here. Bounded: forgotten lines are simply parsed again.
        """
        if len(self._call_ids_of_written_lines) >= _REMEMBERED_LINES:
            self._call_ids_of_written_lines.clear()
        self._call_ids_of_written_lines[digest] = call_id

    # ------------------------------------------------------------------ reads

    def entries_of(self, paths: RolloutPaths, state: RolloutState) -> list[TokenEntry]:
        """The entries ``state`` accepts, parsed from the rollout's file; the caller holds the rollout's lock."""
        if state.retired or state.indexed_size == 0:
            return []
        with os.fdopen(open_no_follow(paths.entries, os.O_RDONLY), "rb") as handle:
            data = handle.read(state.indexed_size)
        return [TokenEntry.from_json(line) for line in data.split(b"\n") if line]


def snapshot_from(
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


def _size_of(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return -1


def files_identity(paths: RolloutPaths) -> FilesIdentity:
    """Enough to tell that no one changed a rollout's files since a state was recovered from them."""
    return (
        read_no_follow(paths.state),
        _size_of(paths.entries),
        _size_of(paths.intents),
        _size_of(paths.incomplete),
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
