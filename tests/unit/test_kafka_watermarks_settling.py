"""Reading a partition's watermarks while its leadership settles (a topic just made) asks again until a deadline."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from transports.kafka.client.admin import _watermarks_once_led


class _SettlingConsumer:
    """Answers ``errors`` in turn, then the watermarks; a fault injected where a broker cannot be made to lag."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.asked = 0

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float) -> tuple[int, int]:
        self.asked += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 0, 7


def test_a_partition_without_a_settled_leader_is_asked_again_until_it_answers() -> None:
    consumer: Any = _SettlingConsumer(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)
    assert _watermarks_once_led(consumer, TopicPartition("t", 0), time.monotonic() + 10) == (0, 7)
    assert consumer.asked == 3


def test_any_other_error_and_an_unsettled_leader_past_the_deadline_are_raised() -> None:
    other: Any = _SettlingConsumer(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        _watermarks_once_led(other, TopicPartition("t", 0), time.monotonic() + 10)
    assert other.asked == 1
    late: Any = _SettlingConsumer(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 100)
    with pytest.raises(KafkaException):
        _watermarks_once_led(late, TopicPartition("t", 0), time.monotonic() + 0.3)
    assert 1 < late.asked < 100
