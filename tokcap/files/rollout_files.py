"""A rollout's files: the only code that writes them, and the one interpreter of the rules' effects.

``tokcap.log.rules`` decides what an event does as a list of effects; ``RolloutFiles.carry_out`` is the one place
they become file operations: appends at the byte they were decided at, state replacements, removals and
barriers. Both writers stand on it side by side. ``tokcap.files.store`` serves a directory several processes share
(recover, decide, carry out, under each rollout's lock); ``tokcap.files.log_projection`` owns its directory (decide,
queue in memory, carry out at its flush or at a barrier).

Durability rules kept here, whoever writes:

- Appends and blobs are written without syncs of their own and become durable in one filesystem sync shared
  with every concurrent writer (``tokcap.files.group_commit``).
- A state file is renamed only after a sync of it and of every line it covers: a power loss may keep a rename
  and lose unsynced bytes written before it, leaving a state that names lines that are gone.
- Blobs a row names are synced before the row's state is renamed.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from tokcap.errors import StoreCorruptionError
from tokcap.files.durable_io import (
    append_durably,
    fsync_directory,
    open_no_follow,
    read_no_follow,
    remove_if_exists,
    remove_stale_temp_files,
    replace_atomically,
    truncate_no_follow,
)
from tokcap.files.layout import RolloutPaths
from tokcap.files.recovery import CutTail, FinishRetire, Recovered, recover
from tokcap.files.write_batches import WriteBatches
from tokcap.log.events import LogPosition, StageEvent
from tokcap.log.records import TokenEntry
from tokcap.log.rules import (
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
from tokcap.log.state import RolloutState
from tokcap.protocols import TokenCaptureSnapshot

__all__ = [
    "AcceptedEntries",
    "Carried",
    "FilesIdentity",
    "QueuedLine",
    "RolloutFiles",
    "appended_entry",
    "files_identity",
    "lines_that_may_wait",
    "logger",
    "removes_files",
    "snapshot_from",
]

logger = logging.getLogger(__name__)

_REMEMBERED_PATHS = 65_536
"""How many validated rollout file sets are remembered."""

_REMEMBERED_LINES = 65_536
"""How many appended lines' call ids are remembered to re-index lagging tails without parsing them."""

_Append = AppendEntry | AppendIntent | AppendIncompleteMark | AppendStagedLine | AppendLedgerLine

QueuedLine = AppendEntry | AppendIntent | AppendIncompleteMark
"""A line a single writer may keep in memory until its flush: it only adds to an entry, intent or mark file."""

FilesIdentity = tuple[bytes | None, int, int, int]
"""What a cached state was recovered from: the state file's bytes and the side files' sizes.

The bytes, not the inode and times: a rename can reuse an inode within one timestamp tick, and comparing a
few kilobytes costs far less than parsing them.
"""


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


class RolloutFiles(WriteBatches):
    """Every rollout's files in one directory: locks, appends, states, blobs, removals, syncs, identities.

    The batches, syncs and state renames every write goes through are ``WriteBatches``'s.
    """

    def __init__(self, root: Path, *, on_records_removed: Callable[[str], None] | None = None) -> None:
        """Open (or create) the directory; ``on_records_removed`` hears of every rollout whose records go."""
        self._root = root
        self._on_records_removed = on_records_removed
        self._root.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self._root)
        super().__init__(self._root)
        self._call_ids_of_written_lines: dict[str, str] = {}
        self._paths: dict[str, RolloutPaths] = {}

    @property
    def root(self) -> Path:
        """The directory holding every rollout's files."""
        return self._root

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

    def locked(self, rollout_id: str) -> AbstractContextManager[RolloutPaths]:
        """Hold the rollout's exclusive file lock (``WriteBatches.holding``) and give its files."""
        return self.holding(self.paths_of(rollout_id))

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

    def staged_lines(
        self, paths: RolloutPaths, state: RolloutState, keys: Sequence[str]
    ) -> list[bytes | None]:
        """The stored line of each staged key ``state`` holds (``None`` for any other); the caller holds the lock."""
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
                    rollout_id=paths.rollout_id,
                )
        return lines

    def ledger_lines(self, paths: RolloutPaths, state: RolloutState) -> list[bytes]:
        """Every ledger line ``state`` committed (rows and failures), in order; the caller holds the lock."""
        if state.ledger_size == 0:
            return []
        with os.fdopen(open_no_follow(paths.ledger, os.O_RDONLY), "rb") as handle:
            data = handle.read(state.ledger_size)
        if len(data) != state.ledger_size:
            raise StoreCorruptionError(
                f"{paths.ledger} holds {len(data)} bytes, its state says {state.ledger_size}; restore it or "
                "replay the run",
                rollout_id=paths.rollout_id,
            )
        lines = data.splitlines(keepends=True)
        _check_ledger_lines(paths.ledger, state, lines)
        return [line.rstrip(b"\n") for line in lines]

    @contextmanager
    def accepted_entries(self, paths: RolloutPaths, state: RolloutState) -> Iterator[AcceptedEntries]:
        """Open the part of the entries file ``state`` accepts; the caller holds the lock."""
        if state.retired or state.indexed_size == 0:
            yield AcceptedEntries(None, 0, {}, None)
            return
        with os.fdopen(open_no_follow(paths.entries, os.O_RDONLY), "rb") as handle:
            found = os.fstat(handle.fileno())
            yield AcceptedEntries(
                (found.st_dev, found.st_ino), state.indexed_size, state.entry_digests, handle, paths.entries
            )


def lines_that_may_wait(effects: Sequence[Effect]) -> list[QueuedLine] | None:
    """The lines of effects that only add entry, intent or mark lines and change the state in place, so a
    single writer may keep them until its flush; ``None`` when one must be carried out now (a staged or ledger
    row, a given state, a barrier, a removal)."""
    lines: list[QueuedLine] = []
    for effect in effects:
        if isinstance(effect, QueuedLine):
            lines.append(effect)
        elif not isinstance(effect, WriteState) or effect.state is not None:
            return None
    return lines


def removes_files(effects: Sequence[Effect]) -> bool:
    """Whether effects remove a rollout's records or its state."""
    return any(isinstance(effect, RemoveRecords | RemoveState) for effect in effects)


def appended_entry(effects: Sequence[Effect]) -> AppendEntry | None:
    """The entry line effects append, if any."""
    for effect in effects:
        if isinstance(effect, AppendEntry):
            return effect
    return None


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
