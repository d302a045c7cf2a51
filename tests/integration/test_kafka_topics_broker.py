"""Creating a run topic is idempotent, and an existing topic with other settings is reported."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from transports.kafka import TopicSettings, ensure_topic, topic_for_run
from transports.kafka.errors import TopicMismatchError

pytestmark = pytest.mark.kafka


def test_a_run_topic_is_created_once_and_reused_when_its_settings_match(kafka_bootstrap: str) -> None:
    topic = topic_for_run(f"topics-test-{uuid.uuid4().hex[:10]}")
    settings = TopicSettings(partitions=2, config={"retention.ms": "3600000"})
    try:
        assert ensure_topic(kafka_bootstrap, topic, settings) is True
        assert ensure_topic(kafka_bootstrap, topic, settings) is False
        with pytest.raises(TopicMismatchError, match=r"retention\.ms"):
            ensure_topic(kafka_bootstrap, topic, TopicSettings(partitions=2, config={"retention.ms": "1000"}))
    finally:
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        admin.delete_topics([topic])[topic].result(timeout=30)


def test_an_existing_topic_with_another_partition_count_is_reported(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory("mismatch", partitions=2)
    with pytest.raises(TopicMismatchError, match="partitions 2"):
        ensure_topic(kafka_bootstrap, topic, TopicSettings(partitions=3))
    with pytest.raises(TopicMismatchError, match="replication factor"):
        ensure_topic(kafka_bootstrap, topic, TopicSettings(partitions=2, replication_factor=3))
