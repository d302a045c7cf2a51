"""Large events have a stated memory budget: a maximum event size shared by the sinks and the router, and a
per-partition budget on the bytes open chunk groups hold.

A group over the event size is dead-lettered as soon as it declares or reaches it, its rollout masked, nothing
more of it buffered; a chunk that would take a partition's open groups past the budget abandons the oldest
open group first. Every reader takes the same decision: the materializer, a resumed one, and the timeline
reading one rollout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
from kafka_topic_double import MemoryTopic, materialize
from store_contract import make_entry

from tokcap.errors import ConfigError, EventTooLargeError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import FreezeEvent, PutEvent
from transports.kafka import KafkaTokenSink
from transports.kafka.materializer.dead_letters import dead_letter_path
from transports.kafka.staging import KafkaStagingSink
from transports.kafka.timeline import LogApplier
from transports.kafka.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    OutgoingMessage,
    encode_event_messages,
    encode_event_value,
)
from transports.kafka.wire.router import (
    ApplyEvent,
    Buffered,
    DeadLetter,
    InboundRouter,
    LogMessage,
)
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

TOPIC = "tokcap.chunk-limits-test"
CHUNK = 2048
EVENT_LIMIT = 4 * CHUNK
"""Room for a three-chunk put, not for a seven-chunk one."""
LIMITS = TopicLimits(max_event_bytes=EVENT_LIMIT, max_open_chunk_bytes=EVENT_LIMIT)


def put_of(rollout_id: str, tokens: int = 1200) -> PutEvent:
    return PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, "c1", tokens=tokens))


def chunks(event: PutEvent, session: str) -> list[OutgoingMessage]:
    return encode_event_messages(event, chunk_bytes=CHUNK, next_chunk_group=lambda: f"{session}:0")


def crafted(rollout_id: str, sizes: list[int], group: str = "crafted:0") -> list[OutgoingMessage]:
    """Chunk messages of the given value sizes under one group, as no sink would write them."""
    headers = [("tokcap.type", b"put"), ("tokcap.schema_version", b"1"), ("tokcap.encoding", b"packed")]
    return [
        OutgoingMessage(
            rollout_id.encode(),
            b"x" * size,
            [
                *headers,
                ("tokcap.chunk.group", group.encode()),
                ("tokcap.chunk.index", str(index).encode()),
                ("tokcap.chunk.count", str(len(sizes)).encode()),
                ("tokcap.chunk.sha256", b"0" * 64),
            ],
        )
        for index, size in enumerate(sizes)
    ]


def log_messages(messages: list[OutgoingMessage], partition: int = 0) -> list[LogMessage]:
    return [
        LogMessage(partition, offset, None, m.key, tuple(m.headers), m.value)
        for offset, m in enumerate(messages)
    ]


def dead_letters(directory: Path) -> list[dict[str, object]]:
    path = dead_letter_path(directory, 0)
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def rollout_files(directory: Path, rollout_id: str | None = None) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if not path.name.startswith("kafka-")
        and not path.name.endswith(".lock")
        and (rollout_id is None or path.name.startswith(f"{rollout_id}."))
    }


# ------------------------------------------------------------------ the event size


def test_a_group_whose_first_chunk_declares_more_than_the_event_limit_is_dead_lettered_and_nothing_is_buffered() -> (
    None
):
    router = InboundRouter(limits=LIMITS)
    oversized = chunks(put_of("r-big", tokens=3000), "w")
    assert (len(oversized) - 1) * CHUNK + 1 > EVENT_LIMIT
    first, *rest = log_messages(oversized)
    (letter,) = router.route(first)
    assert isinstance(letter, DeadLetter) and not letter.abandoned
    assert letter.rollout_id == "r-big" and letter.mask is not None
    assert "over the maximum event size of 8,192 bytes (max_event_bytes)" in letter.reason
    assert router.open_groups() == [] and router.open_chunk_bytes(0) == 0
    for message in rest:
        (orphan,) = router.route(message)
        assert isinstance(orphan, DeadLetter) and "orphaned chunk" in orphan.reason
        assert router.open_chunk_bytes(0) == 0


def test_a_group_whose_chunks_grow_past_the_event_limit_is_abandoned_at_the_chunk_that_crosses_it() -> None:
    router = InboundRouter(limits=LIMITS)
    # The first chunk declares little (3 chunks of 100 bytes); the others are larger than it said.
    first, second, third = log_messages(crafted("r-liar", [100, 5000, 5000]))
    assert isinstance(router.route(first)[0], Buffered)
    assert isinstance(router.route(second)[0], Buffered)
    abandoned, letter = router.route(third)
    assert isinstance(abandoned, DeadLetter) and abandoned.abandoned
    assert (abandoned.offset, abandoned.rollout_id) == (0, "r-liar") and abandoned.mask is not None
    assert "reach 10,100 bytes at chunk 2" in abandoned.reason and "max_event_bytes" in abandoned.reason
    assert isinstance(letter, DeadLetter) and not letter.abandoned and letter.offset == 2
    assert router.open_groups() == [] and router.open_chunk_bytes(0) == 0


def test_a_group_of_exactly_the_event_limit_is_applied_and_one_byte_less_of_limit_dead_letters_it() -> None:
    event = put_of("r-edge")
    size = len(encode_event_value(event)[1])
    messages = log_messages(chunks(event, "w"))
    exact = InboundRouter(limits=TopicLimits(size))
    decided = [routed for message in messages for routed in exact.route(message)]
    assert isinstance(decided[-1], ApplyEvent) and decided[-1].event == event
    short = InboundRouter(limits=TopicLimits(size - 1))
    decided = [routed for message in messages for routed in short.route(message)]
    assert not any(isinstance(routed, ApplyEvent) for routed in decided)
    assert any(isinstance(routed, DeadLetter) and routed.rollout_id == "r-edge" for routed in decided)


def test_an_oversized_group_is_dead_lettered_and_masked_by_the_materializer_while_other_rollouts_apply(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    topic.publish(put_of("r-before", tokens=5))
    for message in [*chunks(put_of("r-big", tokens=3000), "w"), *crafted("r-liar", [100, 5000, 5000])]:
        topic.produce(message.key, message.value, message.headers)
    for message in chunks(put_of("r-after"), "v"):
        topic.produce(message.key, message.value, message.headers)
    materialize(topic, tmp_path, limits=LIMITS)
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("r-big") and store.read_entries("r-big") == []
    assert store.is_incomplete("r-liar") and store.read_entries("r-liar") == []
    assert store.read_entries("r-before") == [put_of("r-before", tokens=5).entry]
    assert store.read_entries("r-after") == [put_of("r-after").entry] and not store.is_incomplete("r-after")
    lines = dead_letters(tmp_path)
    assert {line["rollout_id"] for line in lines if "max_event_bytes" in str(line["reason"])} == {
        "r-big",
        "r-liar",
    }
    assert {line["rollout_id"] for line in lines} == {"r-big", "r-liar"}


# ------------------------------------------------------------------ the open-bytes budget


def budget_log() -> tuple[MemoryTopic, dict[str, PutEvent]]:
    """Three writers' three-chunk puts interleaved so the fifth chunk passes a budget of four chunks."""
    events = {rollout_id: put_of(rollout_id) for rollout_id in ("r-a", "r-b", "r-c")}
    a, b, c = (chunks(events[rid], session) for rid, session in (("r-a", "wa"), ("r-b", "wb"), ("r-c", "wc")))
    assert [len(group) for group in (a, b, c)] == [3, 3, 3]
    topic = MemoryTopic(TOPIC)
    for message in [a[0], b[0], c[0], a[1], b[1], b[2], c[1], c[2], a[2]]:
        topic.produce(message.key, message.value, message.headers)
    return topic, events


