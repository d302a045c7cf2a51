"""A store directory is bound to one incarnation of its topic, and a partition's offsets are never skipped."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from kafka_topic_double import MemoryTopic, materialize
from store_contract import directory_contents, make_entry

from tokcap.log.events import FreezeEvent, IntentEvent, PutEvent
from transports.kafka.errors import (
    MaterializerFailedError,
    OffsetGapError,
    PartitionOwnershipConflictError,
    TopicIncarnationError,
)
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path
from transports.kafka.materializer.ownership import (
    PartitionOwners,
    check_owner_records,
    owner_record_path,
    write_owner_records,
)

TOPIC = "tokcap.incarnation-test"


def publish_calls(topic: MemoryTopic, rollout_id: str, *call_ids: str) -> None:
    for call_id in call_ids:
        topic.publish(IntentEvent(rollout_id=rollout_id, writer="w", model_call_id=call_id))
        topic.publish(PutEvent(rollout_id=rollout_id, writer="w", entry=make_entry(rollout_id, call_id)))


def test_a_checkpoint_of_another_topic_incarnation_is_refused_naming_both_ids_and_what_to_do(
    tmp_path: Path,
) -> None:
    path = checkpoint_path(tmp_path, 0)
    path.write_bytes(PartitionCheckpoint(TOPIC, 0, next_offset=10, topic_id="OLD-id").encode())
    with pytest.raises(TopicIncarnationError) as refused:
        PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0, "NEW-id")
    message = str(refused.value)
    assert str(path) in message and "OLD-id" in message and "NEW-id" in message
    assert "deleted and created again" in message
    assert "into a new, empty directory" in message
    assert isinstance(refused.value, MaterializerFailedError)
    # Read without an expected id (``tokcap inspect``), it is just a checkpoint.
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0).topic_id == "OLD-id"


def test_an_owner_record_of_another_topic_incarnation_is_refused(tmp_path: Path) -> None:
    write_owner_records(tmp_path, TOPIC, [0], "OLD-id")
    check_owner_records(tmp_path, TOPIC, [0], "OLD-id")
    with pytest.raises(TopicIncarnationError, match=r"OLD-id.*NEW-id"):
        check_owner_records(tmp_path, TOPIC, [0], "NEW-id")


def test_a_materializer_refuses_a_directory_of_another_incarnation_before_applying_anything(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    publish_calls(topic, "old", "c1")
    materialize(topic, tmp_path)
    before = directory_contents(tmp_path)
    topic.id = "memory-topic-id-2"
    publish_calls(topic, "x", "c1")
    materializer = Materializer(
        "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
    )
    with pytest.raises(TopicIncarnationError, match=r"memory-topic-id-1.*memory-topic-id-2"):
        materializer.start()
    materializer.stop()
    after = directory_contents(tmp_path)
    assert {name: data for name, data in after.items() if not name.endswith(".lock")} == {
        name: data for name, data in before.items() if not name.endswith(".lock")
    }


def test_records_written_without_a_topic_id_are_bound_to_the_topic_on_first_start(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    publish_calls(topic, "r1", "c1")
    materialize(topic, tmp_path)
    # What an older version wrote: the same records without the id.
    checkpoint = checkpoint_path(tmp_path, 0)
    fields = orjson.loads(checkpoint.read_bytes())
    assert fields.pop("topic_id") == topic.id
    checkpoint.write_bytes(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\n")
    write_owner_records(tmp_path, TOPIC, [0])
    assert "topic_id" not in orjson.loads(owner_record_path(tmp_path, 0).read_bytes())

    # A start with nothing new to apply binds them.
    materialize(topic, tmp_path)
    assert orjson.loads(checkpoint.read_bytes()) == {**fields, "topic_id": topic.id}
    assert orjson.loads(owner_record_path(tmp_path, 0).read_bytes())["topic_id"] == topic.id

    publish_calls(topic, "r1", "c2")
    topic.publish(FreezeEvent(rollout_id="r1", writer="w"))
    materializer = materialize(topic, tmp_path)
    assert orjson.loads(checkpoint.read_bytes())["next_offset"] == 5
    snapshot = materializer.store.snapshot("r1")
    assert [entry.model_call_id for entry in snapshot.entries] == ["c1", "c2"]


def test_an_offset_gap_stops_the_materializer_instead_of_skipping_the_missing_events(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    publish_calls(topic, "x", "c1", "c2", "c3")
    # Offsets 2 and 3 (x/c2) are deleted before the materializer reads them.
    del topic.partitions[0][2:4]
    materializer = Materializer(
        "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
    )
    try:
        with pytest.raises(OffsetGapError, match="jumped from offset 2 to 4") as stopped:
            materializer.start()  # the loop may stop before this returns
            materializer.wait_for(0, 5, 30)
    finally:
        materializer.stop()
    assert "offsets 2-3 were deleted" in str(stopped.value)
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0).next_offset <= 2


def test_two_owners_of_a_partition_from_two_topic_incarnations_are_told_apart_in_the_conflict(
    tmp_path: Path,
) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    write_owner_records(tmp_path / "old", TOPIC, [0], "OLD-id")
    write_owner_records(tmp_path / "new", TOPIC, [0], "NEW-id")
    with pytest.raises(PartitionOwnershipConflictError, match="topic ids OLD-id and NEW-id"):
        PartitionOwners(TOPIC, [tmp_path / "old", tmp_path / "new"])
