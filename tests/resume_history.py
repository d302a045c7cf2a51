"""A scripted log of every event kind, cut into the blocks a projection applies together.

Shared by the resume test and the worker process it kills, so both apply the very same events.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from factories import make_entry

from tokcap.files.layout import RolloutPaths
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
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
)
from tokcap.log.rules import decide, snapshot_id_at
from tokcap.log.state import RolloutState

TOPIC = "resume-topic"


def _put(rollout_id: str, call_id: str, generation: tuple[int, ...] = (4, 5)) -> PutEvent:
    return PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, generation=generation))


class _DropOfFreezeAt:
    """A drop of the snapshot the freeze at ``offset`` answered; ``stale`` drops it with an older version."""

    def __init__(self, rollout_id: str, offset: int, *, stale: bool = False) -> None:
        self.rollout_id, self.offset, self.stale = rollout_id, offset, stale


def _resolved(blocks: list[list[Event | _DropOfFreezeAt]]) -> list[list[Event]]:
    """Replace each drop placeholder by the drop of the snapshot the rules answered at that freeze."""
    states: dict[str, RolloutState] = {}
    resolved: list[list[Event]] = []
    offset = 0
    for block in blocks:
        events: list[Event] = []
        for item in block:
            state = states.get(item.rollout_id) or RolloutState(rollout_id=item.rollout_id)
            if isinstance(item, _DropOfFreezeAt):
                position = LogPosition(TOPIC, 0, item.offset)
                answer = state.answer_at(position)
                assert answer is not None, f"no freeze at offset {item.offset}"
                version = answer.version - 1 if item.stale else answer.version
                event: Event = DropEvent(
                    rollout_id=item.rollout_id, snapshot_id=snapshot_id_at(position), version=version
                )
            else:
                event = item
            states[item.rollout_id] = decide(state, event, LogPosition(TOPIC, 0, offset)).state
            events.append(event)
            offset += 1
        resolved.append(events)
    return resolved


def _build() -> list[list[Event]]:
    blocks: list[list[Event | _DropOfFreezeAt]] = [
        [
            IntentEvent(rollout_id="a", model_call_id="c1"),
            _put("a", "c1"),
            IntentEvent(rollout_id="b", model_call_id="c1"),
            CancelEvent(rollout_id="b", model_call_id="c1"),
            IntentEvent(rollout_id="a", model_call_id="c2"),
        ],
        [
            CancelEvent(rollout_id="a", model_call_id="c2"),
            IntentEvent(rollout_id="a", model_call_id="c2"),
            _put("a", "c2"),
            _put("a", "c2"),
            _put("b", "x"),
        ],
        [
            IncompleteEvent(rollout_id="b", model_call_id="y", reason="lost"),
            IncompleteEvent(rollout_id="b", model_call_id="y", reason="lost"),
            _put("a", "c1", generation=(9, 9)),
            FreezeEvent(rollout_id="a"),
            _put("a", "late"),
        ],
        [
            IntentEvent(rollout_id="a", model_call_id="late2"),
            IncompleteEvent(rollout_id="a", model_call_id="late", reason="after the cut"),
            FreezeEvent(rollout_id="a"),
            _DropOfFreezeAt("a", 13),
            FreezeEvent(rollout_id="b"),
        ],
        [
            _DropOfFreezeAt("b", 19, stale=True),
            _DropOfFreezeAt("b", 19),
            RetireEvent(rollout_id="c"),
            _put("c", "c1"),
            DeleteEvent(rollout_id="c"),
            IntentEvent(rollout_id="c", model_call_id="c1"),
            _put("c", "c1"),
        ],
        [
            DeleteEvent(rollout_id="a"),
            IntentEvent(rollout_id="a", model_call_id="c9"),
            _put("a", "c9"),
            FreezeEvent(rollout_id="a"),
            _DropOfFreezeAt("a", 30),
        ],
        [
            FreezeEvent(rollout_id="c"),
            RetireEvent(rollout_id="c"),
            RetireEvent(rollout_id="c"),
            DeleteEvent(rollout_id="b"),
            FreezeEvent(rollout_id="b"),
            RetireEvent(rollout_id="a"),
        ],
    ]
    return _resolved(blocks)


BLOCKS = _build()


def block_start(block: int) -> int:
    """The log offset of the first event of ``block``: where a projection killed inside it resumes."""
    return sum(len(events) for events in BLOCKS[:block])


def apply_blocks(projection: Projection, first_block: int = 0, end_block: int | None = None) -> None:
    """Apply blocks ``first_block`` up to ``end_block``, each flushed at its end, as the materializer does."""
    offset = block_start(first_block)
    for events in BLOCKS[first_block:end_block]:
        for event in events:
            projection.apply(event, LogPosition(TOPIC, 0, offset))
            offset += 1
        projection.flush()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_until_killed(root: Path, block: int, events_before_kill: int, state_writes_before_kill: int) -> None:
    """Apply the blocks before ``block``, then die inside it.

    With ``state_writes_before_kill`` < 0 the process dies after ``events_before_kill`` events of the block;
    otherwise it applies the whole block and dies after that many of the state writes that close it
    (after all of them: between the block's barrier and the checkpoint a projection would write).
    """
    store = TokenCaptureStore(root)
    projection = Projection(store)
    apply_blocks(projection, 0, block)
    offset = block_start(block)
    events = BLOCKS[block]
    flushing = [False]
    if state_writes_before_kill >= 0:
        write_state_file = store.files.replace_state_file
        closing_writes = [0]

        def dying_write(paths: RolloutPaths, state: RolloutState, **options: bool) -> bytes:
            if flushing[0]:
                if closing_writes[0] == state_writes_before_kill:
                    _kill_self()
                closing_writes[0] += 1
            return write_state_file(paths, state, **options)

        store.files.replace_state_file = dying_write  # type: ignore[method-assign]
    for index, event in enumerate(events):
        if index == events_before_kill and state_writes_before_kill < 0:
            _kill_self()
        projection.apply(event, LogPosition(TOPIC, 0, offset + index))
    if state_writes_before_kill < 0:
        _kill_self()
    flushing[0] = True
    projection.flush()
    _kill_self()


def serve() -> None:
    """Fork one child per request line ``root block events writes`` and answer how it ended.

    Forking from this warm, single-threaded process costs milliseconds where a fresh interpreter costs
    a few hundred, so the test can kill at every boundary.
    """
    for line in sys.stdin:
        root, block, events, writes = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                run_until_killed(Path(root), int(block), int(events), int(writes))
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        ended = (
            f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        )
        sys.stdout.write(ended + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