def test_a_chunk_over_the_open_bytes_budget_abandons_the_oldest_open_group_and_the_others_complete() -> None:
    topic, events = budget_log()
    router = InboundRouter(limits=LIMITS)
    decided = []
    for message in topic.messages():
        decided.extend(router.route(message.as_log_message()))
        assert router.open_chunk_bytes(0) <= EVENT_LIMIT
    applied = {routed.event.rollout_id: routed.event for routed in decided if isinstance(routed, ApplyEvent)}
    assert applied == {"r-b": events["r-b"], "r-c": events["r-c"]}
    letters = [routed for routed in decided if isinstance(routed, DeadLetter)]
    assert [(letter.offset, letter.rollout_id, not letter.abandoned) for letter in letters] == [
        (0, "r-a", False),
        (8, "r-a", True),
    ]
    assert "over the budget of 8,192 bytes (max_open_chunk_bytes)" in letters[0].reason
    assert "--max-open-chunk-bytes" in letters[0].reason
    assert "orphaned chunk 2/3" in letters[1].reason
    assert router.open_groups() == [] and router.open_chunk_bytes(0) == 0


def test_the_materializer_masks_the_rollout_whose_group_the_budget_abandoned_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topic, events = budget_log()
    with caplog.at_level("WARNING", logger="transports.kafka.wire.router"):
        materialize(topic, tmp_path, limits=LIMITS)
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("r-a") and store.read_entries("r-a") == []
    for rollout_id in ("r-b", "r-c"):
        assert store.read_entries(rollout_id) == [events[rollout_id].entry]
        assert not store.is_incomplete(rollout_id)
    assert any("max_open_chunk_bytes" in record.getMessage() for record in caplog.records)


def test_the_budget_is_per_partition_so_groups_in_different_partitions_do_not_evict_each_other() -> None:
    topic, events = budget_log()
    router = InboundRouter(limits=LIMITS)
    decided = []
    for message in topic.messages():
        log_message = message.as_log_message()
        if log_message.key in (b"r-b", b"r-c"):
            log_message = dataclasses.replace(log_message, partition=1)
        decided.extend(router.route(log_message))
    applied = {routed.event.rollout_id for routed in decided if isinstance(routed, ApplyEvent)}
    assert applied == set(events) and not any(isinstance(routed, DeadLetter) for routed in decided)


