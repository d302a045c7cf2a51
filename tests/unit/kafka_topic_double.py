"""An in-memory run topic with just enough of confluent-kafka's consumer for the materializer loop.

Routing (chunks, stale chunks, key checks, undecodable and newer-schema messages, dead letters, masking)
is tested through the real materializer with this double, without a broker; the real-broker tests stay
for everything the broker itself does.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from confluent_kafka import TopicPartition

from tokcap.log.events import Event
from transports.kafka.materializer import Materializer
from transports.kafka.wire.codec import LogMessage, encode_event_messages
from transports.kafka.wire.topic_limits import TopicLimits

Headers = list[tuple[str, bytes]]


@dataclass(frozen=True)
class StoredMessage:
    """One message in the double's log, answering the calls the materializer makes on a consumed message."""

    topic: str
    partition_: int
    offset_: int
    key_: bytes | None
    value_: bytes | None
    headers_: Headers

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_

    def headers(self) -> Headers | None:
        return self.headers_ or None

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_000 + self.offset_)

    def as_log_message(self) -> LogMessage:
        """The message as ``read_log`` yields it, for the timeline's applier."""
        return LogMessage.of(self)  # type: ignore[arg-type]


class MemoryTopic:
    """A topic's partitions as lists; producing wakes consumers waiting for messages."""

    def __init__(self, name: str, partitions: int = 1) -> None:
        self.name = name
        self.partitions: list[list[StoredMessage]] = [[] for _ in range(partitions)]
        self.changed = threading.Condition()
        self.allowance: int | None = None
        """How many more messages consumers may hand out; ``None`` for no limit. Holds a batch where a test wants it."""
        self._groups = itertools.count()
        self.consumers: list[MemoryConsumer] = []
        """Every consumer handed out, in order, so a test can read what was asked of it."""
        self.id = "memory-topic-id-1"
        """The topic's id as the broker would give it; a test changes it to stand for a topic created again."""

    def topic_id(self) -> str:
        """A ``topic_id_reader`` for ``Materializer``."""
        return self.id

    def produce(
        self, key: bytes | None, value: bytes | None, headers: Headers | None = None, partition: int = 0
    ) -> int:
        """Append one raw message; return its offset."""
        with self.changed:
            log = self.partitions[partition]
            log.append(StoredMessage(self.name, partition, len(log), key, value, list(headers or [])))
            self.changed.notify_all()
            return len(log) - 1

    def publish(
        self, event: Event, *, partition: int = 0, chunk_bytes: int = 900_000, session: str = "s"
    ) -> list[int]:
        """Publish an event as the sink encodes it (chunked above ``chunk_bytes``); return its offsets."""
        messages = encode_event_messages(
            event, chunk_bytes=chunk_bytes, next_chunk_group=lambda: f"{session}:{next(self._groups)}"
        )
        return [self.produce(m.key, m.value, m.headers, partition) for m in messages]

    def wake_consumers(self) -> None:
        """Wake every consumer waiting for a message, so a loop asked to stop need not sit out its poll."""
        with self.changed:
            self.changed.notify_all()

    def messages(self, partition: int = 0) -> list[StoredMessage]:
        with self.changed:
            return list(self.partitions[partition])

    def consumer(self, settings: dict[str, Any]) -> MemoryConsumer:
        """A ``consumer_factory`` for ``Materializer``."""
        self.consumers.append(MemoryConsumer(self))
        return self.consumers[-1]


class MemoryConsumer:
    """Reads assigned partitions from their assigned offsets, in order, as a consumer does."""

    def __init__(self, topic: MemoryTopic) -> None:
        self._topic = topic
        self._positions: dict[int, int] = {}
        self.requests: list[str] = []
        """The metadata requests and assignments made on this consumer, in order."""

    def list_topics(self, topic: str, timeout: float) -> Any:
        self.requests.append(f"metadata {topic}")
        partitions = {p: SimpleNamespace(id=p) for p in range(len(self._topic.partitions))}
        metadata = SimpleNamespace(error=None, partitions=partitions)
        return SimpleNamespace(topics={self._topic.name: metadata} if topic == self._topic.name else {})

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = 1.0, cached: bool = False
    ) -> tuple[int, int]:
        return 0, len(self._topic.messages(partition.partition))

    def assign(self, assignment: Sequence[TopicPartition]) -> None:
        self.requests.append("assign " + ",".join(str(tp.partition) for tp in assignment))
        self._positions = {tp.partition: tp.offset for tp in assignment}

    def consume(self, num_messages: int, timeout: float) -> list[StoredMessage]:
        """Up to ``num_messages`` in partition order; waits up to ``timeout`` for a first one to be produced."""
        with self._topic.changed:
            taken = self._take(num_messages)
            if not taken and timeout > 0:
                self._topic.changed.wait(timeout)
                taken = self._take(num_messages)
        return taken

    def _take(self, limit: int) -> list[StoredMessage]:
        if self._topic.allowance is not None:
            limit = min(limit, self._topic.allowance)
        taken: list[StoredMessage] = []
        for partition, position in sorted(self._positions.items()):
            available = self._topic.partitions[partition][position : position + limit - len(taken)]
            taken.extend(available)
            self._positions[partition] = position + len(available)
        if self._topic.allowance is not None:
            self._topic.allowance -= len(taken)
        return taken

    def close(self) -> None:
        self._positions = {}


def materialize(
    topic: MemoryTopic,
    directory: Path,
    *,
    block_messages: int | None = None,
    partitions: Sequence[int] | None = None,
    limits: TopicLimits | None = None,
) -> Materializer:
    """Run a materializer over everything in the double's topic (or ``partitions``) into ``directory``, then stop it.

    ``limits`` stand for the topic's limits record; without, the materializer reads the double's log for it.
    """
    materializer = Materializer(
        "memory",
        topic.name,
        directory,
        consumer_factory=topic.consumer,
        topic_id_reader=topic.topic_id,
        block_messages=block_messages,
        partitions=partitions,
        limits_reader=None if limits is None else (lambda: limits),
    )
    materializer.start()
    try:
        assert materializer.wait_until_caught_up(60)
    finally:
        materializer.request_stop()
        topic.wake_consumers()
        materializer.stop()
    return materializer
