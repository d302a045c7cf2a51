"""A freeze decided ahead of its rollout's backlog gives exactly the verdict and snapshot its apply gives.

``TokenCaptureStore.snapshot_ahead`` decides a rollout's events not applied yet in memory, writing nothing.
Its answer must equal what applying the same events and then reading ``snapshot(as_of=...)`` gives, for
any history: duplicates, conflicting re-puts, late writes, markers, drops, retires and deletes. Where it
cannot answer without carrying something out, it says so (``None``) and the caller waits for the apply.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_contract import directory_contents, make_entry

from tests.exact_shape import snapshot_shape
from tokcap.errors import InvalidInputError, TokcapError
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
)
from tokcap.protocols import TokenCaptureSnapshot
from tokcap.records import TokenEntry
from tokcap.rules import ApplyResult
from tokcap.store import TokenCaptureStore
from transports.kafka.applied_entries import AppliedEntries

TOPIC = "tokcap.ahead-test"
ROLLOUT = "r"

OPS = ("intent", "put", "conflict", "cancel", "incomplete", "freeze", "drop", "retire", "delete")


def files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes by name, lock files left out: taking a lock creates one, and it holds no state."""
    return {name: data for name, data in directory_contents(directory).items() if not name.endswith(".lock")}


def history(ops: list[tuple[str, int]]) -> list[tuple[Event, LogPosition]]:
    """One rollout's log: each op at its own offset, as a materializer applies it."""
    events: list[tuple[Event, LogPosition]] = []
    for offset, (op, call) in enumerate(ops):
        call_id = f"c{call}"
        event: Event
        if op == "intent":
            event = IntentEvent(rollout_id=ROLLOUT, model_call_id=call_id)
        elif op == "put":
            event = PutEvent(rollout_id=ROLLOUT, entry=make_entry(ROLLOUT, call_id, tokens=4 + call))
        elif op == "conflict":
            event = PutEvent(rollout_id=ROLLOUT, entry=make_entry(ROLLOUT, call_id, tokens=4 + call, salt=9))
        elif op == "cancel":
            event = CancelEvent(rollout_id=ROLLOUT, model_call_id=call_id)
        elif op == "incomplete":
            event = IncompleteEvent(rollout_id=ROLLOUT, model_call_id=call_id, reason="lost")
        elif op == "freeze":
            event = FreezeEvent(rollout_id=ROLLOUT)
        elif op == "drop":
            event = DropEvent(rollout_id=ROLLOUT, snapshot_id=f"{TOPIC}:0:{call}", version=call % 4)
        elif op == "retire":
            event = RetireEvent(rollout_id=ROLLOUT)
        else:
            event = DeleteEvent(rollout_id=ROLLOUT)
        events.append((event, LogPosition(TOPIC, 0, offset)))
    return events


def applied_answer(
    store: TokenCaptureStore, events: list[tuple[Event, LogPosition]]
) -> tuple[ApplyResult, TokenCaptureSnapshot | type[TokcapError]]:
    """Apply the events; the last one's verdict and the snapshot a source then reads (or the error it meets)."""
    verdict = None
    for event, position in events:
        verdict = store.apply(event, position)
    assert verdict is not None
    try:
        return verdict, store.snapshot(ROLLOUT, as_of=events[-1][1])
    except TokcapError as exc:
        return verdict, type(exc)


histories = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3)), min_size=1, max_size=14)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=histories, data=st.data())
def test_a_freeze_answered_ahead_equals_its_apply_and_deciding_ahead_writes_nothing(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]], data: st.DataObject
) -> None:
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    applied_before = data.draw(st.integers(0, len(events) - 1), label="applied before the freeze is read")
    # The materializer also reads (and answers) between the steps of a sweep, inside its deferred block.
    in_open_block = data.draw(st.booleans(), label="answered inside the block applying what came before")
    # It hands over the entries it applied, which are copied instead of parsed; some it may have forgotten.
    handed_over = data.draw(st.sampled_from(["none", "all", "one forgotten"]), label="applied entries given")
    ahead_dir, applied_dir = tmp_path_factory.mktemp("ahead"), tmp_path_factory.mktemp("applied")
    ahead_store, applied_store = TokenCaptureStore(ahead_dir), TokenCaptureStore(applied_dir)
    kept = AppliedEntries()
    with ahead_store.deferred_durability() if in_open_block else nullcontext():
        for event, position in events[:applied_before]:
            kept.note(event, ahead_store.apply(event, position))
        given_entries = None if handed_over == "none" else list(kept.of(ROLLOUT) or [])
        if handed_over == "one forgotten" and given_entries:
            given_entries.pop(0)
        before = files(ahead_dir)
        answer = ahead_store.snapshot_ahead(ROLLOUT, events[applied_before:], given_entries)
        assert files(ahead_dir) == before
    with applied_store.deferred_durability() if in_open_block else nullcontext():
        for event, position in events[:applied_before]:
            applied_store.apply(event, position)
    verdict, snapshot = applied_answer(applied_store, events[applied_before:])
    pending = [event for event, _ in events[applied_before:]]
    removes = any(isinstance(event, (RetireEvent, DeleteEvent)) for event in pending)
    answerable = isinstance(snapshot, TokenCaptureSnapshot) and not removes
    if answer is None:
        # Only a removal among the pending events or a freeze that leaves no snapshot is left to the apply.
        assert not answerable
        return
    assert answer == (verdict, snapshot)
    # Exactly, not just equal: types, key order, fields-set (the pending puts' entries are copies, not parses).
    assert snapshot_shape(answer[1]) == snapshot_shape(snapshot)
    # The apply that follows the answer leaves what it leaves without one.
    applied_answer(ahead_store, events[applied_before:])
    assert files(ahead_dir) == files(applied_dir)


