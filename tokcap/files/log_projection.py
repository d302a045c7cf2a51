"""The single-writer projection of a capture log into a store directory: its memory is the truth.

One process owns a projected directory (the Kafka materializer holds its partitions' owner locks), so between
two flushes nothing but this object changes the rollouts it applies. It keeps each hot rollout's state and
accepted entries in memory (one cache) and decides each event with ``tokcap.log.rules.decide`` against that state.
What only adds to a rollout (an intent, a put, a mark, a freeze) is carried out in memory: its lines are queued
and written at the flush, one write per file and rollout. An event that removes files or writes a staged or
ledger row (drop, retire, delete, stage, ledger) first writes its rollout's queued lines, then the decision made
here is carried out (``tokcap.files.rollout_files``, the interpreter the shared store uses too; a fence is synced
before the removals it guards). A freeze is answered from memory as soon as it is applied.
``flush`` ends the block: queued lines and changed states are written once per rollout, synced together, the
states renamed into place and synced again; the caller writes its checkpoint only after that. The store never
reads a rollout's state while this object holds it: between flushes the files may be behind memory, never
ahead of it. This module writes files only through ``tokcap.files.rollout_files``; it calls nothing of the store.

It owns the answers by log position (``tokcap.files.log_answers``): ``verdict_at`` and ``snapshot_at`` answer a
command it applied from memory, and from the files only once they hold that position (its block flushed);
until then ``snapshot_at`` says so and the caller waits for the flush. A freeze is thus answered from memory as
soon as it is applied. Those two may be called from any thread: one lock guards the memory they read, and the
loop holds it while it applies an event or lets memory go.

Why an answer given before the flush is safe. A rollout's decisions are a pure function of its own events and
their log positions: the state after an event depends only on the events before it, and a freeze's snapshot id
and version come from its position, not from a clock or a random id. The freeze is durable in the log before
it is applied, and the checkpoint never passes an event whose block was not flushed. A restart therefore
resumes at or before every event applied since the last flush, cuts the files back to their last written
states (recovery drops the unflushed tails), and applies the same events in the same per-rollout order:
it reaches the same verdicts, the same snapshot and the same bytes. A trainer never holds an answer a restart
would decide differently.

Memory is bounded. Entries are kept up to ``hot_tokens`` prompt and generated tokens over all rollouts (the
least recently applied dropped first, at once: the files hold them, and a freeze of a rollout without kept
entries parses its file). States are kept up to ``hot_rollouts`` rollouts; a state is only let go at a flush,
once it is on disk, and is then read from its files again when its rollout comes back.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokcap.errors import StoreWriteError
from tokcap.files.entry_copies import fresh_read_copy
from tokcap.files.log_answers import FileAnswers, command_verdict
from tokcap.files.rollout_files import (
    QueuedLine,
    RolloutFiles,
    appended_entry,
    lines_that_may_wait,
    removes_files,
    snapshot_from,
)
from tokcap.log.events import Event, LogPosition, PutEvent, StageEvent
from tokcap.log.records import TokenEntry, token_count
from tokcap.log.rules import (
    ApplyOutcome,
    ApplyResult,
    Decision,
    WriteState,
    decide,
)
from tokcap.log.state import RolloutState
from tokcap.protocols import TokenCaptureSnapshot

if TYPE_CHECKING:
    from tokcap.files.store import TokenCaptureStore


__all__ = ["HOT_ROLLOUTS", "HOT_TOKENS", "Projection", "logger"]

logger = logging.getLogger(__name__)

HOT_TOKENS = 2_000_000
"""Prompt and generated tokens of entries kept in memory over every rollout (about 70 MB of Python ints)."""

HOT_ROLLOUTS = 4_096
"""Rollout states kept in memory after a flush; a colder one is read from its files when it is next applied."""


@dataclass(slots=True)
class _HotEntries:
    """One rollout's accepted entries in file order, and the bytes of its entries file their lines cover."""

    entries: list[TokenEntry] = field(default_factory=list)
    size: int = 0
    tokens: int = 0