def test_the_timeline_reading_one_rollout_takes_the_budget_decision_the_materializer_takes(
    tmp_path: Path,
) -> None:
    topic, _ = budget_log()
    materialized = tmp_path / "materialized"
    materialize(topic, materialized, limits=LIMITS)
    for rollout_id in ("r-a", "r-b", "r-c"):
        router = InboundRouter(limits=LIMITS)
        one = LogApplier(TokenCaptureStore(tmp_path / rollout_id), TOPIC, router)
        for message in topic.messages():
            if message.key() == rollout_id.encode():
                one.take_all(message.as_log_message())
            else:
                one.pass_over(message.as_log_message())
        assert rollout_files(tmp_path / rollout_id) == rollout_files(materialized, rollout_id), rollout_id
        assert one.unfinished_groups() == []


def test_a_freeze_of_another_rollout_frees_its_groups_bytes_for_a_timeline_reading_one_rollout(
    tmp_path: Path,
) -> None:
    # r-c's group is the oldest; r-a's group is abandoned by r-a's freeze, so r-b's chunks fit beside r-c's.
    events = {rollout_id: put_of(rollout_id) for rollout_id in ("r-a", "r-b", "r-c")}
    a, b, c = (chunks(events[rid], session) for rid, session in (("r-a", "wa"), ("r-b", "wb"), ("r-c", "wc")))
    topic = MemoryTopic(TOPIC)
    for message in [c[0], a[0], a[1]]:
        topic.produce(message.key, message.value, message.headers)
    topic.publish(FreezeEvent(rollout_id="r-a"))
    for message in [b[0], b[1], b[2], c[1], c[2]]:
        topic.produce(message.key, message.value, message.headers)
    materialized = tmp_path / "materialized"
    materialize(topic, materialized, limits=LIMITS)
    assert TokenCaptureStore(materialized).read_entries("r-c") == [events["r-c"].entry]
    router = InboundRouter(limits=LIMITS)
    one = LogApplier(TokenCaptureStore(tmp_path / "r-c"), TOPIC, router)
    for message in topic.messages():
        if message.key() == b"r-c":
            one.take_all(message.as_log_message())
        else:
            one.pass_over(message.as_log_message())
    assert rollout_files(tmp_path / "r-c") == rollout_files(materialized, "r-c")


def test_a_materializer_resumed_with_open_groups_counts_their_bytes_and_ends_as_a_clean_run(
    tmp_path: Path,
) -> None:
    topic, _ = budget_log()
    clean = tmp_path / "clean"
    materialize(topic, clean, limits=LIMITS)

    resumed = tmp_path / "resumed"
    head = MemoryTopic(TOPIC)
    for message in topic.messages()[:4]:  # a0 b0 c0 a1: three groups open, at the budget
        head.produce(message.key(), message.value(), message.headers())
    materialize(head, resumed, limits=LIMITS)
    for message in topic.messages()[4:]:
        head.produce(message.key(), message.value(), message.headers())
    materialize(head, resumed, limits=LIMITS)
    assert rollout_files(resumed) == rollout_files(clean)
    assert TokenCaptureStore(resumed).is_incomplete("r-a")


# ------------------------------------------------------------------ settings and the sinks


def test_limits_that_could_never_reassemble_an_event_of_the_largest_size_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_open_chunk_bytes"):
        TopicLimits(max_event_bytes=10_000, max_open_chunk_bytes=9_999)
    with pytest.raises(ConfigError, match="max_event_bytes"):
        KafkaStagingSink(bootstrap_servers="127.0.0.1:1", run_id="r", chunk_bytes=4096, max_event_bytes=4095)
    with pytest.raises(ConfigError, match="max_event_bytes"):
        KafkaTokenSink(bootstrap_servers="127.0.0.1:1", topic="t", chunk_bytes=4096, max_event_bytes=4095)
    assert TOPIC_DEFAULTS.max_event_bytes >= 256 * 1024 * 1024 > DEFAULT_CHUNK_BYTES
    assert TOPIC_DEFAULTS.max_open_chunk_bytes >= TOPIC_DEFAULTS.max_event_bytes


def test_encoding_an_event_over_the_limit_raises_with_its_size_and_the_limit() -> None:
    event = put_of("r-big", tokens=3000)
    size = len(encode_event_value(event)[1])
    assert (
        len(encode_event_messages(event, chunk_bytes=CHUNK, limits=TopicLimits(size), next_chunk_group=str))
        > 1
    )
    with pytest.raises(EventTooLargeError) as raised:
        encode_event_messages(event, chunk_bytes=CHUNK, limits=TopicLimits(size - 1), next_chunk_group=str)
    assert f"is {size:,} bytes encoded" in str(raised.value)
    assert f"maximum event size of {size - 1:,} bytes" in str(raised.value)
    assert (raised.value.rollout_id, raised.value.model_call_id) == ("r-big", "c1")
