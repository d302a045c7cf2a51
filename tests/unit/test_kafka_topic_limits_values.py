"""One set of size limits per topic: the limits record, what offset 0 of partition 0 means, and readers that
decide by it (over the in-memory topic double; the real-broker tests are in tests/integration)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from kafka_topic_double import MemoryTopic, materialize
from store_contract import make_entry

from tokcap.errors import ConfigError, EventDecodeError, NewerSchemaError
from tokcap.events import PutEvent
from tokcap.store import TokenCaptureStore
from transports.kafka.errors import TopicLimitsMismatchError
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.dead_letters import dead_letter_path
from transports.kafka.timeline import LIMITS_PASSED_OVER, LIMITS_RECORDED, LogApplier
from transports.kafka.wire.codec import LogMessage, encode_event_messages, encode_event_value, headers_to_dict
from transports.kafka.wire.router import InboundRouter
from transports.kafka.wire.topic_limits import (
    TOPIC_DEFAULTS,
    TopicLimits,
    check_recorded,
    decode_limits_record,
    encode_limits_record,
    limits_at_start,
)

TOPIC = "tokcap.topic-limits-test"
CHUNK = 2048
SMALL = TopicLimits(max_event_bytes=4 * CHUNK)


def record(topic: MemoryTopic, limits: TopicLimits, partition: int = 0) -> int:
    value, headers = encode_limits_record(limits)
    return topic.produce(None, value, [(name, bytes(raw or b"")) for name, raw in headers], partition)


def chunked_put(topic: MemoryTopic, rollout_id: str, tokens: int) -> PutEvent:
    event = PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, "c1", tokens=tokens))
    for message in encode_event_messages(
        event, chunk_bytes=CHUNK, limits=TopicLimits(64 * CHUNK), next_chunk_group=lambda: f"{rollout_id}:0"
    ):
        topic.produce(message.key, message.value, message.headers)
    return event


def as_log_message(
    value: bytes, headers: list[tuple[str, bytes]], partition: int = 0, offset: int = 0
) -> LogMessage:
    return LogMessage(partition, offset, None, None, tuple(headers), value)


def test_the_limits_record_is_canonical_json_of_two_integers_and_reads_back_as_the_same_limits() -> None:
    limits = TopicLimits(max_event_bytes=300 * 1024 * 1024)
    value, headers = encode_limits_record(limits)
    assert value == b'{"max_event_bytes":314572800,"max_open_chunk_bytes":629145600}'
    assert dict(headers)["tokcap.type"] == b"topic-limits"
    decoded = headers_to_dict(headers)
    assert decode_limits_record(value, decoded) == limits
    assert limits_at_start((value, decoded)) == limits


def test_offset_zero_of_partition_zero_decides_the_limits_and_an_older_topic_has_the_defaults() -> None:
    put = PutEvent(rollout_id="r", entry=make_entry("r", "c1", tokens=3))
    [message] = encode_event_messages(put, next_chunk_group=str)
    assert limits_at_start((message.value, headers_to_dict(message.headers))) == TOPIC_DEFAULTS
    assert limits_at_start(None) == TOPIC_DEFAULTS
    assert TopicLimits(256 * 1024 * 1024, 512 * 1024 * 1024) == TOPIC_DEFAULTS


@pytest.mark.parametrize(
    ("value", "schema", "error"),
    [
        (b'{"max_event_bytes":10}', "1", EventDecodeError),
        (b'{"max_event_bytes":10,"max_open_chunk_bytes":5}', "1", EventDecodeError),
        (b'{"max_event_bytes":true,"max_open_chunk_bytes":5}', "1", EventDecodeError),
        (b"not json", "1", EventDecodeError),
        (b'{"max_event_bytes":10,"max_open_chunk_bytes":20}', "2", EventDecodeError),
        (
            b'{"max_event_bytes":10,"max_open_chunk_bytes":20,"staged_payload_topic":"p"}',
            "1",
            EventDecodeError,
        ),
        (
            b'{"max_event_bytes":10,"max_open_chunk_bytes":20,"staged_payload_topic":""}',
            "2",
            EventDecodeError,
        ),
        (b'{"max_event_bytes":10,"max_open_chunk_bytes":20,"staged_payload_topic":7}', "2", EventDecodeError),
        (b'{"max_event_bytes":10,"max_open_chunk_bytes":20}', "0", EventDecodeError),
        (
            b'{"max_event_bytes":10,"max_open_chunk_bytes":20,"staged_payload_topic":"p"}',
            "3",
            NewerSchemaError,
        ),
    ],
)
def test_a_limits_record_no_reader_can_use_is_refused_not_guessed(
    value: bytes, schema: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        decode_limits_record(value, {"tokcap.type": "topic-limits", "tokcap.schema_version": schema})


def test_a_limits_record_without_a_payload_topic_is_the_schema_1_record_byte_for_byte() -> None:
    value, headers = encode_limits_record(TopicLimits(max_event_bytes=2048))
    assert value == b'{"max_event_bytes":2048,"max_open_chunk_bytes":4096}'
    assert dict(headers)["tokcap.schema_version"] == b"1"


def test_a_limits_record_naming_a_payload_topic_is_schema_2_and_reads_back_equal() -> None:
    limits = TopicLimits(max_event_bytes=2048, staged_payload_topic="tokcap-staged.tokcap.r")
    value, headers = encode_limits_record(limits)
    assert value == (
        b'{"max_event_bytes":2048,"max_open_chunk_bytes":4096,"staged_payload_topic":"tokcap-staged.tokcap.r"}'
    )
    assert dict(headers)["tokcap.schema_version"] == b"2"
    assert decode_limits_record(value, headers_to_dict(headers)) == limits
    assert limits != TopicLimits(max_event_bytes=2048) and limits.sizes_equal(
        TopicLimits(max_event_bytes=2048)
    )


def test_limits_that_could_never_reassemble_an_event_of_the_largest_size_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_open_chunk_bytes"):
        TopicLimits(max_event_bytes=10_000, max_open_chunk_bytes=9_999)
    with pytest.raises(ConfigError, match="max_event_bytes"):
        TopicLimits(max_event_bytes=0)


def test_the_materializer_reads_the_topics_limits_from_its_log_and_dead_letters_by_them(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    record(topic, SMALL)
    big = chunked_put(topic, "r-big", tokens=3000)
    fits = chunked_put(topic, "r-fits", tokens=1200)
    assert SMALL.max_event_bytes < len(encode_event_value(big)[1]) < TOPIC_DEFAULTS.max_event_bytes
    materializer = materialize(topic, tmp_path)
    assert materializer.limits == SMALL
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("r-big") and store.read_entries("r-big") == []
    assert store.read_entries("r-fits") == [fits.entry]
    lines = [orjson.loads(line) for line in dead_letter_path(tmp_path, 0).read_bytes().splitlines()]
    assert "over the maximum event size of 8,192 bytes" in lines[0]["reason"]
    assert {line["rollout_id"] for line in lines} == {"r-big"}  # the record itself is no dead letter


def test_a_reader_that_took_the_defaults_before_the_record_was_written_stops_at_a_record_saying_otherwise() -> (
    None
):
    value, headers = encode_limits_record(SMALL)
    raw = [(name, bytes(item or b"")) for name, item in headers]
    with pytest.raises(TopicLimitsMismatchError, match="start it again"):
        InboundRouter(topic=TOPIC).route(as_log_message(value, raw))
    assert InboundRouter(topic=TOPIC, limits=SMALL).route(as_log_message(value, raw)) == []
    # Anywhere else a limits record is a claim that lost, or a crafted one: it decides nothing.
    assert InboundRouter(topic=TOPIC).route(as_log_message(value, raw, offset=7)) == []
    assert InboundRouter(topic=TOPIC).pass_over(as_log_message(value, raw, partition=1)) == []
    with pytest.raises(TopicLimitsMismatchError):
        check_recorded(TOPIC, SMALL, TOPIC_DEFAULTS)


def test_the_timeline_shows_the_limits_record_and_applies_nothing_for_it(tmp_path: Path) -> None:
    value, headers = encode_limits_record(SMALL)
    raw = [(name, bytes(item or b"")) for name, item in headers]
    applier = LogApplier(TokenCaptureStore(tmp_path), TOPIC, InboundRouter(topic=TOPIC, limits=SMALL))
    entry = applier.take(as_log_message(value, raw))
    assert (entry.event_type, entry.decision, entry.writer) == (
        "topic-limits",
        LIMITS_RECORDED,
        "tokcap-topic-create",
    )
    assert "max_event_bytes=8,192" in entry.detail
    assert applier.take(as_log_message(value, raw, offset=3)).decision == LIMITS_PASSED_OVER
    assert TokenCaptureStore(tmp_path).rollout_ids() == []


def test_limits_given_to_the_materializer_warn_and_a_value_other_than_the_topics_stops_it(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    record(topic, SMALL)
    with pytest.warns(DeprecationWarning, match="max_event_bytes is deprecated"):
        wrong = Materializer(
            "memory",
            TOPIC,
            tmp_path / "wrong",
            consumer_factory=topic.consumer,
            topic_id_reader=topic.topic_id,
            max_event_bytes=TOPIC_DEFAULTS.max_event_bytes,
        )
    with pytest.raises(TopicLimitsMismatchError) as refused:
        wrong.start()
    wrong.stop()
    assert "max_event_bytes=268,435,456 (the topic has 8,192)" in str(refused.value)
    with pytest.warns(DeprecationWarning):
        agreeing = Materializer(
            "memory",
            TOPIC,
            tmp_path / "agreeing",
            consumer_factory=topic.consumer,
            topic_id_reader=topic.topic_id,
            max_event_bytes=SMALL.max_event_bytes,
            max_open_chunk_bytes=SMALL.max_open_chunk_bytes,
        )
    agreeing.start()
    try:
        assert agreeing.limits == SMALL
    finally:
        agreeing.request_stop()
        topic.wake_consumers()
        agreeing.stop()
