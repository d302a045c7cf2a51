"""Index recovery: the state a rollout is really in, from its state file, its fence and its file tails.

The state file is the commit record: it says how many bytes of each side file it covers and which log
position it reflects. Files can be ahead of it (index writes lag on purpose in the file store; a crash can
land between an append and its state write), and a retire or delete can stop half-way. This module reads
what is on disk and says what the state is and which repairs make the files agree with it.

- A retired state is the fence; record files beside it mean the retire stopped half-way, and it is finished.
- Past the state, the file store folds the tails in: every complete line was acknowledged, by tokcap or by
  Gym's store (which counts a version per entry it finds there, as this does).
  A torn final line was never acknowledged; it is cut before the next append.
- Past a freeze tokcap recorded, only marker lines are folded: that freeze covered every line written before
  it, so any other line raced it and is cut.
- A frozen state that does not record the freeze was frozen by Gym's store, which refuses writes once frozen
  but never records the intents size, so every line past it was committed before that freeze: it is folded
  in and the freeze recorded as tokcap's would be, its dangling calls masking the snapshot.
- A projection resuming from its log instead cuts every tail back to the state and applies those events
  again: whatever lies past the state was never covered by a checkpoint.
  Reads of a projected rollout ignore such tails.
- A file shorter than the state says is corruption, never silently accepted.
- A directory of tokcap 0.1 (a fence file, or a state with a ``lifecycle`` key) is refused with the upgrade step.

Recovery only reads. Writers carry out the repairs under the rollout's lock; readers ignore them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from tokcap.errors import NewerSchemaError, RecordValidationError, StoreCorruptionError, StoreFormatError
from tokcap.files.durable_io import open_no_follow, read_no_follow
from tokcap.files.layout import RolloutPaths
from tokcap.log.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, entry_digest
from tokcap.log.rules import CANCEL_PREFIX, record_freeze
from tokcap.log.state import UPGRADE_STEP, IncompleteMark, IntentOp, RolloutState

__all__ = [
    "CutTail",
    "FinishRetire",
    "Recovered",
    "Repair",
    "call_id_of_entry_line",
    "recover",
]


@dataclass(frozen=True)
class CutTail:
    """Cut ``path`` back to ``size`` bytes (remove it when ``size`` is 0)."""

    path: Path
    size: int


@dataclass(frozen=True)
class FinishRetire:
    """A fence exists but the records were not removed yet: remove them and write the retired state."""


Repair = CutTail | FinishRetire


@dataclass(frozen=True)
class Recovered:
    """A rollout's state as recovered, the repairs a writer must carry out, and how far the index lagged."""

    state: RolloutState
    repairs: tuple[Repair, ...]
    lagging_lines: int
    state_file_exists: bool


def _size(path: Path) -> int:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return 0
    if stat.S_ISLNK(found.st_mode):
        raise StoreCorruptionError(
            f"{path} is a symbolic link; tokcap never follows links in its store directory (it could write "
            "outside it). Remove the link and restore the real file"
        )
    return found.st_size


def recover(paths: RolloutPaths, *, replaying: bool, remembered_lines: dict[str, str]) -> Recovered:
    """Recover one rollout; the caller holds its lock.

    ``replaying`` says the caller applies events from a log it will re-read after a crash.
    ``remembered_lines`` maps the sha256 of lines this process appended to their call ids, so a lagging
    tail is hashed instead of parsed.
    """
    state_bytes = read_no_follow(paths.state)
    if os.path.lexists(paths.fence):
        raise StoreFormatError(f"{paths.fence}: {UPGRADE_STEP}", rollout_id=paths.rollout_id)
    if state_bytes is None:
        return _tails(paths, RolloutState(rollout_id=paths.rollout_id), replaying, remembered_lines, False)
    state = RolloutState.decode(state_bytes, str(paths.state), paths.rollout_id)
    if state.retired:
        leftovers = any(os.path.lexists(path) for path in paths.records)
        return Recovered(state, (FinishRetire(),) if leftovers else (), 0, True)
    return _tails(paths, state, replaying, remembered_lines, True)


def _tails(
    paths: RolloutPaths, state: RolloutState, replaying: bool, remembered_lines: dict[str, str], exists: bool
) -> Recovered:
    sizes = {
        paths.entries: state.indexed_size,
        paths.intents: state.intents_size,
        paths.incomplete: state.incomplete_size,
    }
    cuts: list[Repair] = []
    grown: list[Path] = []
    for path, covered in sizes.items():
        size = _size(path)
        if size < covered:
            raise StoreCorruptionError(
                f"{path} is {size} bytes but the state covers {covered}; the file was truncated outside tokcap; "
                "restore it from a backup or delete the rollout",
                rollout_id=state.rollout_id,
            )
        if size > covered:
            grown.append(path)
    projected = state.last_position is not None
    if grown and (replaying or projected):
        cuts.extend(CutTail(path, sizes[path]) for path in grown)
        return Recovered(state, tuple(cuts), 0, exists)
    frozen_by_gym = not state.is_open and not state.covers_freeze and not projected
    if not state.is_open and state.covers_freeze:
        cuts.extend(CutTail(path, sizes[path]) for path in grown if path != paths.incomplete)
        grown = [path for path in grown if path == paths.incomplete]
    if not grown and not frozen_by_gym:
        return Recovered(state, tuple(cuts), 0, exists)
    lagging = 0
    if paths.entries in grown:
        state, lines = _fold_entries(paths.entries, state, cuts, remembered_lines)
        lagging += lines
    if paths.intents in grown:
        state, lines = _fold_intents(paths.intents, state, cuts)
        lagging += lines
    if paths.incomplete in grown:
        state, lines = _fold_marks(paths.incomplete, state, cuts)
        lagging += lines
    if frozen_by_gym:
        state = record_freeze(state)
    return Recovered(state, tuple(cuts), lagging, exists)


