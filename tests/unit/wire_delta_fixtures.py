"""A real ``KafkaTokenSink`` writing into the in-memory topic double, and multi-turn rollouts to send.

The sink's producer is swapped for a bridge that appends to a ``MemoryTopic`` and acknowledges with the
offset it got, so the sink's own encoding decisions (full put or wire delta) are what the tests read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from conversations import conversation
from kafka_topic_double import MemoryTopic

from tokcap.errors import DeliveryError
from transports.kafka import KafkaTokenSink
from transports.kafka.client.clients import ClientContext
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.producer_bridge import Delivered
from transports.kafka.wire.codec import HEADER_ENCODING, OutgoingMessage

__all__ = ["TopicBridge", "conversation", "delta_offsets", "memory_sink", "store_files"]


class TopicBridge:
    """Stands in for ``ProducerBridge``: appends to the double's topic; ``fail_next`` refuses one send."""

    delivery_timeout_s = 1.0

    def __init__(self, topic: MemoryTopic) -> None:
        self.topic = topic
        self.fail_next = False
        self.hold: asyncio.Event | None = None
        """While set to an unset event, sends are in the log but not acknowledged until it is set."""

    async def send(self, topic: str, messages: Sequence[OutgoingMessage], *, what: str) -> list[Delivered]:
        if self.fail_next:
            self.fail_next = False
            raise DeliveryError(f"{what} refused by the test bridge")
        delivered = []
        for message in messages:
            partition = message.partition
            if partition is None:
                partition = sum(message.key) % len(self.topic.partitions)
            offset = self.topic.produce(message.key, message.value, message.headers, partition)
            delivered.append(Delivered(partition, offset))
        if self.hold is not None:
            await self.hold.wait()
        return delivered

    def close(self, timeout_s: float | None = None) -> int:
        return 0


def memory_sink(topic: MemoryTopic, spill_dir: Path, **kwargs: object) -> tuple[KafkaTokenSink, TopicBridge]:
    """A sink whose sends land in ``topic``."""
    sink = KafkaTokenSink(
        bootstrap_servers="127.0.0.1:1",
        topic=topic.name,
        spill_dir=spill_dir,
        **kwargs,  # type: ignore[arg-type]
    )
    sink._bridge.close(0)
    bridge = TopicBridge(topic)
    sink._bridge = bridge  # type: ignore[assignment]
    # The sink reads the topic's limits from the double's log, as it would from the broker's.
    sink._limits._read = lambda: read_topic_limits(  # type: ignore[assignment]
        ClientContext("memory", {}), topic.name, factory=topic.consumer
    )
    return sink, bridge


def delta_offsets(topic: MemoryTopic, partition: int = 0) -> list[int]:
    """Offsets of the wire deltas in a partition."""
    return [m.offset_ for m in topic.messages(partition) if (HEADER_ENCODING, b"delta") in (m.headers_ or [])]


def store_files(directory: Path) -> dict[str, bytes]:
    """The store's own files (not the materializer's checkpoints and dead letters, not locks)."""
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if path.is_file() and not path.name.startswith("kafka-") and not path.name.endswith(".lock")
    }
