"""Run topics have documented, valid names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError

from tokcap.errors import ConfigError, TransportError
from transports.kafka import (
    MAX_TOPIC_NAME_LENGTH,
    TopicSettings,
    resolve_topic,
    topic_for_run,
    validate_topic_name,
)
from transports.kafka.client.topics import KEEP_WHOLE_RUN, _existing_mismatches


def test_a_run_topic_is_the_prefix_plus_the_run_id() -> None:
    assert topic_for_run("exp-7_a.b") == "tokcap.exp-7_a.b"


@pytest.mark.parametrize(
    "run_id", ["", "has space", "slash/run", "ümlaut", "x" * (MAX_TOPIC_NAME_LENGTH - 6)]
)
def test_run_ids_kafka_cannot_name_a_topic_with_are_refused(run_id: str) -> None:
    with pytest.raises(ConfigError):
        topic_for_run(run_id)


def test_the_longest_accepted_run_id_fills_the_topic_name_limit() -> None:
    assert len(topic_for_run("x" * (MAX_TOPIC_NAME_LENGTH - len("tokcap.")))) == MAX_TOPIC_NAME_LENGTH


@pytest.mark.parametrize("name", ["", ".", "..", "a" * 250, "a:b"])
def test_invalid_topic_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        validate_topic_name(name)


def test_exactly_one_of_run_id_and_topic_must_be_given() -> None:
    assert resolve_topic("r", None) == "tokcap.r"
    assert resolve_topic(None, "custom") == "custom"
    for run_id, topic in ((None, None), ("r", "custom")):
        with pytest.raises(ConfigError):
            resolve_topic(run_id, topic)


def test_topic_settings_refuse_zero_partitions_or_replicas() -> None:
    with pytest.raises(ConfigError):
        TopicSettings(partitions=0)
    with pytest.raises(ConfigError):
        TopicSettings(replication_factor=0)


class _LateMetadataAdmin:
    """An admin client whose broker learns of the topic only at its third metadata request."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.asked = 0

    def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
        self.asked += 1
        if self.asked < 3:
            error = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            return SimpleNamespace(topics={topic: SimpleNamespace(error=error, partitions={})})
        partitions = {0: SimpleNamespace(replicas=[1])}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})

    def describe_configs(
        self, resources: list[object], request_timeout: float
    ) -> dict[object, SimpleNamespace]:
        described = {"retention.ms": SimpleNamespace(value=KEEP_WHOLE_RUN)}
        return {resources[0]: SimpleNamespace(result=lambda timeout: described)}


def test_an_existing_topic_whose_metadata_lags_its_creation_is_asked_for_again() -> None:
    admin = _LateMetadataAdmin("tokcap.late")
    settings = TopicSettings(partitions=1, replication_factor=1)
    assert _existing_mismatches(admin, "tokcap.late", settings, 5.0) == []  # type: ignore[arg-type]
    assert admin.asked == 3


def test_a_topic_still_unknown_when_the_wait_ends_is_an_error_naming_it() -> None:
    admin = _LateMetadataAdmin("tokcap.never")
    admin.asked = -(10**9)
    with pytest.raises(TransportError, match=r"tokcap\.never"):
        _existing_mismatches(admin, "tokcap.never", TopicSettings(partitions=1), 0.3)  # type: ignore[arg-type]
