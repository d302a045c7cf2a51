"""A command's answer, read back by its log position: the verdict it got and, for a freeze, the snapshot.

A command is decided at its log position and its rollout's state records the outcome there: the verdict of
every drop, retire and delete (``rules.recorded_verdict``) and the version every freeze answered
(``RolloutState.answer_at``), however many events came after it. So an answer is a read of a state that has
applied the position, wherever that state is held. Two readers give it by the same two calls:
``tokcap.files.log_projection.Projection`` (the process that applies the log: its memory first) and ``FileAnswers``
(a source following another process: the files, once that process's checkpoint passes the position).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import Event, FreezeEvent, LogPosition
from tokcap.log.rules import ApplyResult, recorded_verdict
from tokcap.log.state import RolloutState
from tokcap.protocols import TokenCaptureSnapshot

__all__ = ["FileAnswers", "LogAnswers", "command_verdict"]


def command_verdict(state: RolloutState, command: Event, position: LogPosition) -> ApplyResult:
    """The verdict of ``command`` applied at ``position``, from a state that applied it.

    A freeze's verdict carries the version it answered, and the snapshot id while the rollout stays frozen.
    """
    verdict = recorded_verdict(state, command, position)
    answer = state.answer_at(position) if isinstance(command, FreezeEvent) else None
    if answer is None:
        return verdict
    snapshot_id = None if state.is_open else state.snapshot_id
    return replace(verdict, snapshot_id=snapshot_id, version=answer.version)


class LogAnswers(Protocol):
    """The answers to commands applied from a log, by position; what a source asks once a command is applied.

    ``from_files`` false asks memory only (it never blocks; ``None`` when memory does not hold the answer);
    true reads the files where memory does not hold it, and the caller asks so only once the files hold the
    position (the checkpoint passed it).
    """

    def verdict_at(
        self, command: Event, position: LogPosition, *, from_files: bool = ...
    ) -> ApplyResult | None:
        """The verdict of ``command`` applied at ``position``."""
        ...

    def snapshot_at(
        self, rollout_id: str, position: LogPosition, *, from_files: bool = ...
    ) -> TokenCaptureSnapshot | None:
        """The snapshot the freeze applied at ``position`` answered."""
        ...


class FileAnswers:
    """Answers read from a store directory's files (``LogAnswers`` with no memory)."""

    def __init__(self, store: TokenCaptureStore) -> None:
        self._store = store

    def verdict_at(
        self, command: Event, position: LogPosition, *, from_files: bool = True
    ) -> ApplyResult | None:
        """The verdict of ``command`` applied at ``position``, from its rollout's state file."""
        if not from_files:
            return None
        return command_verdict(self._store.read_state(command.rollout_id), command, position)

    def snapshot_at(
        self, rollout_id: str, position: LogPosition, *, from_files: bool = True
    ) -> TokenCaptureSnapshot | None:
        """The snapshot the freeze at ``position`` answered; raises what ``TokenCaptureStore.snapshot`` raises."""
        if not from_files:
            return None
        return self._store.snapshot(rollout_id, as_of=position)
