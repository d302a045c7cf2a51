"""A command's answer by position is the same from the projection's memory, before any flush, as from the files.

The projection answers ``verdict_at`` and ``snapshot_at`` from a state that applied the position; the files
(``FileAnswers``, what a source following another process reads) give the same answers once flushed, and the
same as a store that applied the log itself. Memory that does not hold a snapshot says so (``None``) rather
than answering from files that may not hold the position yet.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_log_projection import histories, history

from tests.exact_shape import snapshot_shape
from tokcap.errors import TokcapError
from tokcap.files.log_answers import FileAnswers
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import DeleteEvent, DropEvent, FreezeEvent, RetireEvent

COMMANDS = (FreezeEvent, DropEvent, RetireEvent, DeleteEvent)


def outcome(ask: Callable[[], object]) -> object:
    """What an answer is, comparably: a snapshot's exact shape, a verdict, or the class of what it raised."""
    try:
        answer = ask()
    except TokcapError as exc:
        return type(exc)
    return snapshot_shape(answer) if hasattr(answer, "entries") else answer


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=histories, data=st.data())
def test_every_commands_answer_from_memory_is_the_answer_the_flushed_files_and_a_plain_store_give(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    events = history(ops)
    flushes = data.draw(st.sets(st.integers(0, len(events) - 1)), label="flushed after these events")
    hot_tokens = data.draw(st.sampled_from([0, 12, 2_000_000]), label="hot tokens")
    store = TokenCaptureStore(tmp_path_factory.mktemp("memory"))
    projection = Projection(store, hot_tokens=hot_tokens)
    for index, (event, position) in enumerate(events):
        projection.apply(event, position)
        if index in flushes:
            projection.flush()
    commands = [(event, position) for event, position in events if isinstance(event, COMMANDS)]
    from_memory = {}
    for event, position in commands:
        from_memory[position] = outcome(partial(projection.verdict_at, event, position))
        if isinstance(event, FreezeEvent):
            snapshot = outcome(partial(projection.snapshot_at, event.rollout_id, position, from_files=False))
            if snapshot is not None:
                from_memory[(position, "snapshot")] = snapshot
    projection.flush()
    plain = TokenCaptureStore(tmp_path_factory.mktemp("plain"))
    for event, position in events:
        plain.apply(event, position)
    for answers in (FileAnswers(store), FileAnswers(plain)):
        for event, position in commands:
            assert from_memory[position] == outcome(partial(answers.verdict_at, event, position))
            if (position, "snapshot") in from_memory:
                assert from_memory[(position, "snapshot")] == outcome(
                    partial(answers.snapshot_at, event.rollout_id, position)
                )
            assert answers.verdict_at(event, position, from_files=False) is None
