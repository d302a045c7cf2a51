"""The state file as tokcap writes and reads it: positions typed in memory, bytes as older versions wrote them."""

from __future__ import annotations

import orjson

from tokcap.log.events import DeleteEvent, LogPosition, StageEvent
from tokcap.log.rules import SnapshotAnswer, decide, snapshot_of
from tokcap.log.state import STATE_SCHEMA_VERSION, RolloutState

WRITTEN_BEFORE_INDEX = (
    b'{"entry_digests":{},"frozen":true,"incomplete":true,"indexed_size":0,"retired":false,"snapshot_id":"run:3:11",'
    b'"tokcap":{"covers_freeze":true,"dangling_intents":["c1"],"freeze_answers":[{"incomplete":true,"position":'
    b'{"offset":11,"partition":3,"topic":"run"},"version":1}],"incomplete_marks":[],"incomplete_size":0,"intents":'
    b'{"c1":"intent"},"intents_size":3,"last_position":{"offset":12,"partition":3,"topic":"run"},"rejections":'
    b'[{"event_type":"intent","model_call_id":"c2","position":{"offset":12,"partition":3,"topic":"run"}}],'
    b'"removed_records":null,"schema_version":3},"version":2}\n'
)
"""A rollout frozen at offset 11 with a rejected intent at 12, as a tokcap without position indexes wrote it."""


def test_a_state_file_written_before_positions_had_an_index_reads_them_at_index_0_and_keeps_its_bytes() -> (
    None
):
    state = RolloutState.decode(WRITTEN_BEFORE_INDEX, "r.tokens.state.json", "r")
    assert state.last_position == LogPosition("run", 3, 12, 0)
    assert state.rejections[0].position == LogPosition("run", 3, 12, 0)
    assert state.already_applied(LogPosition("run", 3, 12)) and not state.already_applied(
        LogPosition("run", 3, 13)
    )
    assert snapshot_of(state, LogPosition("run", 3, 11)) == SnapshotAnswer("run:3:11", 1, True)
    assert state.encode() == WRITTEN_BEFORE_INDEX


def test_a_position_past_index_0_is_written_with_its_index_and_read_back() -> None:
    state = RolloutState.decode(WRITTEN_BEFORE_INDEX, "r.tokens.state.json", "r")
    state = state.positioned(LogPosition("run", 3, 13, 1))
    document = orjson.loads(state.encode())
    assert document["tokcap"]["last_position"] == {"index": 1, "offset": 13, "partition": 3, "topic": "run"}
    again = RolloutState.decode(state.encode(), "r.tokens.state.json", "r")
    assert again.last_position == LogPosition("run", 3, 13, 1)
    assert again.already_applied(LogPosition("run", 3, 13, 0)) and not again.already_applied(
        LogPosition("run", 3, 13, 2)
    )


def test_only_a_state_holding_a_commands_verdict_is_written_with_the_verdicts_schema() -> None:
    state = RolloutState.decode(WRITTEN_BEFORE_INDEX, "r.tokens.state.json", "r")
    assert orjson.loads(state.encode())["tokcap"]["schema_version"] == 3
    deleted = decide(state, DeleteEvent(rollout_id="r"), LogPosition("run", 3, 14)).state
    document = orjson.loads(deleted.encode())["tokcap"]
    assert document["schema_version"] == 4
    assert document["command_verdicts"] == [
        {"event_type": "delete", "position": {"offset": 14, "partition": 3, "topic": "run"}, "removed": True}
    ]
    assert RolloutState.decode(deleted.encode(), "r.tokens.state.json", "r") == deleted


def test_a_staged_row_applied_from_a_log_keeps_its_offset_and_only_such_a_state_has_the_newest_schema() -> (
    None
):
    event = StageEvent(
        rollout_id="r", staging_key="r/c", model_call_id="c", row={"rollout_id": "r", "model_call_id": "c"}
    )
    fresh = RolloutState(rollout_id="r")
    from_log = decide(fresh, event, LogPosition("run", 3, 20)).state
    from_file = decide(fresh, event, None).state
    assert from_log.staged["r/c"].offset == 20 and from_file.staged["r/c"].offset is None
    logged = orjson.loads(from_log.encode())["tokcap"]
    assert logged["schema_version"] == STATE_SCHEMA_VERSION and logged["staged"]["r/c"]["offset"] == 20
    filed = orjson.loads(from_file.encode())["tokcap"]
    assert filed["schema_version"] == 3 and "offset" not in filed["staged"]["r/c"]
    assert RolloutState.decode(from_log.encode(), "r.tokens.state.json", "r") == from_log
