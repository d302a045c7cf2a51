"""The single-writer projection answers a freeze from memory with exactly what its files give once flushed.

``tokcap.files.log_projection.Projection`` keeps hot rollouts' states and entries in memory, applies events through
the store in blocks and answers freezes before the block is flushed. For any history of one rollout the answer
must equal the snapshot the flushed files give, the files must equal a plain one-event-at-a-time apply, and a
crash before the flush must lead a restart to the same answer.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_contract import directory_contents, make_entry

from tests.exact_shape import snapshot_shape
from tokcap.errors import TokcapError
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
from tokcap.log.records import TokenEntry
from tokcap.protocols import TokenCaptureSnapshot

TOPIC = "tokcap.response_items-test"
ROLLOUT = "r"

OPS = ("intent", "put", "conflict", "cancel", "incomplete", "freeze", "drop", "retire", "delete")


def files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes by name, lock files left out: taking a lock creates one, and it holds no state."""
    return {name: data for name, data in directory_contents(directory).items() if not name.endswith(".lock")}


def history(ops: list[tuple[str, int]], rollout_id: str = ROLLOUT) -> list[tuple[Event, LogPosition]]:
    """One rollout's log: each op at its own offset, as a materializer applies it."""
    events: list[tuple[Event, LogPosition]] = []
    for offset, (op, call) in enumerate(ops):
        call_id = f"c{call}"
        event: Event
        if op == "intent":
            event = IntentEvent(rollout_id=rollout_id, model_call_id=call_id)
        elif op == "put":
            event = PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, tokens=4 + call))
        elif op == "conflict":
            event = PutEvent(
                rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, tokens=4 + call, salt=9)
            )
        elif op == "cancel":
            event = CancelEvent(rollout_id=rollout_id, model_call_id=call_id)
        elif op == "incomplete":
            event = IncompleteEvent(rollout_id=rollout_id, model_call_id=call_id, reason="lost")
        elif op == "freeze":
            event = FreezeEvent(rollout_id=rollout_id)
        elif op == "drop":
            event = DropEvent(rollout_id=rollout_id, snapshot_id=f"{TOPIC}:0:{call}", version=call % 4)
        elif op == "retire":
            event = RetireEvent(rollout_id=rollout_id)
        else:
            event = DeleteEvent(rollout_id=rollout_id)
        events.append((event, LogPosition(TOPIC, 0, offset)))
    return events


def answer_of(projection: Projection, position: LogPosition) -> TokenCaptureSnapshot | type[TokcapError]:
    try:
        return projection.snapshot(ROLLOUT, position)
    except TokcapError as exc:
        return type(exc)


def files_answer(store: TokenCaptureStore, position: LogPosition) -> TokenCaptureSnapshot | type[TokcapError]:
    try:
        return store.snapshot(ROLLOUT, as_of=position)
    except TokcapError as exc:
        return type(exc)


def shape(answer: TokenCaptureSnapshot | type[TokcapError]) -> object:
    return answer if isinstance(answer, type) else snapshot_shape(answer)


histories = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3)), min_size=1, max_size=14)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=histories, data=st.data())
def test_a_freeze_answered_from_memory_is_exactly_the_snapshot_its_flushed_files_give(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    flushes = data.draw(st.sets(st.integers(0, len(events) - 1)), label="flushed after these events")
    # A small bound forgets kept entries (the answer then parses the file), a zero one forgets every state.
    hot_tokens = data.draw(st.sampled_from([0, 12, 2_000_000]), label="hot tokens")
    hot_rollouts = data.draw(st.sampled_from([0, 4_096]), label="hot rollouts")
    memory_dir, plain_dir = tmp_path_factory.mktemp("memory"), tmp_path_factory.mktemp("plain")
    store = TokenCaptureStore(memory_dir)
    projection = Projection(store, hot_tokens=hot_tokens, hot_rollouts=hot_rollouts)
    for index, (event, position) in enumerate(events):
        projection.apply(event, position)
        if index in flushes and index != len(events) - 1:
            projection.flush()
    answered = answer_of(projection, events[-1][1])
    projection.flush()
    plain = TokenCaptureStore(plain_dir)
    for event, position in events:
        plain.apply(event, position)
    assert shape(answered) == shape(files_answer(store, events[-1][1]))
    assert shape(answered) == shape(files_answer(plain, events[-1][1]))
    assert files(memory_dir) == files(plain_dir)
    assert projection.kept_tokens <= hot_tokens
    assert len(projection.states) <= hot_rollouts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=histories, data=st.data())
