"""The decision function: pure, deterministic, and the place each rule of DESIGN.md is decided."""

from __future__ import annotations

import builtins
import dataclasses
import os
from typing import Any

import pytest
from factories import make_entry
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap.errors import InvalidInputError, RolloutRetiredError
from tokcap.log.events import (
    LOG_READER_WRITER,
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
    decode_event,
    encode_event,
)
from tokcap.log.rules import (
    AppendEntry,
    AppendIncompleteMark,
    AppendIntent,
    ApplyOutcome,
    Barrier,
    Decision,
    RemoveRecords,
    RemoveState,
    SnapshotAnswer,
    WriteState,
    decide,
    recorded_verdict,
    snapshot_of,
)
from tokcap.log.state import IntentOp, Lifecycle, RolloutState

RID = "r"


def _at(offset: int) -> LogPosition:
    return LogPosition("t", 0, offset)


def _run(events: list[Event], *, logged: bool = True) -> tuple[RolloutState, list[Decision]]:
    state = RolloutState(rollout_id=RID)
    decisions = []
    for offset, event in enumerate(events):
        decision = decide(state, event, _at(offset) if logged else None, new_snapshot_id=f"s{offset}")
        decisions.append(decision)
        state = decision.state
    return state, decisions


def _put(call_id: str, generation: tuple[int, ...] = (4, 5)) -> PutEvent:
    return PutEvent(rollout_id=RID, entry=make_entry(RID, call_id, generation=generation))


