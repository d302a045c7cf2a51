"""Smoke tests proving the test broker really works end to end through confluent-kafka.

If these fail, every Kafka transport test would fail for reasons unrelated to tokcap, so they
pin down the broker harness itself: topic lifecycle, idempotent acks=all produce, headers,
explicit-offset consumption, and a restart on the same address.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from kafka_broker_fixture import KafkaBrokerControl, TopicFactory

pytestmark = pytest.mark.kafka

confluent_kafka = pytest.importorskip("confluent_kafka")
admin_mod = pytest.importorskip("confluent_kafka.admin")


def _producer(bootstrap: str) -> Any:
    """Idempotent acks=all producer with a bounded delivery timeout, like the transport uses."""
    return confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": 30000,
            "linger.ms": 5,
        }
    )


def _produce(
    bootstrap: str, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]
) -> list[Any]:
    """Produce records and return their delivery reports after a flush, failing on any delivery error."""
    producer = _producer(bootstrap)
    delivered: list[Any] = []
    errors: list[Any] = []

    def on_delivery(err: Any, msg: Any) -> None:
        """Collect delivery reports from librdkafka's callback thread (poll/flush caller)."""
        (errors if err is not None else delivered).append(err if err is not None else msg)

    for key, value, headers in records:
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=on_delivery)
        producer.poll(0)
    remaining = producer.flush(60)
    assert remaining == 0, f"{remaining} messages not delivered"
    assert not errors, errors
    return delivered


def _consume_all(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list[Any]:
    """Assign partition 0 from offset 0 explicitly (no group coordination) and read count messages."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"tokcap-smoke-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=count - len(got), timeout=1.0):
                assert msg.error() is None, msg.error()
                got.append(msg)
        return got
    finally:
        consumer.close()


def test_topic_produce_consume_delete(kafka_bootstrap: str) -> None:
    """Full lifecycle through AdminClient, idempotent producer and an assigned consumer."""
    admin = admin_mod.AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"tokcap-smoke-{uuid.uuid4().hex[:12]}"
    admin.create_topics([admin_mod.NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(60)
    try:
        records = [
            (
                f"k{i}".encode(),
                f"payload-{i}-\u00e9".encode(),
                [("trace", f"t{i}".encode()), ("kind", b"smoke")],
            )
            for i in range(20)
        ]
        reports = _produce(kafka_bootstrap, topic, records)
        assert sorted(m.offset() for m in reports) == list(range(20))

        got = _consume_all(kafka_bootstrap, topic, len(records))
        assert [(m.key(), m.value()) for m in got] == [(k, v) for k, v, _ in records]
        assert [m.headers() for m in got] == [h for _, _, h in records]
        assert [m.offset() for m in got] == list(range(20))
    finally:
        admin.delete_topics([topic], operation_timeout=30)[topic].result(60)

    deadline = time.monotonic() + 30
    while topic in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, f"topic {topic} still listed after deletion"
        time.sleep(0.2)


def test_topic_fixtures_give_unique_topics(kafka_topic: str, kafka_topic_factory: TopicFactory) -> None:
    """kafka_topic and the factory create distinct, usable topics with the requested partitions."""
    other = kafka_topic_factory("multi", partitions=3)
    assert other != kafka_topic
    assert other.startswith("tokcap-test-") and kafka_topic.startswith("tokcap-test-")
    admin = admin_mod.AdminClient({"bootstrap.servers": kafka_topic_factory.bootstrap})
    md = admin.list_topics(timeout=10)
    assert len(md.topics[kafka_topic].partitions) == 1
    assert len(md.topics[other].partitions) == 3
    _produce(kafka_topic_factory.bootstrap, kafka_topic, [(b"k", b"v", [])])
    assert [m.value() for m in _consume_all(kafka_topic_factory.bootstrap, kafka_topic, 1)] == [b"v"]


def test_broker_restart_keeps_address_and_data(
    kafka_broker_control: KafkaBrokerControl, kafka_topic: str
) -> None:
    """stop()/start() bring the broker back on the same address with data intact; a live producer survives."""
    bootstrap = kafka_broker_control.bootstrap
    producer = _producer(bootstrap)
    delivered: list[Any] = []

    def on_delivery(err: Any, msg: Any) -> None:
        """Record every delivery outcome, failed ones included."""
        delivered.append((err, msg.key()))

    producer.produce(kafka_topic, key=b"before", value=b"1", on_delivery=on_delivery)
    assert producer.flush(30) == 0

    kafka_broker_control.stop()
    assert not kafka_broker_control.is_running()
    producer.produce(kafka_topic, key=b"during", value=b"2", on_delivery=on_delivery)
    producer.poll(1.0)
    assert kafka_broker_control.start() == bootstrap
    assert kafka_broker_control.is_running()

    producer.produce(kafka_topic, key=b"after", value=b"3", on_delivery=on_delivery)
    assert producer.flush(60) == 0
    assert [(err, key) for err, key in delivered] == [(None, b"before"), (None, b"during"), (None, b"after")]
    assert [m.key() for m in _consume_all(bootstrap, kafka_topic, 3)] == [b"before", b"during", b"after"]