def test_an_answer_given_before_a_crash_is_the_answer_a_restart_gives(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    checkpoint = data.draw(st.integers(0, len(events) - 1), label="events flushed before the block")
    directory = tmp_path_factory.mktemp("crash")
    store = TokenCaptureStore(directory)
    projection = Projection(store)
    for event, position in events[:checkpoint]:
        projection.apply(event, position)
    projection.flush()
    for event, position in events[checkpoint:]:
        projection.apply(event, position)
    answered = answer_of(projection, events[-1][1])
    if data.draw(st.booleans(), label="killed while flushing: lines written, state not"):
        projection.write_queued(ROLLOUT)
    # The process dies: its block is never flushed, and no checkpoint passes the events after ``checkpoint``.
    projection.abandon(RuntimeError("killed"))
    restarted_store = TokenCaptureStore(directory)
    restarted = Projection(restarted_store)
    for event, position in events[checkpoint:]:
        restarted.apply(event, position)
    assert shape(answer_of(restarted, events[-1][1])) == shape(answered)
    restarted.flush()
    assert shape(files_answer(restarted_store, events[-1][1])) == shape(answered)


def test_an_answer_copies_the_kept_entries_without_parsing_and_shares_nothing_with_them(
    tmp_path: Path,
) -> None:
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1), ("put", 1), ("intent", 2), ("put", 2)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store = TokenCaptureStore(tmp_path)
    projection = Projection(store)
    for event, position in events:
        projection.apply(event, position)
    parsed = []
    real = TokenEntry.from_json

    def counted(data: bytes | str) -> TokenEntry:
        parsed.append(data)
        return real(data)

    with mock.patch.object(TokenEntry, "from_json", counted):
        answer = projection.snapshot(ROLLOUT, events[-1][1])
    assert parsed == []
    assert [entry.model_call_id for entry in answer.entries] == ["c0", "c1", "c2"]
    kept = [event.entry for event, _ in events if isinstance(event, PutEvent)]
    assert all(copy is not original for copy, original in zip(answer.entries, kept, strict=False))
    answer.entries[0].prompt_token_ids.append(7)
    assert kept[0].prompt_token_ids == make_entry(ROLLOUT, "c0", tokens=4).prompt_token_ids
    projection.flush()
    assert snapshot_shape(answer) != snapshot_shape(store.snapshot(ROLLOUT, as_of=events[-1][1]))
    answer.entries[0].prompt_token_ids.pop()
    assert snapshot_shape(answer) == snapshot_shape(store.snapshot(ROLLOUT, as_of=events[-1][1]))


def test_hot_memory_stays_within_its_token_and_rollout_bounds_and_the_coldest_go_first(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    tokens_per_rollout = (4 + 2) + (5 + 2)  # make_entry(tokens=4 + call): its prompt and two generated tokens
    projection = Projection(store, hot_tokens=3 * tokens_per_rollout, hot_rollouts=2)
    for index in range(5):
        for event, position in history([("put", 0), ("put", 1)], rollout_id=f"r{index}"):
            projection.apply(event, position)
            assert projection.kept_tokens <= 3 * tokens_per_rollout
    # States stay until their block is flushed: they are the only copy of what was decided.
    assert list(projection.hot_rollouts()) == [f"r{index}" for index in range(5)]
    projection.flush()
    assert list(projection.hot_rollouts()) == ["r3", "r4"]
    assert projection.kept_tokens <= 3 * tokens_per_rollout


def test_a_new_rollout_is_applied_and_answered_without_its_lock_file_until_the_flush(tmp_path: Path) -> None:
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store = TokenCaptureStore(tmp_path / "memory")
    projection = Projection(store)
    for event, position in events:
        projection.apply(event, position)
    answer = projection.snapshot(ROLLOUT, events[-1][1])
    assert list((tmp_path / "memory").iterdir()) == []
    projection.flush()
    assert f"{ROLLOUT}.tokens.lock" in {path.name for path in (tmp_path / "memory").iterdir()}
    assert snapshot_shape(answer) == snapshot_shape(store.snapshot(ROLLOUT, as_of=events[-1][1]))


def test_every_write_of_the_store_leaves_a_rollouts_lock_file_beside_its_record_files(tmp_path: Path) -> None:
    """A projection reads nothing of a rollout without a lock file, so no writer may leave files without one."""
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store = TokenCaptureStore(tmp_path)
    for event, position in events:
        store.apply(event, position)
        names = {path.name for path in tmp_path.iterdir()}
        assert f"{ROLLOUT}.tokens.lock" in names, names
    store.begin_call_now("other", "c0")
    store.mark_incomplete_now("third", "c0")
    names = {path.name for path in tmp_path.iterdir()}
    assert {"other.tokens.lock", "third.tokens.lock"} <= names


def test_a_flush_whose_sync_fails_renames_no_state_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    """The block's states are renamed only after the sync of them and their lines; a failed one renames none."""
    from tokcap.files.group_commit import GroupCommitter

    store = TokenCaptureStore(tmp_path)
    projection = Projection(store)
    for offset, rollout_id in enumerate(("a", "b")):
        projection.apply(
            IntentEvent(rollout_id=rollout_id, model_call_id="c1"), LogPosition(TOPIC, 0, offset)
        )
    projection.flush()
    before = {name: data for name, data in files(tmp_path).items() if name.endswith(".state.json")}
    for offset, rollout_id in enumerate(("a", "b"), start=2):
        projection.apply(
            PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, "c1")), LogPosition(TOPIC, 0, offset)
        )

    def broken_sync() -> None:
        raise OSError(28, "no space left")

    store.files._commit = GroupCommitter(broken_sync)
    with pytest.raises(OSError, match="no space"):
        projection.flush()
    after = files(tmp_path)
    assert {name: data for name, data in after.items() if name.endswith(".state.json")} == before
    assert not [name for name in after if ".tmp-" in name]
