"""A run topic deleted and created again under its name is never resumed at the old topic's offsets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from store_contract import make_entry

from tests.kafka_broker_fixture import TopicFactory
from tokcap.log.events import Event, IntentEvent, PutEvent
from transports.kafka import KafkaTokenSink, KafkaTokenSource, Materializer
from transports.kafka.client.producer_bridge import ProducerBridge
from transports.kafka.errors import MaterializerFailedError, TopicIncarnationError
from transports.kafka.materializer import incarnation
from transports.kafka.materializer.checkpoint import applied_next_offset, checkpoint_path
from transports.kafka.wire.codec import encode_event_messages

pytestmark = pytest.mark.kafka


def topic_id(bootstrap: str, topic: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return str(admin.describe_topics(TopicCollection([topic]))[topic].result(timeout=30).topic_id)


def recreate(bootstrap: str, topic: str) -> None:
    """Delete the topic and create it again under the same name, once the broker lets the name go."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic], operation_timeout=30)[topic].result(timeout=60)
    deadline = time.monotonic() + 60
    while True:
        try:
            admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(
                timeout=60
            )
            break
        except KafkaException:
            # The deletion finishes in the background; until then the name is taken.
            assert time.monotonic() < deadline, f"{topic} could not be created again"
            time.sleep(0.2)
    TopicFactory._wait_leaders(admin, topic, 1)


async def put_calls(sink: KafkaTokenSink, rollout_ids: list[str], call_id: str) -> None:
    """An intent and a put for each rollout: two messages each."""
    for rollout_id in rollout_ids:
        await sink.begin_call(rollout_id, call_id)
        await sink.put(make_entry(rollout_id, call_id))


def call_events(rollout_id: str, call_id: str) -> list[Event]:
    return [
        IntentEvent(rollout_id=rollout_id, writer="w", model_call_id=call_id),
        PutEvent(rollout_id=rollout_id, writer="w", entry=make_entry(rollout_id, call_id)),
    ]


async def write_new_topic(bootstrap: str, topic: str) -> None:
    """``x/c1`` at offsets 0-1, ten other messages, then ``x/c2`` at offsets 12-13, in one batch.

    One batch is how the new topic reaches the old checkpoint's offset before a running consumer fetches again.
    """
    events = call_events("x", "c1")
    for index in range(5):
        events += call_events(f"other{index}", "c1")
    events += call_events("x", "c2")
    messages = [m for event in events for m in encode_event_messages(event, next_chunk_group=lambda: "g:0")]
    bridge = ProducerBridge(bootstrap)
    try:
        delivered = await bridge.send(topic, messages, what="events")
    finally:
        await asyncio.to_thread(bridge.close)
    assert [d.offset for d in delivered] == list(range(14))


async def write_old_topic(bootstrap: str, topic: str) -> None:
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    try:
        await put_calls(sink, [f"old{i}" for i in range(5)], "c1")
    finally:
        await sink.close()


async def freeze_x(bootstrap: str, topic: str, store_dir: Path) -> list[str]:
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir, timeout_s=30)
    try:
        snapshot = await source.freeze("x")
        assert snapshot.incomplete is False
        return [entry.model_call_id for entry in snapshot.entries]
    finally:
        await source.close()


