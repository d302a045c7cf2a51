"""Run topics have documented, valid names."""

from __future__ import annotations

import pytest

from tokcap.errors import ConfigError
from transports.kafka import (
    MAX_TOPIC_NAME_LENGTH,
    TopicSettings,
    resolve_topic,
    topic_for_run,
    validate_topic_name,
)


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