def test_a_freeze_whose_rollout_only_grew_is_answered_ahead_with_every_entry_in_file_order(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1), ("put", 1), ("intent", 2), ("put", 2)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    for event, position in events[:3]:
        store.apply(event, position)

    answer = store.snapshot_ahead(ROLLOUT, events[3:])

    assert answer is not None
    verdict, snapshot = answer
    assert [entry.model_call_id for entry in snapshot.entries] == ["c0", "c1", "c2"]
    assert (snapshot.snapshot_id, snapshot.incomplete) == (f"{TOPIC}:0:{len(ops)}", False)
    assert verdict.outcome.value == "accepted"
    assert not store.read_state(ROLLOUT).frozen


def test_a_retire_before_the_freeze_leaves_the_answer_to_the_apply(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    events = [
        *history([("put", 0), ("retire", 0)]),
        (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, 2)),
    ]
    store.apply(*events[0])
    assert store.snapshot_ahead(ROLLOUT, events[1:]) is None


def test_deciding_ahead_needs_the_pending_events_to_end_with_a_freeze(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    with pytest.raises(InvalidInputError, match="ending with a freeze"):
        store.snapshot_ahead(ROLLOUT, history([("put", 0)]))


def test_a_rollout_with_no_files_yet_is_answered_without_creating_its_lock_file(tmp_path: Path) -> None:
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store = TokenCaptureStore(tmp_path / "ahead")
    answer = store.snapshot_ahead(ROLLOUT, events)
    assert list((tmp_path / "ahead").iterdir()) == []
    assert answer == applied_answer(TokenCaptureStore(tmp_path / "applied"), events)
    # Once any file of it exists (here only the lock, taken by a read), the lock is taken again.
    store.read_state(ROLLOUT)
    assert store.snapshot_ahead(ROLLOUT, events) == answer


def test_applied_entries_handed_over_are_copied_not_parsed_and_share_nothing_with_the_callers(
    tmp_path: Path,
) -> None:
    ops = [("intent", 0), ("put", 0), ("intent", 1), ("put", 1), ("put", 1), ("intent", 2), ("put", 2)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store, kept = TokenCaptureStore(tmp_path / "ahead"), AppliedEntries()
    for event, position in events[:5]:
        kept.note(event, store.apply(event, position))
    handed = kept.of(ROLLOUT)
    assert handed is not None and [entry.model_call_id for entry in handed] == ["c0", "c1"]
    parsed = []
    real = TokenEntry.from_json

    def counted(data: bytes | str) -> TokenEntry:
        parsed.append(data)
        return real(data)

    with mock.patch.object(TokenEntry, "from_json", counted):
        answer = store.snapshot_ahead(ROLLOUT, events[5:], handed)
        assert answer is not None
        assert parsed == []
        # A list missing an entry is not the file's: the applied lines are parsed instead.
        assert store.snapshot_ahead(ROLLOUT, events[5:], handed[1:]) == answer
        assert len(parsed) == 2
    assert answer == applied_answer(TokenCaptureStore(tmp_path / "applied"), events)
    entries = answer[1].entries
    assert all(copy is not original for copy, original in zip(entries, handed, strict=False))
    prompt_before = list(handed[0].prompt_token_ids)
    entries[0].prompt_token_ids.append(7)
    assert handed[0].prompt_token_ids == prompt_before


def test_every_write_of_the_store_leaves_a_rollouts_lock_file_beside_its_record_files(tmp_path: Path) -> None:
    """An answer ahead reads nothing of a rollout without a lock file, so no writer may leave files without one."""
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


def test_a_rollout_without_a_lock_file_is_answered_after_two_existence_checks(tmp_path: Path) -> None:
    ops = [("intent", 0), ("put", 0)]
    events = [*history(ops), (FreezeEvent(rollout_id=ROLLOUT), LogPosition(TOPIC, 0, len(ops)))]
    store = TokenCaptureStore(tmp_path)
    checked: list[str] = []
    real = os.path.lexists

    def counted(path: object) -> bool:
        checked.append(str(path))
        return real(path)  # type: ignore[arg-type]

    expected = applied_answer(TokenCaptureStore(tmp_path / "applied"), events)
    with mock.patch("tokcap.store.os.path.lexists", counted):
        answer = store.snapshot_ahead(ROLLOUT, events)
    assert answer == expected
    assert len(checked) == 2
