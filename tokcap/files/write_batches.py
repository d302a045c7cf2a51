"""Writes that become durable together: one filesystem sync for a batch, and the state files it renames.

A rollout's lines, blobs and removals are written without syncs of their own; a barrier waits for one sync
shared with every concurrent writer (``tokcap.files.group_commit``). A state file is renamed only after a sync of it
and of every line it covers: a power loss may keep a rename and lose unsynced bytes written before it, leaving
a state that names lines that are gone. A batch on the store's writer thread, or a block of a single writer,
leaves its state files beside their targets and renames them together after one sync, so a batch of freezes
costs two syncs, not two each. ``tokcap.files.rollout_files`` builds every file operation on this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokcap.files.durable_io import rename_over, replace_atomically, write_temp_sibling
from tokcap.files.group_commit import GroupCommitter, filesystem_sync_for
from tokcap.files.layout import RolloutPaths
from tokcap.files.locks import RolloutHold, RolloutLocks
from tokcap.log.state import RolloutState

__all__ = ["WriteBatches"]

_PENDING_STATE_LOCKS = 64
"""Most rollout locks a writer thread's batch holds for states it has not renamed yet; past it (a retire of many
rollouts), the states written so far are synced and renamed, so a batch never needs a descriptor per rollout."""


class _WriterBatch(threading.local):
    """Whether this thread is running an operation of a batch whose one barrier makes it durable before its
    caller is answered; and the state files this thread wrote but has not renamed yet.

    ``deferring`` says a block of deferred state files (``WriteBatches.deferred_state_files``) is running, whose
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


class WriteBatches:
    """The group commit, this thread's batch and the rollout locks of one directory."""

    def __init__(self, root: Path) -> None:
        self._commit = GroupCommitter(filesystem_sync_for(root))
        self._batch = _WriterBatch()
        self._rollout_locks = RolloutLocks()

    @property
    def syncs(self) -> int:
        """How many filesystem syncs these files have cost; benchmarks report it."""
        return self._commit.syncs

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

    @contextmanager
    def holding(self, paths: RolloutPaths) -> Iterator[RolloutPaths]:
        """Hold the rollout's exclusive file lock; it serializes threads and processes alike.

        A state file of the rollout this thread has not renamed yet is renamed first (or dropped when it only
        indexes lines, as an index write that is skipped), so the files are the rollout's truth again.
        """
        with self._rollout_locks.hold(paths.lock):
            pending = self._batch.pending.get(paths.rollout_id)
            if pending is not None and pending.index_only:
                self._batch.pending.pop(paths.rollout_id).drop()
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
