"""The materializer's own files: checkpoints and dead letters are deterministic and crash-safe."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from transports.kafka.errors import MaterializerFailedError
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path, command_applied
from transports.kafka.materializer.dead_letters import DeadLetterLog


def test_a_checkpoint_round_trips_and_names_where_reading_resumes(tmp_path: Path) -> None:
    path = tmp_path / "kafka-checkpoint-p2.json"
    checkpoint = PartitionCheckpoint("topic-a", 2, next_offset=40, pending_chunk_offsets=[33, 31])
    path.write_bytes(checkpoint.encode())
    loaded = PartitionCheckpoint.load(path, "topic-a", 2)
    assert (loaded.next_offset, sorted(loaded.pending_chunk_offsets), loaded.resume_offset()) == (
        40,
        [31, 33],
        31,
    )
    assert loaded.encode() == checkpoint.encode()
    assert PartitionCheckpoint.load(tmp_path / "missing.json", "topic-a", 0).resume_offset() == 0


def test_a_checkpoint_of_another_topic_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kafka-checkpoint-p0.json"
    path.write_bytes(PartitionCheckpoint("topic-a", 0, next_offset=5).encode())
    with pytest.raises(MaterializerFailedError):
        PartitionCheckpoint.load(path, "topic-b", 0)


def test_a_dead_letter_offset_is_written_once_even_after_reopening(tmp_path: Path) -> None:
    path = tmp_path / "kafka-dead-letter-p0.jsonl"
    log = DeadLetterLog(path)
    assert log.record(0, 7, "bad", "r1") is True
    assert log.record(0, 7, "bad", "r1") is False
    assert DeadLetterLog(path).record(0, 7, "bad", "r1") is False
    assert [orjson.loads(line) for line in path.read_bytes().splitlines()] == [
        {"offset": 7, "partition": 0, "reason": "bad", "rollout_id": "r1"}
    ]


def test_a_torn_dead_letter_line_is_cut_off_and_written_again(tmp_path: Path) -> None:
    path = tmp_path / "kafka-dead-letter-p0.jsonl"
    DeadLetterLog(path).record(0, 1, "first", None)
    clean = path.read_bytes()
    with path.open("ab") as handle:
        handle.write(b'{"offset": 2, "parti')
    log = DeadLetterLog(path)
    assert path.read_bytes() == clean
    assert log.record(0, 2, "second", None) is True


def test_a_checkpoint_lists_commands_applied_ahead_and_omits_the_key_when_there_are_none(
    tmp_path: Path,
) -> None:
    ahead = PartitionCheckpoint("topic-a", 0, next_offset=10, commands_applied=[40, 12])
    path = checkpoint_path(tmp_path, 0)
    path.write_bytes(ahead.encode())
    assert PartitionCheckpoint.load(path, "topic-a", 0) == PartitionCheckpoint("topic-a", 0, 10, [], [12, 40])
    assert [command_applied(tmp_path, "topic-a", 0, o) for o in (9, 10, 12, 40, 41)] == [
        True,
        False,
        True,
        True,
        False,
    ]
    assert b"commands_applied" not in PartitionCheckpoint("topic-a", 0, next_offset=10).encode()