_events = st.lists(
    st.one_of(
        st.builds(lambda c: IntentEvent(rollout_id=RID, model_call_id=c), st.sampled_from(["a", "b"])),
        st.builds(lambda c: CancelEvent(rollout_id=RID, model_call_id=c), st.sampled_from(["a", "b"])),
        st.builds(lambda c, g: _put(c, (g,)), st.sampled_from(["a", "b"]), st.integers(1, 2)),
        st.builds(
            lambda c: IncompleteEvent(rollout_id=RID, model_call_id=c, reason="x"), st.sampled_from(["a"])
        ),
        st.just(FreezeEvent(rollout_id=RID)),
        st.builds(lambda v: DropEvent(rollout_id=RID, snapshot_id="t:0:3", version=v), st.integers(1, 3)),
        st.just(RetireEvent(rollout_id=RID)),
        st.just(DeleteEvent(rollout_id=RID)),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(_events, st.booleans())
def test_deciding_never_changes_the_state_it_was_given_and_always_decides_the_same(
    events: list[Event], logged: bool
) -> None:
    state = RolloutState(rollout_id=RID)
    for offset, event in enumerate(events):
        position = _at(offset) if logged else None
        before = state.encode()
        first = decide(state, event, position, new_snapshot_id="s")
        again = decide(state, event, position, new_snapshot_id="s")
        assert state.encode() == before
        assert first.verdict == again.verdict and first.effects == again.effects
        assert first.state.encode() == again.state.encode()
        state = first.state


@settings(max_examples=60, deadline=None)
@given(_events)
def test_a_state_evolves_as_dataclasses_replace_makes_it_and_cannot_be_changed_in_place(
    events: list[Event],
) -> None:
    state, _ = _run(events)
    before = state.encode()
    evolved = state.evolve(version=state.version + 1, entry_digests={**state.entry_digests, "new": "digest"})
    assert evolved == dataclasses.replace(
        state, version=state.version + 1, entry_digests={**state.entry_digests, "new": "digest"}
    )
    assert state.encode() == before != evolved.encode()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.version = 0  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field"):
        state.evolve(versoin=1)


def test_deciding_touches_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the rules opened a file")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(os, "stat", refuse)
    _run(
        [
            _put("a"),
            FreezeEvent(rollout_id=RID),
            _put("late"),
            RetireEvent(rollout_id=RID),
            DeleteEvent(rollout_id=RID),
        ]
    )


def test_an_event_at_or_before_the_recorded_position_changes_nothing() -> None:
    state, _ = _run([_put("a"), _put("b")])
    decision = decide(state, IntentEvent(rollout_id=RID, model_call_id="c"), _at(1))
    assert decision.verdict.outcome is ApplyOutcome.ALREADY_APPLIED
    assert decision.effects == () and decision.state is state


def test_every_applied_event_records_its_position_once_in_the_state() -> None:
    state, decisions = _run([IntentEvent(rollout_id=RID, model_call_id="a"), _put("a"), _put("a")])
    assert state.last_position == _at(2)
    assert decisions[2].verdict.outcome is ApplyOutcome.NOOP
    assert decisions[2].effects == (WriteState(durable=False),)


def test_without_a_log_a_no_op_writes_nothing() -> None:
    _, decisions = _run([_put("a"), _put("a")], logged=False)
    assert decisions[1].verdict.outcome is ApplyOutcome.NOOP and not decisions[1].changed


def test_an_intent_after_a_cancel_is_recorded_again_and_a_repeat_is_not() -> None:
    events: list[Event] = [
        IntentEvent(rollout_id=RID, model_call_id="a"),
        CancelEvent(rollout_id=RID, model_call_id="a"),
        IntentEvent(rollout_id=RID, model_call_id="a"),
        IntentEvent(rollout_id=RID, model_call_id="a"),
    ]
    state, decisions = _run(events)
    appends = [d.effects[0] for d in decisions if d.effects and isinstance(d.effects[0], AppendIntent)]
    assert [(a.line, a.start) for a in appends] == [(b"a\n", 0), (b"\x00a\n", 2), (b"a\n", 5)]
    assert decisions[3].verdict.outcome is ApplyOutcome.NOOP
    assert dict(state.intents) == {"a": IntentOp.INTENT} and state.intents_size == 7


def test_a_conflicting_put_marks_the_rollout_incomplete_and_appends_no_entry() -> None:
    state, decisions = _run([_put("a"), _put("a", (9,))])
    assert decisions[1].verdict.outcome is ApplyOutcome.CONFLICT
    assert not any(isinstance(effect, AppendEntry) for effect in decisions[1].effects)
    assert AppendIncompleteMark(b"a\n", 0) in decisions[1].effects
    assert state.incomplete and len(state.incomplete_marks) == 1 and state.version == 2


def test_a_dangling_intent_makes_the_freeze_incomplete() -> None:
    state, _ = _run([IntentEvent(rollout_id=RID, model_call_id="a"), _put("b"), FreezeEvent(rollout_id=RID)])
    assert state.dangling_intents == ("a",) and state.incomplete


def test_a_freeze_answers_the_version_of_its_own_position_and_late_writes_move_past_it() -> None:
    events: list[Event] = [_put("a"), FreezeEvent(rollout_id=RID), _put("late"), FreezeEvent(rollout_id=RID)]
    state, decisions = _run(events)
    assert decisions[0].verdict.outcome is ApplyOutcome.ACCEPTED and decisions[0].state.version == 1
    assert decisions[1].verdict.version == 2
    assert decisions[2].verdict.outcome is ApplyOutcome.REJECTED_AFTER_FREEZE
    assert state.version == 3
    first, second = state.answer_at(_at(1)), state.answer_at(_at(3))
    assert first is not None and first.version == 2
    assert second is not None and second.version == 3
    assert state.snapshot_id == "t:0:1"


def test_a_freeze_without_a_log_needs_a_snapshot_id_from_the_caller() -> None:
    with pytest.raises(ValueError, match="snapshot id"):
        decide(RolloutState(rollout_id=RID), FreezeEvent(rollout_id=RID), None)


def test_every_incomplete_marker_is_a_line_and_moves_the_version_even_after_the_freeze() -> None:
    mark = IncompleteEvent(rollout_id=RID, model_call_id="a", reason="lost")
    state, decisions = _run([_put("a"), mark, mark, FreezeEvent(rollout_id=RID), mark])
    assert decisions[4].verdict.outcome is ApplyOutcome.ACCEPTED
    assert state.version == 5 and state.incomplete
    assert state.incomplete_size == 6 and len(state.incomplete_marks) == 1


def test_a_marker_id_is_applied_once_however_often_the_marker_is_forwarded() -> None:
    spilled = IncompleteEvent(rollout_id=RID, model_call_id="a", reason="lost", marker_id="s1-0")
    other = IncompleteEvent(rollout_id=RID, model_call_id="a", reason="lost", marker_id="s1-1")
    state, decisions = _run([spilled, spilled, FreezeEvent(rollout_id=RID), spilled, other])
    assert [d.verdict.outcome for d in decisions] == [
        ApplyOutcome.ACCEPTED,
        ApplyOutcome.NOOP,
        ApplyOutcome.ACCEPTED,
        ApplyOutcome.NOOP,
        ApplyOutcome.ACCEPTED,
    ]
    assert decisions[1].effects == (WriteState(durable=False),)
    assert state.version == 3 and state.incomplete_size == 4
    assert [mark.marker_id for mark in state.incomplete_marks] == ["s1-0", "s1-1"]


def test_a_marker_without_an_id_encodes_as_before_and_its_state_mark_too() -> None:
    marker = IncompleteEvent(rollout_id=RID, model_call_id="a", reason="lost")
    assert b"marker_id" not in encode_event(marker)
    state, _ = _run([marker])
    assert b"marker_id" not in state.encode()
    state, _ = _run([marker.model_copy(update={"marker_id": "s1-0"})])
    assert b'"marker_id":"s1-0"' in state.encode()
    assert decode_event(encode_event(marker.model_copy(update={"marker_id": "s1-0"}))).marker_id == "s1-0"  # type: ignore[union-attr]


def test_a_stale_drop_keeps_everything_and_an_exact_one_fences_before_removing() -> None:
    state, decisions = _run(
        [_put("a"), FreezeEvent(rollout_id=RID), DropEvent(rollout_id=RID, snapshot_id="t:0:1", version=1)]
    )
    assert decisions[2].verdict.dropped is False and state.lifecycle is Lifecycle.FROZEN
    exact = decide(state, DropEvent(rollout_id=RID, snapshot_id="t:0:1", version=2), _at(3))
    assert exact.verdict.dropped is True and exact.verdict.removed is True
    assert exact.effects == (WriteState(durable=True), Barrier(), RemoveRecords())
    assert exact.state.retired and exact.state.entry_digests == {} and exact.state.indexed_size == 0
    assert exact.state.version == 2 and exact.state.snapshot_id == "t:0:1" and exact.state.frozen


def test_a_fence_refuses_every_write_but_delete() -> None:
    state, _ = _run([_put("a"), RetireEvent(rollout_id=RID)])
    for offset, event in enumerate(
        [_put("b"), IntentEvent(rollout_id=RID, model_call_id="b"), FreezeEvent(rollout_id=RID)], start=10
    ):
        assert decide(state, event, _at(offset)).verdict.outcome is ApplyOutcome.REJECTED_RETIRED
    assert decide(state, RetireEvent(rollout_id=RID), _at(20)).verdict.removed is False
    assert decide(state, DeleteEvent(rollout_id=RID), _at(21)).verdict.removed is True


def test_a_delete_leaves_a_verdict_or_a_fence_before_removing_files() -> None:
    state, _ = _run([_put("a")])
    logged = decide(state, DeleteEvent(rollout_id=RID), _at(5))
    assert logged.effects == (WriteState(durable=True), Barrier(), RemoveRecords())
    assert logged.state.is_pristine and logged.state.removed_records is True
    assert logged.state.last_position == _at(5)
    unlogged = decide(state, DeleteEvent(rollout_id=RID), None)
    tombstone, *rest = unlogged.effects
    assert isinstance(tombstone, WriteState) and tombstone.state is not None and tombstone.state.retired
    assert rest == [Barrier(), RemoveRecords(), RemoveState()]
    assert unlogged.state.is_pristine and unlogged.sync_even_if_unchanged
    never_written = decide(RolloutState(rollout_id=RID), DeleteEvent(rollout_id=RID), None)
    assert (
        never_written.effects == (RemoveRecords(), RemoveState()) and never_written.verdict.removed is False
    )


def test_a_snapshot_as_of_a_freeze_answers_its_version_and_a_later_marker_still_masks_it() -> None:
    marker = IncompleteEvent(rollout_id=RID, model_call_id="late", reason="lost")
    state, _ = _run([_put("a"), FreezeEvent(rollout_id=RID), _put("late")])
    assert snapshot_of(state, _at(1)) == SnapshotAnswer("t:0:1", 2, False)
    assert snapshot_of(state, None) == SnapshotAnswer("t:0:1", 3, False)
    masked = decide(state, marker, _at(3)).state
    assert snapshot_of(masked, LogPosition("t", 0, 1, 1)) == SnapshotAnswer("t:0:1", 2, True)
    with pytest.raises(InvalidInputError, match="no freeze applied"):
        snapshot_of(masked, _at(2))
    with pytest.raises(InvalidInputError, match="not frozen"):
        snapshot_of(_run([_put("a")])[0], None)
    retired = decide(state, RetireEvent(rollout_id=RID), _at(3)).state
    with pytest.raises(RolloutRetiredError):
        snapshot_of(retired, _at(1))


def test_each_command_reads_its_own_verdict_back_however_many_events_followed_it() -> None:
    commands: list[Event] = [
        DropEvent(rollout_id=RID, snapshot_id="t:0:1", version=1),
        DropEvent(rollout_id=RID, snapshot_id="t:0:1", version=2),
        RetireEvent(rollout_id=RID),
        DeleteEvent(rollout_id=RID),
        _put("again"),
        DeleteEvent(rollout_id=RID),
        DeleteEvent(rollout_id=RID),
        _put("once more"),
    ]
    state, _ = _run([_put("a"), FreezeEvent(rollout_id=RID), *commands])
    verdicts = [
        (verdict.dropped, verdict.removed)
        for offset, event in enumerate(commands, start=2)
        if not isinstance(event, PutEvent)
        for verdict in [recorded_verdict(state, event, _at(offset))]
    ]
    assert verdicts == [(False, None), (True, None), (None, False), (None, True), (None, True), (None, False)]
    assert recorded_verdict(state, RetireEvent(rollout_id=RID), _at(99)).removed is False


def test_a_freeze_refused_by_a_retired_rollouts_fence_reads_back_as_refused_and_an_answered_one_as_answered() -> (
    None
):
    state, _ = _run(
        [_put("a"), FreezeEvent(rollout_id=RID), RetireEvent(rollout_id=RID), FreezeEvent(rollout_id=RID)]
    )
    answered = recorded_verdict(state, FreezeEvent(rollout_id=RID), _at(1))
    refused = recorded_verdict(state, FreezeEvent(rollout_id=RID), _at(3))
    assert answered.outcome is ApplyOutcome.NOOP
    assert refused.outcome is ApplyOutcome.REJECTED_RETIRED


def test_without_a_log_no_verdict_is_recorded() -> None:
    state, _ = _run([_put("a"), RetireEvent(rollout_id=RID), DeleteEvent(rollout_id=RID)], logged=False)
    assert state.command_verdicts == ()


def test_a_freeze_whose_message_a_state_from_before_indexes_answered_at_index_0_is_not_answered_twice() -> (
    None
):
    state, _ = _run([_put("a")])
    frozen = decide(state, FreezeEvent(rollout_id=RID), LogPosition("t", 0, 5)).state
    again = decide(frozen, FreezeEvent(rollout_id=RID), LogPosition("t", 0, 5, 1))
    assert again.verdict.outcome is ApplyOutcome.ALREADY_APPLIED
    assert again.state.freeze_answers == frozen.freeze_answers and len(frozen.freeze_answers) == 1


def test_a_log_readers_mask_a_state_from_before_indexes_applied_without_a_position_is_not_applied_twice() -> (
    None
):
    state, _ = _run([_put("a")])
    mask = IncompleteEvent(
        rollout_id=RID, writer=LOG_READER_WRITER, reason="orphaned chunk group g7 at offsets [3]"
    )
    masked = decide(state, mask, None).state
    again = decide(masked, mask, LogPosition("t", 0, 9))
    assert again.verdict.outcome is ApplyOutcome.ALREADY_APPLIED
    assert (again.state.version, again.state.incomplete_size) == (masked.version, masked.incomplete_size)
    assert not again.effects
    other_writer = decide(masked, mask.model_copy(update={"writer": "sink-1"}), LogPosition("t", 0, 9))
    assert other_writer.state.version == masked.version + 1
