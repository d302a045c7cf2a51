"""The payload reader answers every piece asked for, in any order, from one forward read where it can."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from transports.kafka.client.clients import ClientContext
from transports.kafka.client.payload_reader import PayloadReader

pytestmark = pytest.mark.kafka


def _produce(bootstrap: str, topic: str, values: list[tuple[int, bytes]]) -> list[tuple[int, int]]:
    """Produce ``(partition, value)`` pairs; return where each landed, in order."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    landed: list[tuple[int, int]] = []

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        landed.append((message.partition(), message.offset()))

    for partition, value in values:
        producer.produce(topic, value, b"k", partition=partition, on_delivery=delivered)
        producer.flush(30)
    return landed


def test_pieces_asked_for_out_of_order_are_answered_exactly_from_one_forward_read(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory("payloads", partitions=2)
    values = [(index % 2, f"piece-{index}".encode() * 100) for index in range(40)]
    landed = _produce(kafka_bootstrap, topic, values)
    reader = PayloadReader(ClientContext(kafka_bootstrap, {}), topic)
    try:
        # Pairs swapped, as two stagers whose references landed in the other order than their payloads.
        order = [i ^ 1 for i in range(len(values))]
        for index in order:
            message = reader.read(*landed[index])
            assert message is not None and message.value == values[index][1]
            assert (message.partition, message.offset) == landed[index]
        assert reader.moves == 2, "one move per partition, then everything read forward"
        # Asked again after it was answered (and forgotten): the reader moves back and reads it from the log.
        again = reader.read(*landed[3])
        assert again is not None and again.value == values[3][1] and reader.moves == 3
    finally:
        reader.close()


def test_pieces_forgotten_past_the_memory_bound_are_read_again_exactly(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory("payloads-bound")
    values = [(0, bytes([index]) * 10_000) for index in range(30)]
    landed = _produce(kafka_bootstrap, topic, values)
    reader = PayloadReader(ClientContext(kafka_bootstrap, {}), topic, max_kept_bytes=50_000)
    try:
        last = reader.read(*landed[-1])
        assert last is not None and last.value == values[-1][1]
        for index in range(len(values) - 1):
            message = reader.read(*landed[index])
            assert message is not None and message.value == values[index][1]
    finally:
        reader.close()


def test_a_piece_the_log_no_longer_holds_or_never_held_is_missing_not_awaited(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory("payloads-trimmed")
    landed = _produce(kafka_bootstrap, topic, [(0, b"a"), (0, b"b"), (0, b"c")])
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})  # kept alive until the future resolves
    (trimmed,) = admin.delete_records([TopicPartition(topic, 0, 2)]).values()
    trimmed.result(timeout=30)
    reader = PayloadReader(ClientContext(kafka_bootstrap, {}), topic, timeout_s=20)
    try:
        assert reader.read(*landed[0]) is None
        kept = reader.read(*landed[2])
        assert kept is not None and kept.value == b"c"
        assert reader.read(0, 3) is None
        # A piece written after the reader reached the end is found, not reported missing by a stale end.
        [(partition, offset)] = _produce(kafka_bootstrap, topic, [(0, b"d")])
        late = reader.read(partition, offset)
        assert late is not None and late.value == b"d"
    finally:
        reader.close()