class Projection:
    """Hot rollout states and entries of a directory one process owns; applies in blocks, answers from memory.

    Use it from one thread (the projection's loop): ``apply`` each event with its log position, ``snapshot`` to
    answer a freeze it applied, ``flush`` before writing a checkpoint, ``abandon`` when the loop fails.
    ``write_queued`` puts a rollout's queued lines in its files before the flush. ``verdict_at`` and
    ``snapshot_at`` answer other threads.
    """

    def __init__(
        self, store: TokenCaptureStore, *, hot_tokens: int = HOT_TOKENS, hot_rollouts: int = HOT_ROLLOUTS
    ) -> None:
        if hot_tokens < 0 or hot_rollouts < 0:
            raise ValueError(
                f"hot bounds must be 0 or more, got {hot_tokens} tokens and {hot_rollouts} rollouts"
            )
        self._store = store
        self._files: RolloutFiles = store.files
        self._hot_tokens = hot_tokens
        self._hot_rollouts = hot_rollouts
        self._states: OrderedDict[str, RolloutState] = OrderedDict()
        self._entries: OrderedDict[str, _HotEntries] = OrderedDict()
        self._tokens = 0
        self._open = False
        """Whether a block is open: something was applied since the last flush, or ``begin`` was called."""
        self._queued: dict[str, list[QueuedLine]] = {}
        """Per rollout, the lines decided in this block and not written yet, in order."""
        self._dirty: set[str] = set()
        """Rollouts whose state changed in memory in this block: written at the flush."""
        self._guard = threading.Lock()
        """Held while memory changes and while another thread reads it (``verdict_at``, ``snapshot_at``)."""
        self._answers_on_files = FileAnswers(store)

    @property
    def store(self) -> TokenCaptureStore:
        """The store whose files this projection writes."""
        return self._store

    @property
    def states(self) -> MutableMapping[str, RolloutState]:
        """Hot rollouts' states, by rollout id: the truth for their rollouts, ahead of the files until a flush."""
        return self._states

    @property
    def kept_tokens(self) -> int:
        """Prompt and generated tokens of the entries kept now."""
        return self._tokens

    def hot_rollouts(self) -> Iterator[str]:
        """The rollouts whose state is in memory, least recently applied first."""
        return iter(list(self._states))

    # ------------------------------------------------------------ blocks

    def begin(self) -> None:
        """Open a block if none is open, so the next ``flush`` syncs even when nothing was applied."""
        self._open = True

    def flush(self) -> None:
        """Write the block's lines and states and sync them; then let go of the coldest states past the bound."""
        if self._open:
            # The states are renamed after one sync of them and of the lines they cover, never before: a power
            # loss may keep a rename and lose unsynced bytes, leaving a state that names lines that are gone.
            with self._files.deferred_state_files():
                for rollout_id in sorted(self._dirty):
                    self._write(rollout_id, with_state=True)
            self._dirty.clear()
            self._open = False
            self._files.forced_barrier()
        with self._guard:
            while len(self._states) > self._hot_rollouts:
                self._forget(next(iter(self._states)))

    def abandon(self, error: BaseException) -> None:
        """End an open block after a failure: nothing more is written, and memory is forgotten.

        The files may then be ahead of their states; the next owner's recovery cuts them back and the events
        past its checkpoint are applied again.
        """
        logger.debug("abandoning the projection's block after %r", error)
        with self._guard:
            self._open = False
            self._states.clear()
            self._entries.clear()
            self._queued.clear()
            self._dirty.clear()
            self._tokens = 0

    # --------------------------------------------------------- decisions

    def apply(self, event: Event, position: LogPosition) -> ApplyResult:
        """Decide one event of the log against its rollout's state and carry it out; return its verdict.

        An event at or before its rollout's last applied position is skipped (the rules say so), so events
        applied again after a restart change nothing.
        """
        with self._guard:
            return self._apply(event, position)

    def _apply(self, event: Event, position: LogPosition) -> ApplyResult:
        self.begin()
        rollout_id = event.rollout_id
        state = self._states.get(rollout_id)
        if state is None:
            state = self._states[rollout_id] = self._resumed_state(rollout_id)
        decision = decide(state, event, position)
        if not decision.changed:
            self._states.move_to_end(rollout_id)
            return decision.verdict
        lines = lines_that_may_wait(decision.effects)
        if lines is None:
            self.write_queued(rollout_id)
            if removes_files(decision.effects):
                self._forget_entries(rollout_id)
            self._states[rollout_id] = decision.state
            self._states.move_to_end(rollout_id)
            if self._carry_out_now(event, decision):
                self._dirty.add(rollout_id)
            else:
                self._dirty.discard(rollout_id)
            return decision.verdict
        self._queued.setdefault(rollout_id, []).extend(lines)
        self._states[rollout_id] = decision.state
        self._dirty.add(rollout_id)
        self._states.move_to_end(rollout_id)
        if isinstance(event, PutEvent):
            appended = appended_entry(lines)
            if appended is not None:
                self._appended(rollout_id, event.entry, appended.start, len(appended.line))
        return decision.verdict

    def write_queued(self, rollout_id: str) -> None:
        """Write a rollout's queued lines now, so its files hold everything its state in memory says."""
        if self._queued.get(rollout_id):
            self._write(rollout_id, with_state=False)

    def _write(self, rollout_id: str, *, with_state: bool) -> None:
        """Write a rollout's queued lines, one write per file, then (``with_state``) its state in memory."""
        appends: list[QueuedLine | WriteState] = list(self._queued.pop(rollout_id, []))
        state = self._states.get(rollout_id) or RolloutState(rollout_id=rollout_id)
        if with_state:
            appends.append(WriteState(durable=True, state=self._states[rollout_id]))
        with self._files.locked(rollout_id) as paths:
            try:
                self._files.carry_out(paths, appends, state)
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc

    def _carry_out_now(self, event: Event, decision: Decision) -> bool:
        """Carry out what is not kept in memory until the flush (a drop, retire or delete, a staged or ledger row).

        The decided state is written where a barrier needs it on disk first (the fence before the removals it
        guards) and synced there; otherwise it is left for the flush. Return whether it is left for the flush.
        """
        rollout_id = event.rollout_id
        with self._files.locked(rollout_id) as paths:
            try:
                if (
                    isinstance(event, StageEvent)
                    and event.blob_bytes
                    and decision.verdict.outcome is ApplyOutcome.ACCEPTED
                ):
                    self._files.write_carried_blobs(paths, event)
                carried = self._files.carry_out(paths, decision.effects, decision.state, defer_state=True)
                if decision.sync_even_if_unchanged:
                    self._files.note_write()
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc
        return carried.state_due

    def _resumed_state(self, rollout_id: str) -> RolloutState:
        """A rollout's state as this writer resumes it, its files repaired first.

        Bytes no state covers (a tail appended before a crash) are cut, so its appends start where the state
        says. A rollout with no file yet starts empty without its lock being taken, so creating the lock file,
        the costliest step of a new rollout's first event on ext4, is left to the flush.
        """
        if not self._files.has_files(rollout_id):
            return RolloutState(rollout_id=rollout_id)
        with self._files.locked(rollout_id) as paths:
            try:
                recovered = self._files.recover(paths, replaying=True)
                return self._files.repaired(paths, recovered).state
            except StoreWriteError:
                raise
            except OSError as exc:
                raise _block_write_error(rollout_id, exc) from exc

    def _appended(self, rollout_id: str, entry: TokenEntry, start: int, length: int) -> None:
        """Keep an entry whose line now sits at byte ``start``; a line anywhere but next forgets the rollout."""
        hot = self._entries.get(rollout_id)
        if start == 0 or hot is None or hot.size != start:
            self._forget_entries(rollout_id)
            if start != 0:
                return
            hot = self._entries[rollout_id] = _HotEntries()
        else:
            self._entries.move_to_end(rollout_id)
        tokens = token_count(entry)
        hot.entries.append(entry)
        hot.size = start + length
        hot.tokens += tokens
        self._tokens += tokens
        while self._tokens > self._hot_tokens and self._entries:
            self._forget_entries(next(iter(self._entries)))

    # ----------------------------------------------------------- answers

    def state_of(self, rollout_id: str) -> RolloutState:
        """The rollout's state as decided so far: memory for a hot rollout, which is ahead of its files until the
        flush; the files for any other."""
        state = self._states.get(rollout_id)
        return self._files.read_state(rollout_id) if state is None else state

    def snapshot(self, rollout_id: str, as_of: LogPosition) -> TokenCaptureSnapshot:
        """The snapshot the freeze applied at ``as_of`` answered, from memory; the same one the files give.

        The entries are copies, exactly what parsing their lines gives and sharing nothing with what is kept;
        a rollout whose entries are not all kept is read from its file (under its lock, as far as its state).
        Raises what ``TokenCaptureStore.snapshot`` raises: a rollout not frozen, retired, or with no freeze there.
        """
        state = self.state_of(rollout_id)
        entries = self._copies(rollout_id, state)
        if entries is None:
            self.write_queued(rollout_id)
            with self._files.locked(rollout_id) as paths:
                entries = self._files.entries_of(paths, state)
        return snapshot_from(rollout_id, state, entries, as_of)

    def _copies(self, rollout_id: str, state: RolloutState) -> list[TokenEntry] | None:
        """Copies of the kept entries when they are every entry ``state`` accepts; else ``None``.

        They are the entries this projection appended itself, decoded and validated by its reader and held by
        nothing else, so their arrays are exact and the copies skip checking each value.
        """
        kept = self._kept(rollout_id, state)
        return None if kept is None else _fresh_copies(kept)

    def _kept(self, rollout_id: str, state: RolloutState) -> list[TokenEntry] | None:
        """The kept entries when they are every entry ``state`` accepts (a new list of them); else ``None``."""
        hot = self._entries.get(rollout_id)
        if state.retired or state.indexed_size == 0:
            return []
        if hot is None or hot.size != state.indexed_size or len(hot.entries) != len(state.entry_digests):
            return None
        return list(hot.entries)

    def verdict_at(
        self, command: Event, position: LogPosition, *, from_files: bool = True
    ) -> ApplyResult | None:
        """The verdict of the command this projection applied at ``position``; from any thread, once it is applied.

        Memory holds it while its rollout is hot; a state leaves memory only once its files hold it, so the
        files answer for any other (``None`` instead when ``from_files`` is false: the caller reads them where
        blocking is fine).
        """
        with self._guard:
            state = self._states.get(command.rollout_id)
        if state is not None:
            return command_verdict(state, command, position)
        return self._answers_on_files.verdict_at(command, position, from_files=from_files)

    def snapshot_at(
        self, rollout_id: str, position: LogPosition, *, from_files: bool = True
    ) -> TokenCaptureSnapshot | None:
        """The snapshot the freeze applied at ``position`` answered; from any thread, once it is applied.

        From memory when the rollout's state and every entry are kept. Otherwise ``None`` until the files hold
        the position: the caller waits for the flush of its block (the materializer's checkpoint passing it),
        then asks ``from_files``. Raises what ``TokenCaptureStore.snapshot`` raises: a rollout not frozen,
        retired, or with no freeze there.
        """
        with self._guard:
            state = self._states.get(rollout_id)
            kept = None if state is None else self._kept(rollout_id, state)
        if state is not None and kept is not None:
            copies = _fresh_copies(kept)
            if copies is not None:
                return snapshot_from(rollout_id, state, copies, position)
        return self._answers_on_files.snapshot_at(rollout_id, position, from_files=from_files)

    # ---------------------------------------------------------- eviction

    def _forget(self, rollout_id: str) -> None:
        self._states.pop(rollout_id, None)
        self._forget_entries(rollout_id)

    def _forget_entries(self, rollout_id: str) -> None:
        hot = self._entries.pop(rollout_id, None)
        if hot is not None:
            self._tokens -= hot.tokens


def _fresh_copies(entries: list[TokenEntry]) -> list[TokenEntry] | None:
    """Copies sharing nothing with what is kept; ``None`` if one cannot be copied without checking each value."""
    copies = []
    for entry in entries:
        copy = fresh_read_copy(entry, arrays_exact=True)
        if copy is None:
            return None
        copies.append(copy)
    return copies


def _block_write_error(rollout_id: str, exc: OSError) -> StoreWriteError:
    """The tokcap error for an operating-system error while this writer's block writes a rollout."""
    error = StoreWriteError(
        f"writing the projected block of rollout {rollout_id!r} failed at {exc.filename or 'a sync'}: "
        f"{exc.strerror or exc}; nothing past the last checkpoint was acknowledged to other processes, and the "
        "projection applies those events again when restarted. Free space or fix the device, then restart it",
        rollout_id=rollout_id,
    )
    error.errno, error.filename = exc.errno, exc.filename
    return error
