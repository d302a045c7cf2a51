"""Where a run topic's staged calls really lie, read back from the broker by their message headers.

On a topic made with a staged-payload topic, each stage is a ``staged-ref`` message on the run topic and its
bytes are pieces on ``tokcap-staged.<topic>``; on an older topic, each stage carries its bytes on the run
topic itself. Readers restore both the same way, so a test that stages through a topic made with payloads
apart asserts with these helpers that they really went apart: otherwise it would pass just as well on the
inline layout and prove nothing about the production one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from transports.kafka.client.topics import staged_payload_topic_for
from transports.kafka.wire.codec import (
    ENCODING_STAGED_REFERENCE,
    HEADER_ENCODING,
    HEADER_TYPE,
    headers_to_dict,
)
from transports.kafka.wire.staged_payloads import (
    HEADER_PAYLOAD_DIGEST,
    PAYLOAD_TYPE,
    StagedReference,
    decode_reference,
)

__all__ = ["StagedLayout", "keys_staged_apart", "read_staged_layout", "stage_messages_inline"]

_EMPTY_POLLS_ALLOWED = 60
"""Polls of a second that may return nothing before a read below its end marks fails instead of hanging."""


@dataclass(frozen=True)
class _Message:
    partition: int
    offset: int
    headers: dict[str, str]
    value: bytes


@dataclass(frozen=True)
class StagedLayout:
    """What a run topic and its staged-payload topic hold of the stages sent to them."""

    references: list[StagedReference]
    """The ``staged-ref`` stage messages of the run topic, in partition and offset order."""

    inline_stage_messages: int
    """Stage messages (whole, or chunks of one) that carry their bytes on the run topic itself."""

    payload_topic_exists: bool
    pieces: dict[tuple[int, int], str]
    """The payload topic's pieces by (partition, offset), each with the digest of the value it is part of."""


def _messages(bootstrap: str, topic: str) -> list[_Message] | None:
    """Every message of the topic from its start to its end now; ``None`` when the broker has no such topic."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"tokcap-test-layout-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "allow.auto.create.topics": False,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or (
            metadata.error is not None and metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        ):
            return None
        assert metadata.error is None, f"metadata of {topic!r}: {metadata.error}"
        ends = {
            partition: consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)[1]
            for partition in metadata.partitions
        }
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING) for partition in ends])
        read: list[_Message] = []
        reached = {partition: end == 0 for partition, end in ends.items()}
        empty_polls = 0
        while not all(reached.values()):
            batch = consumer.consume(500, 1.0)
            empty_polls = 0 if batch else empty_polls + 1
            assert empty_polls < _EMPTY_POLLS_ALLOWED, f"{topic!r} stopped short of its end marks {ends}"
            for message in batch:
                assert message.error() is None, message.error()
                partition, offset = int(message.partition() or 0), int(message.offset() or 0)
                if offset >= ends[partition]:
                    continue
                read.append(
                    _Message(partition, offset, headers_to_dict(message.headers()), message.value() or b"")
                )
                reached[partition] = reached[partition] or offset == ends[partition] - 1
        return sorted(read, key=lambda message: (message.partition, message.offset))
    finally:
        consumer.close()


def read_staged_layout(bootstrap: str, topic: str) -> StagedLayout:
    """Read both topics through to their ends and sort the stage messages by how they carry their bytes."""
    run_messages = _messages(bootstrap, topic)
    assert run_messages is not None, f"the run topic {topic!r} does not exist"
    stages = [message for message in run_messages if message.headers.get(HEADER_TYPE) == "stage"]
    references = [
        decode_reference(message.value)
        for message in stages
        if message.headers.get(HEADER_ENCODING) == ENCODING_STAGED_REFERENCE
    ]
    payload_topic = staged_payload_topic_for(topic)
    payload_messages = None if payload_topic is None else _messages(bootstrap, payload_topic)
    pieces = {
        (message.partition, message.offset): message.headers.get(HEADER_PAYLOAD_DIGEST, "")
        for message in payload_messages or []
        if message.headers.get(HEADER_TYPE) == PAYLOAD_TYPE
    }
    return StagedLayout(
        references=references,
        inline_stage_messages=len(stages) - len(references),
        payload_topic_exists=payload_messages is not None,
        pieces=pieces,
    )


def keys_staged_apart(bootstrap: str, topic: str) -> set[str]:
    """The staging keys the run topic refers to, once it is sure every stage there went apart.

    Fails when any stage carries its bytes on the run topic, when there is no reference at all, or when a
    reference names another topic or a piece the payload topic does not hold with the reference's digest.
    """
    layout = read_staged_layout(bootstrap, topic)
    assert layout.inline_stage_messages == 0, (
        f"{layout.inline_stage_messages} stage messages carry their bytes inline on {topic!r}: the stages "
        "did not go to a staged-payload topic"
    )
    assert layout.references, f"{topic!r} holds no staged-ref message: nothing was staged apart"
    payload_topic = staged_payload_topic_for(topic)
    for reference in layout.references:
        assert reference.topic == payload_topic, reference
        held = [layout.pieces.get((reference.partition, offset)) for offset in reference.offsets]
        assert held == [reference.sha256] * len(reference.offsets), (reference, held)
    return {reference.staging_key for reference in layout.references}


def stage_messages_inline(bootstrap: str, topic: str) -> int:
    """How many stage messages carry their bytes on the run topic, once it is sure none went apart."""
    layout = read_staged_layout(bootstrap, topic)
    assert layout.references == [], f"{topic!r} refers to {len(layout.references)} stages on a payload topic"
    assert not layout.payload_topic_exists, f"{topic!r} has a staged-payload topic"
    return layout.inline_stage_messages