def test_a_directory_of_a_deleted_topic_is_refused_by_the_topic_created_again_before_anything_is_applied(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    asyncio.run(write_old_topic(kafka_bootstrap, kafka_topic))
    old_id = topic_id(kafka_bootstrap, kafka_topic)
    materializer = Materializer(kafka_bootstrap, kafka_topic, store_dir)
    materializer.start()
    assert materializer.wait_until_caught_up(60)
    materializer.stop()
    checkpoint = checkpoint_path(store_dir, 0)
    assert orjson.loads(checkpoint.read_bytes())["next_offset"] == 10
    before = checkpoint.read_bytes()

    recreate(kafka_bootstrap, kafka_topic)
    new_id = topic_id(kafka_bootstrap, kafka_topic)
    asyncio.run(write_new_topic(kafka_bootstrap, kafka_topic))

    with pytest.raises(TopicIncarnationError) as refused:
        asyncio.run(freeze_x(kafka_bootstrap, kafka_topic, store_dir))
    message = str(refused.value)
    assert old_id in message and new_id in message and "new, empty directory" in message
    # Nothing of the new topic was applied: the checkpoint is untouched and rollout x was never written.
    assert checkpoint.read_bytes() == before
    assert materializer.store.read_state("x").is_pristine

    # What the refusal says to do: the new topic into a new directory holds both calls.
    assert asyncio.run(freeze_x(kafka_bootstrap, kafka_topic, tmp_path / "new")) == ["c1", "c2"]


def test_a_running_materializer_answers_no_freeze_read_from_its_topic_created_again(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No periodic check runs in between: the freeze itself must prove which topic it was read from.
    monkeypatch.setattr(incarnation, "TOPIC_CHECK_S", 3600.0)
    store_dir = tmp_path / "store"
    asyncio.run(write_old_topic(kafka_bootstrap, kafka_topic))
    consumers: list[Consumer] = []

    def keep(settings: dict[str, Any]) -> Consumer:
        consumers.append(Consumer(settings))
        return consumers[-1]

    materializer = Materializer(kafka_bootstrap, kafka_topic, store_dir, consumer_factory=keep)
    materializer.start()
    assert materializer.wait_until_caught_up(60)
    assert materializer.applied_offsets() == {0: 10}
    # The consumer fetches nothing while the topic is replaced, so the new topic reaches offset 10 before
    # it fetches again: it then goes on at offset 10 of the new topic without any error from the client.
    reading = consumers[0]
    reading.pause([TopicPartition(kafka_topic, 0)])
    recreate(kafka_bootstrap, kafka_topic)
    asyncio.run(write_new_topic(kafka_bootstrap, kafka_topic))
    reading.resume([TopicPartition(kafka_topic, 0)])

    async def freeze() -> list[str]:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            store_dir=store_dir,
            materializer=materializer,
            timeout_s=30,
        )
        try:
            snapshot = await source.freeze("x")
            return [entry.model_call_id for entry in snapshot.entries]
        finally:
            await source.close()

    try:
        with pytest.raises(TopicIncarnationError, match="new, empty directory"):
            asyncio.run(freeze())
    finally:
        materializer.stop()


def test_a_running_materializer_stops_by_itself_when_its_topic_is_created_again(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    asyncio.run(write_old_topic(kafka_bootstrap, kafka_topic))
    materializer = Materializer(kafka_bootstrap, kafka_topic, tmp_path / "store")
    materializer.start()
    try:
        assert materializer.wait_until_caught_up(60)
        recreate(kafka_bootstrap, kafka_topic)
        asyncio.run(write_new_topic(kafka_bootstrap, kafka_topic))
        with pytest.raises(TopicIncarnationError, match="new, empty directory"):
            materializer.wait_for(0, 13, 30)
    finally:
        materializer.stop()


def test_a_following_source_refuses_a_checkpoint_of_another_topic_incarnation(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    # The directory's materializer (stopped, or not yet aware) last applied another topic of this name.
    tmp_path.joinpath("store").mkdir()
    old = {"next_offset": 100, "partition": 0, "pending_chunk_offsets": [], "topic": kafka_topic}
    old["topic_id"] = "AAAAAAAAAAAAAAAAAAAAAA"
    checkpoint_path(tmp_path / "store", 0).write_bytes(orjson.dumps(old))

    async def freeze() -> None:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            store_dir=tmp_path / "store",
            external_materializer=True,
            timeout_s=10,
        )
        try:
            await source.freeze("x")
        finally:
            await source.close()

    with pytest.raises(TopicIncarnationError, match="AAAAAAAAAAAAAAAAAAAAAA") as refused:
        asyncio.run(freeze())
    assert topic_id(kafka_bootstrap, kafka_topic) in str(refused.value)


def test_records_deleted_from_the_topic_before_they_were_read_stop_the_materializer_clearly(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    asyncio.run(write_old_topic(kafka_bootstrap, kafka_topic))  # offsets 0-9
    first = Materializer(kafka_bootstrap, kafka_topic, tmp_path)
    first.start()
    try:
        assert first.wait_until_caught_up(60)
    finally:
        first.stop()
    asyncio.run(write_old_topic(kafka_bootstrap, kafka_topic))  # offsets 10-19
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    (deleted,) = admin.delete_records([TopicPartition(kafka_topic, 0, 14)]).values()
    assert deleted.result(timeout=30).low_watermark == 14
    resumed = Materializer(kafka_bootstrap, kafka_topic, tmp_path)
    with pytest.raises(MaterializerFailedError) as stopped:
        resumed.start()
        resumed.wait_until_caught_up(60)
    resumed.stop()
    message = str(stopped.value)
    assert (
        kafka_topic in message
        and "Offset out of range" in message
        and "replay into a new directory" in message
    )
    assert applied_next_offset(tmp_path, kafka_topic, 0) == 10
