"""Inbound routing, through the real materializer loop over an in-memory topic, and the timeline agreeing with it.

Every message becomes exactly one of: an applied event, a buffered chunk, or a dead letter that masks the
rollout its key names. `tokcap log`/`tokcap replay` route through the same router, so their store ends
identical to the materializer's.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from kafka_topic_double import MemoryTopic, materialize
from store_contract import make_entry

from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import (
    EVENT_SCHEMA_VERSION,
    DeleteEvent,
    FreezeEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    encode_event,
)
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path
from transports.kafka.materializer.dead_letters import DeadLetterLine, dead_letter_path
from transports.kafka.timeline import BUFFERED, DEAD_LETTERED, LogApplier
from transports.kafka.wire.codec import LogMessage, OutgoingMessage, encode_event_messages
from transports.kafka.wire.router import ApplyEvent, DeadLetter, InboundRouter
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS

TOPIC = "tokcap.routing-test"


def dead_letters(directory: Path) -> list[dict[str, object]]:
    path = dead_letter_path(directory, 0)
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def rollout_files(directory: Path, rollout_id: str | None = None) -> dict[str, bytes]:
    """The store's own files (not the materializer's, not locks), optionally of one rollout."""
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if not path.name.startswith("kafka-")
        and not path.name.endswith(".lock")
        and (rollout_id is None or path.name.startswith(f"{rollout_id}."))
    }


def chunks_of(rollout_id: str, call_id: str, session: str, sequence: int = 0) -> list[OutgoingMessage]:
    """A put large enough for three or more 2 KiB chunks, from writer session ``session``."""
    event = PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, tokens=1200))
    messages = encode_event_messages(
        event, chunk_bytes=2048, next_chunk_group=lambda: f"{session}:{sequence}"
    )
    assert len(messages) >= 3
    return messages


def produce(topic: MemoryTopic, messages: list[OutgoingMessage]) -> list[int]:
    return [topic.produce(m.key, m.value, m.headers) for m in messages]


def test_a_chunked_put_is_applied_at_its_last_chunk_and_an_open_group_survives_a_restart(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    messages = chunks_of("r1", "c1", "w")
    produce(topic, messages[:2])
    materialize(topic, tmp_path)
    checkpoint = PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0)
    assert (checkpoint.next_offset, checkpoint.pending_chunk_offsets) == (2, [0, 1])
    assert TokenCaptureStore(tmp_path).read_entries("r1") == []

    produce(topic, messages[2:])
    materialize(topic, tmp_path)
    assert TokenCaptureStore(tmp_path).read_entries("r1") == [make_entry("r1", "c1", tokens=1200)]
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0).pending_chunk_offsets == []
    assert dead_letters(tmp_path) == []


def test_a_batch_that_reads_nothing_of_a_partition_keeps_that_partitions_open_chunk_groups(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC, partitions=2)
    messages = chunks_of("r1", "c1", "w")
    for message in messages[:2]:
        topic.produce(message.key, message.value, message.headers, partition=1)
    materialize(topic, tmp_path)
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 1).pending_chunk_offsets == [0, 1]

    # A restart whose first batch holds one message of partition 0 and none of partition 1.
    topic.publish(IntentEvent(rollout_id="r0", model_call_id="c0"), partition=0)
    topic.allowance = 1
    materializer = Materializer(
        "memory",
        TOPIC,
        tmp_path,
        consumer_factory=topic.consumer,
        topic_id_reader=topic.topic_id,
        limits_reader=lambda: TOPIC_DEFAULTS,  # reading the limits would spend the allowed message
    )
    materializer.start()
    try:
        assert materializer.wait_for(0, 0, 60)
    finally:
        materializer.stop()
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 0).next_offset == 1
    assert PartitionCheckpoint.of_directory(tmp_path, TOPIC, 1).pending_chunk_offsets == [0, 1]

    topic.allowance = None
    for message in messages[2:]:
        topic.produce(message.key, message.value, message.headers, partition=1)
    materialize(topic, tmp_path)
    assert TokenCaptureStore(tmp_path).read_entries("r1") == [make_entry("r1", "c1", tokens=1200)]
    assert dead_letters(tmp_path) == []


def test_a_writer_starting_a_new_chunk_group_abandons_its_open_one_and_masks_that_rollout(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    produce(topic, chunks_of("r1", "c1", "w", 0)[:2])
    produce(topic, chunks_of("r2", "c1", "w", 1))
    materialize(topic, tmp_path)
    store = TokenCaptureStore(tmp_path)
    (line,) = dead_letters(tmp_path)
    assert (line["offset"], line["rollout_id"]) == (0, "r1")
    assert "a new chunk group w:1 of the same writer began" in str(line["reason"])
    assert store.is_incomplete("r1") and store.read_entries("r1") == []
    assert not store.is_incomplete("r2") and len(store.read_entries("r2")) == 1


def test_a_chunk_that_does_not_continue_its_group_abandons_the_group_and_is_dead_lettered(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    messages = chunks_of("r1", "c1", "w")
    produce(topic, [messages[0], messages[2]])
    materialize(topic, tmp_path)
    lines = dead_letters(tmp_path)
    assert [(line["offset"], line["rollout_id"]) for line in lines] == [(0, "r1"), (1, "r1")]
    assert "does not continue it" in str(lines[0]["reason"])
    assert "chunk 2/" in str(lines[1]["reason"])
    assert TokenCaptureStore(tmp_path).is_incomplete("r1")


def test_a_group_whose_bytes_do_not_match_their_digest_is_dead_lettered_at_its_last_chunk(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    messages = chunks_of("r1", "c1", "w")
    last = messages[-1]
    tampered = OutgoingMessage(last.key, last.value[:-1] + bytes([last.value[-1] ^ 1]), last.headers)
    offsets = produce(topic, [*messages[:-1], tampered])
    materialize(topic, tmp_path)
    (line,) = dead_letters(tmp_path)
    assert line["offset"] == offsets[-1] and "different digest" in str(line["reason"])
    assert TokenCaptureStore(tmp_path).read_entries("r1") == []


POISON = [
    pytest.param(b"r-garbage", b"\x00not json", [], "not valid JSON", "r-garbage", id="garbage"),
    pytest.param(
        b"r-unknown",
        orjson.dumps({"schema_version": 1, "type": "teleport", "rollout_id": "r-unknown"}),
        [],
        "unknown event type",
        "r-unknown",
        id="unknown-type",
    ),
    pytest.param(
        b"r-newer",
        encode_event(FreezeEvent(rollout_id="r-newer")),
        [("tokcap.schema_version", str(EVENT_SCHEMA_VERSION + 1).encode())],
        "newer schema",
        "r-newer",
        id="newer-schema",
    ),
    pytest.param(b"r-empty", None, [], "message has no value", "r-empty", id="no-value"),
    pytest.param(
        b"r-key",
        encode_event(FreezeEvent(rollout_id="r-other")),
        [],
        "does not match the event's rollout 'r-other'",
        "r-key",
        id="key-mismatch",
    ),
    pytest.param(b"../escape", b"{}", [], "undecodable event", None, id="invalid-key"),
    pytest.param(
        b"r-header", b"{}", [("tokcap.type", b"\xff")], "undecodable headers", "r-header", id="header"
    ),
    pytest.param(
        b"r-partial",
        b"{}",
        [("tokcap.chunk.group", b"g:1")],
        "chunk headers are incomplete",
        "r-partial",
        id="partial-chunk-headers",
    ),
    pytest.param(
        b"r-orphan",
        b"half",
        [
            ("tokcap.chunk.group", b"ghost:1"),
            ("tokcap.chunk.index", b"1"),
            ("tokcap.chunk.count", b"3"),
            ("tokcap.chunk.sha256", b"00"),
        ],
        "orphaned chunk 1/3",
        "r-orphan",
        id="orphaned-chunk",
    ),
]


@pytest.mark.parametrize(("key", "value", "headers", "reason", "masked"), POISON)
def test_a_message_that_cannot_be_applied_is_dead_lettered_masks_its_keys_rollout_and_reading_goes_on(
    tmp_path: Path,
    key: bytes,
    value: bytes | None,
    headers: list[tuple[str, bytes]],
    reason: str,
    masked: str | None,
) -> None:
    topic = MemoryTopic(TOPIC)
    topic.produce(key, value, headers)
    topic.publish(PutEvent(rollout_id="r-healthy", entry=make_entry("r-healthy", "c1")))
    materialize(topic, tmp_path)
    (line,) = dead_letters(tmp_path)
    assert (line["partition"], line["offset"], line["rollout_id"]) == (0, 0, masked)
    assert reason in str(line["reason"])
    store = TokenCaptureStore(tmp_path)
    assert {rid for rid in store.rollout_ids() if store.is_incomplete(rid)} == ({masked} if masked else set())
    assert not (tmp_path / "r-other.tokens.state.json").exists()
    assert len(store.read_entries("r-healthy")) == 1


def test_a_group_still_open_that_many_offsets_after_its_first_chunk_is_abandoned() -> None:
    router = InboundRouter(orphan_after_offsets=3)
    messages = chunks_of("r1", "c1", "w")[:1] + [
        OutgoingMessage(b"r2", encode_event(IntentEvent(rollout_id="r2", model_call_id=f"c{i}")), [])
        for i in range(3)
    ]
    routed = [
        router.route(LogMessage(0, offset, None, m.key, tuple(m.headers), m.value))
        for offset, m in enumerate(messages)
    ]
    assert [len(r) for r in routed[:3]] == [1, 1, 1]
    abandoned = routed[3][-1]
    assert isinstance(abandoned, DeadLetter) and abandoned.abandoned
    assert (abandoned.offset, abandoned.rollout_id) == (0, "r1")
    assert "still open 3 offsets later" in abandoned.reason
    assert router.open_groups() == []


def mixed_log() -> MemoryTopic:
    """Every routing case on three rollouts, interleaved, with healthy traffic around them."""
    topic = MemoryTopic(TOPIC)
    topic.publish(IntentEvent(rollout_id="r1", model_call_id="c0"))
    produce(topic, chunks_of("r1", "c1", "w", 0)[:2])
    topic.publish(PutEvent(rollout_id="r2", entry=make_entry("r2", "small")))
    produce(topic, chunks_of("r2", "big", "w", 1))
    topic.produce(b"r3", b"\x00not json")
    topic.produce(b"r3", encode_event(FreezeEvent(rollout_id="r1")))
    topic.publish(PutEvent(rollout_id="r1", entry=make_entry("r1", "c0")))
    produce(topic, chunks_of("r3", "big", "v", 0))
    for rollout_id in ("r1", "r2", "r3"):
        topic.publish(FreezeEvent(rollout_id=rollout_id))
    return topic


def test_the_timeline_ends_with_the_store_the_materializer_builds_whether_it_reads_all_or_one_rollout(
    tmp_path: Path,
) -> None:
    topic = mixed_log()
    materialized = tmp_path / "materialized"
    materialize(topic, materialized)
    expected = rollout_files(materialized)
    assert TokenCaptureStore(materialized).is_incomplete("r1")

    whole = LogApplier(TokenCaptureStore(tmp_path / "whole"), TOPIC)
    entries = [entry for m in topic.messages() for entry in whole.take_all(m.as_log_message())]
    assert rollout_files(tmp_path / "whole") == expected
    assert [e.offset for e in entries if e.decision == DEAD_LETTERED] == [
        line["offset"] for line in dead_letters(materialized)
    ]

    for rollout_id in ("r1", "r2", "r3"):
        one = LogApplier(TokenCaptureStore(tmp_path / rollout_id), TOPIC)
        for message in topic.messages():
            log_message = message.as_log_message()
            if message.key() == rollout_id.encode():
                one.take_all(log_message)
            else:
                one.pass_over(log_message)
        assert rollout_files(tmp_path / rollout_id) == rollout_files(materialized, rollout_id), rollout_id
        assert one.unfinished_groups() == []


def test_the_timeline_shows_a_buffered_chunk_and_the_abandoned_group_of_its_rollout(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    produce(topic, chunks_of("r1", "c1", "w", 0)[:1])
    produce(topic, chunks_of("r2", "c1", "w", 1)[:1])
    applier = LogApplier(TokenCaptureStore(tmp_path), TOPIC)
    first, second = (m.as_log_message() for m in topic.messages())
    assert applier.take(first).decision == BUFFERED
    (abandoned,) = applier.pass_over(second)
    assert (abandoned.offset, abandoned.decision) == (0, DEAD_LETTERED)
    assert applier.abandoned == [abandoned]
    assert applier.store.is_incomplete("r1")


def test_a_materializer_resumed_from_an_older_checkpoint_writes_nothing_twice(tmp_path: Path) -> None:
    topic = mixed_log()
    materialize(topic, tmp_path / "clean")
    resumed = tmp_path / "resumed"
    materialize(topic, resumed)
    checkpoint_path(resumed, 0).write_bytes(PartitionCheckpoint(TOPIC, 0).encode())
    materialize(topic, resumed)
    clean = {p.name: p.read_bytes() for p in sorted((tmp_path / "clean").iterdir())}
    assert {p.name: p.read_bytes() for p in sorted(resumed.iterdir())} == clean


def frozen_while_open_log() -> MemoryTopic:
    """r1's head chunk, r1 frozen, the rest of its chunks after the cut; r2's group stays open across it."""
    topic = MemoryTopic(TOPIC)
    r1 = chunks_of("r1", "c1", "w", 0)
    r2 = chunks_of("r2", "c1", "v", 0)
    produce(topic, r1[:1] + r2[:1])
    topic.publish(FreezeEvent(rollout_id="r1"))
    produce(topic, r1[1:] + r2[1:])
    return topic


def test_a_freeze_while_a_chunk_group_of_its_rollout_is_open_answers_an_incomplete_snapshot(
    tmp_path: Path,
) -> None:
    topic = frozen_while_open_log()
    materialize(topic, tmp_path)
    store = TokenCaptureStore(tmp_path)
    (answer,) = store.read_state("r1").freeze_answers
    assert answer.incomplete and store.read_entries("r1") == []
    lines = dead_letters(tmp_path)
    assert (lines[0]["offset"], lines[0]["rollout_id"]) == (0, "r1")
    assert "its rollout was frozen at offset 2 first" in str(lines[0]["reason"])
    assert all("orphaned chunk" in str(line["reason"]) for line in lines[1:])
    assert [line["rollout_id"] for line in lines] == ["r1"] * len(lines)
    assert not store.is_incomplete("r2") and len(store.read_entries("r2")) == 1


def test_a_freeze_abandons_the_open_group_in_the_timeline_as_in_the_materializer(tmp_path: Path) -> None:
    topic = frozen_while_open_log()
    materialize(topic, tmp_path / "materialized")
    one = LogApplier(TokenCaptureStore(tmp_path / "r1"), TOPIC)
    for message in topic.messages():
        if message.key() == b"r1":
            one.take_all(message.as_log_message())
        else:
            one.pass_over(message.as_log_message())
    assert rollout_files(tmp_path / "r1") == rollout_files(tmp_path / "materialized", "r1")
    assert [entry.offset for entry in one.abandoned] == [0]


def test_a_materializer_resumed_at_any_checkpoint_around_a_freeze_that_abandoned_a_group_ends_identical(
    tmp_path: Path,
) -> None:
    topic = frozen_while_open_log()
    # The rollout id is deleted and reused after the abandoning freeze: a resume that decides the
    # abandonment again must not mask the new rollout.
    topic.publish(DeleteEvent(rollout_id="r1"))
    topic.publish(PutEvent(rollout_id="r1", entry=make_entry("r1", "again")))
    materialize(topic, tmp_path / "clean")
    clean = {p.name: p.read_bytes() for p in sorted((tmp_path / "clean").iterdir())}
    assert not TokenCaptureStore(tmp_path / "clean").is_incomplete("r1")
    for name, checkpoint in {
        "start": PartitionCheckpoint(TOPIC, 0),
        "head-chunks-read": PartitionCheckpoint(TOPIC, 0, next_offset=2, pending_chunk_offsets=[0, 1]),
    }.items():
        resumed = tmp_path / name
        materialize(topic, resumed)
        checkpoint_path(resumed, 0).write_bytes(checkpoint.encode())
        materialize(topic, resumed)
        assert {p.name: p.read_bytes() for p in sorted(resumed.iterdir())} == clean, name


def test_the_materializer_reports_each_dead_letter_once_as_it_writes_it(tmp_path: Path) -> None:
    topic = frozen_while_open_log()
    reported: list[DeadLetterLine] = []
    for _ in range(2):
        materializer = Materializer(
            "memory",
            TOPIC,
            tmp_path,
            consumer_factory=topic.consumer,
            topic_id_reader=topic.topic_id,
            on_dead_letter=reported.append,
        )
        materializer.start()
        try:
            assert materializer.wait_until_caught_up(60)
        finally:
            materializer.stop()
    written = dead_letters(tmp_path)
    assert [(line.partition, line.offset, line.rollout_id) for line in reported] == [
        (line["partition"], line["offset"], line["rollout_id"]) for line in written
    ]
    assert reported[0].describe().startswith("partition 0 offset 0 rollout r1: orphaned chunk group w:0")


def test_an_abandoned_groups_mask_is_decided_at_the_freezes_offset_before_the_freeze() -> None:
    router = InboundRouter()
    decided = {
        message.offset(): router.route(message.as_log_message())
        for message in frozen_while_open_log().messages()
    }
    mask, freeze = decided[2]
    assert isinstance(mask, DeadLetter) and mask.abandoned and mask.offset == 0
    assert isinstance(freeze, ApplyEvent) and isinstance(freeze.event, FreezeEvent)
    assert (mask.position(TOPIC), freeze.position(TOPIC)) == (
        LogPosition(TOPIC, 0, 2, 0),
        LogPosition(TOPIC, 0, 2, 1),
    )


def test_decisions_about_another_rollout_in_the_same_message_keep_their_own_index() -> None:
    router = InboundRouter(orphan_after_offsets=2)
    messages = chunks_of("r1", "c1", "w")[:1] + [
        OutgoingMessage(b"r2", encode_event(FreezeEvent(rollout_id="r2")), []) for _ in range(2)
    ]
    *_, last = [
        router.route(LogMessage(0, offset, None, m.key, tuple(m.headers), m.value))
        for offset, m in enumerate(messages)
    ]
    freeze, abandoned = last
    assert isinstance(freeze, ApplyEvent) and isinstance(abandoned, DeadLetter)
    assert (freeze.position(TOPIC), abandoned.position(TOPIC)) == (
        LogPosition(TOPIC, 0, 2, 0),
        LogPosition(TOPIC, 0, 2, 0),
    )