def _complete_lines(path: Path, start: int) -> tuple[list[bytes], bool]:
    """The complete lines past ``start``, and whether a torn final line follows them."""
    with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as handle:
        handle.seek(start)
        tail = handle.read()
    pieces = tail.split(b"\n")
    return pieces[:-1], bool(pieces[-1])


def _parse_tail(
    path: Path, start: int, state: RolloutState, cuts: list[Repair], parse: Callable[[bytes], None]
) -> tuple[int, int]:
    """Parse the complete lines past ``start`` with ``parse``; return (bytes consumed, lines parsed).

    A malformed or torn final line was never acknowledged: it is cut. A malformed line followed by more is
    corruption.
    """
    lines, torn = _complete_lines(path, start)
    consumed = 0
    for index, line in enumerate(lines):
        try:
            parse(line)
        except RecordValidationError as exc:
            if type(exc) is not RecordValidationError:
                raise
            if index == len(lines) - 1 and not torn:
                torn = True
                break
            raise StoreCorruptionError(
                f"{path} has a malformed line at byte {start + consumed} followed by more content: {exc}; "
                "the file is corrupt",
                rollout_id=state.rollout_id,
            ) from exc
        consumed += len(line) + 1
    else:
        index = len(lines)
    if torn:
        cuts.append(CutTail(path, start + consumed))
    return consumed, index


def _json_object(line: bytes, what: str) -> dict[str, object]:
    try:
        raw = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise RecordValidationError(f"{what} line is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecordValidationError(f"{what} line is not a JSON object")
    return raw


def call_id_of_entry_line(line: bytes) -> str:
    """Read just the call id of a stored entry line; full validation happens when entries are read."""
    raw = _json_object(line, "entry")
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


def _fold_entries(
    path: Path, state: RolloutState, cuts: list[Repair], remembered: dict[str, str]
) -> tuple[RolloutState, int]:
    """Index entry lines past the state; each counts a version, and a second payload for a call id masks.

    The put rule (``rules._put``) written again for lines another writer (Gym's store) appended: reading a
    tail is all this module does, so it folds what the lines say rather than deciding events.
    """
    digests = dict(state.entry_digests)
    marks = list(state.incomplete_marks)

    def fold(line: bytes) -> None:
        digest = entry_digest(line)
        call_id = remembered.get(digest)
        if call_id is None:
            call_id = call_id_of_entry_line(line)
        known = digests.get(call_id)
        if known is not None and known != digest:
            marks.append(
                IncompleteMark(model_call_id=call_id, reason="conflicting durable payloads for a call id")
            )
        elif known is None:
            digests[call_id] = digest

    consumed, lines = _parse_tail(path, state.indexed_size, state, cuts, fold)
    folded = state.evolve(
        entry_digests=digests,
        incomplete_marks=tuple(marks),
        incomplete=state.incomplete or len(marks) > len(state.incomplete_marks),
        version=state.version + lines,
        indexed_size=state.indexed_size + consumed,
    )
    return folded, lines


def _fold_intents(path: Path, state: RolloutState, cuts: list[Repair]) -> tuple[RolloutState, int]:
    """Each intent line is a call id (Gym's format); a cancel is the call id after ``CANCEL_PREFIX``."""
    intents = state.intents.mutate()

    def fold(line: bytes) -> None:
        call_id = _call_id_of_side_line(line, "intent")
        op = IntentOp.INTENT
        if call_id.startswith(CANCEL_PREFIX):
            call_id, op = call_id[len(CANCEL_PREFIX) :], IntentOp.CANCEL
        if not call_id:
            raise RecordValidationError("intent line names no call")
        intents[call_id] = op

    consumed, lines = _parse_tail(path, state.intents_size, state, cuts, fold)
    return state.evolve(intents=intents.finish(), intents_size=state.intents_size + consumed), lines


def _fold_marks(path: Path, state: RolloutState, cuts: list[Repair]) -> tuple[RolloutState, int]:
    """Each marker line is a call id, maybe empty (Gym's format); its writer already counted the version."""
    marks = list(state.incomplete_marks)

    def fold(line: bytes) -> None:
        mark = IncompleteMark(model_call_id=_call_id_of_side_line(line, "incomplete"))
        if mark not in marks:
            marks.append(mark)

    consumed, lines = _parse_tail(path, state.incomplete_size, state, cuts, fold)
    folded = state.evolve(
        incomplete_marks=tuple(marks),
        incomplete_size=state.incomplete_size + consumed,
        incomplete=state.incomplete or bool(marks),
    )
    return folded, lines


def _call_id_of_side_line(line: bytes, what: str) -> str:
    try:
        text = line.decode()
    except UnicodeDecodeError as exc:
        raise RecordValidationError(f"{what} line is not UTF-8: {exc}") from exc
    if text.startswith("{"):
        raise StoreFormatError(f"the {what} file holds a JSON line: {UPGRADE_STEP}")
    return text.strip(" \t\r")
