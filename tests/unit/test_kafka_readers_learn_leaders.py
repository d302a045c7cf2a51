"""Readers that assign partitions on a new consumer handle ask for the topic's metadata on that handle.

librdkafka learns the leaders of a topic first assigned on a handle only at its next topic scan, up to a
second later, and fetches nothing until then: the first lineage resolves of a run stalled 0.5-1 s so (the
closed-loop resolve benchmark, ``bench/README.md``). A materializer given its partitions asks no metadata
before assigning them, and its handle may connect first (while it clears a large directory's temporary files).
These tests pin the mechanism with recording fakes; the benchmark measures the effect against a real broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.unit.kafka_topic_double import MemoryTopic, materialize
from tokcap.errors import TransportError
from tokcap.log.events import IntentEvent
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, list_topics
from transports.kafka.client.offset_reader import OffsetReader
from transports.kafka.lineage import KafkaLineageResolver


class _RecordingConsumer:
    """Records the calls a reader makes; refuses the metadata request while ``refuse_metadata`` is set."""

    def __init__(self, messages: list[Any] | None = None) -> None:
        self.calls: list[str] = []
        self.refuse_metadata = False
        self.closed = False
        self._messages = messages or []

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.calls.append("assign " + ",".join(str(p.partition) for p in partitions))

    def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        self.calls.append("unassign " + ",".join(str(p.partition) for p in partitions))

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.calls.append("assign " + ",".join(str(p.partition) for p in partitions))

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> object:
        self.calls.append(f"metadata {topic}")
        if self.refuse_metadata:
            raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
        return object()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        self.calls.append("consume")
        return list(self._messages)

    def poll(self, timeout: float = 0) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def resolver() -> Iterator[KafkaLineageResolver]:
    made = KafkaLineageResolver(bootstrap_servers="127.0.0.1:9", topic="leaders")
    made._reader._consumer.close()
    yield made
    asyncio.run(made.close())


def _read_once(resolver: KafkaLineageResolver, *partitions: int) -> None:
    resolver._reader._unassigned.update(dict.fromkeys(partitions, 0))
    with resolver._lock:
        resolver._reader._read_once(0.0)


def test_the_lineage_reader_asks_its_own_handle_for_the_topic_after_assigning_it_new_partitions(
    resolver: KafkaLineageResolver,
) -> None:
    reading = _RecordingConsumer()
    resolver._reader._consumer = reading  # type: ignore[assignment]
    _read_once(resolver, 0)
    _read_once(resolver, 1)
    _read_once(resolver)
    assert reading.calls == [
        "assign 0",
        "metadata leaders",
        "consume",
        "assign 1",
        "metadata leaders",
        "consume",
        "consume",
    ]


def test_a_refused_metadata_request_fails_the_resolve_and_the_next_read_assigns_and_asks_again(
    resolver: KafkaLineageResolver,
) -> None:
    reading = _RecordingConsumer()
    reading.refuse_metadata = True
    resolver._reader._consumer = reading  # type: ignore[assignment]
    with pytest.raises(TransportError):
        _read_once(resolver, 0)
    reading.refuse_metadata = False
    _read_once(resolver)
    assert reading.calls == [
        "assign 0",
        "metadata leaders",
        "unassign 0",
        "assign 0",
        "metadata leaders",
        "consume",
    ]


class _EndOfPartition:
    def error(self) -> KafkaError:
        return KafkaError(KafkaError._PARTITION_EOF)


def test_the_parent_reader_asks_a_new_handle_for_the_topic_after_its_first_assignment_only() -> None:
    opened: list[_RecordingConsumer] = []

    def open_consumer(settings: dict[str, Any]) -> Any:
        opened.append(_RecordingConsumer([_EndOfPartition()]))
        return opened[-1]

    reader = OffsetReader(ClientContext("127.0.0.1:1"), "leaders", factory=open_consumer, timeout_s=5.0)
    assert reader.read(0, 3) is None
    assert reader.read(1, 4) is None
    assert len(opened) == 1
    assert opened[0].calls == [
        "assign 0",
        "metadata leaders",
        "consume",
        "assign ",
        "assign 1",
        "consume",
        "assign ",
    ]


def test_a_parent_reader_that_cannot_learn_the_leaders_fails_and_opens_a_new_handle_next_time() -> None:
    opened: list[_RecordingConsumer] = []

    def open_consumer(settings: dict[str, Any]) -> Any:
        opened.append(_RecordingConsumer([_EndOfPartition()]))
        opened[-1].refuse_metadata = len(opened) == 1
        return opened[-1]

    reader = OffsetReader(ClientContext("127.0.0.1:1"), "leaders", factory=open_consumer, timeout_s=5.0)
    with pytest.raises(TransportError, match=r"metadata of 'leaders'.*TOPIC_AUTHORIZATION_FAILED"):
        reader.read(0, 3)
    assert opened[0].closed
    assert reader.read(0, 3) is None
    assert len(opened) == 2 and opened[1].calls[:2] == ["assign 0", "metadata leaders"]


@pytest.mark.parametrize("partitions", [None, [1]])
def test_the_materializer_asks_its_handle_for_the_topic_after_assigning_its_partitions(
    partitions: list[int] | None, tmp_path: Any
) -> None:
    topic = MemoryTopic("leaders", partitions=2)
    topic.publish(IntentEvent(rollout_id="r", model_call_id="c"), partition=1)
    materialize(topic, tmp_path, partitions=partitions)
    requests = topic.consumers[0].requests
    assigned = requests.index(next(request for request in requests if request.startswith("assign")))
    assert requests[assigned + 1] == "metadata leaders", requests


class _SlowMetadataConsumer:
    """A consumer with a fetched message waiting, whose first metadata slice times out (a fetch in flight)."""

    def __init__(self, *, assigned: bool) -> None:
        self.assigned = assigned
        self.slices = 0
        self.timeouts: list[float] = []
        self.waiting = ["fetched message"]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("leaders", 0)] if self.assigned else []

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> object:
        self.slices += 1
        self.timeouts.append(timeout)
        if self.slices == 1:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return object()

    def poll(self, timeout: float = -1) -> object:
        return self.waiting.pop() if self.waiting else None


def test_a_retried_metadata_wait_takes_no_message_from_a_reader_with_partitions_assigned() -> None:
    # A consumer's poll hands out the next fetched message: taken here, it is lost to the reader, whose read of
    # the log then stalls (the last message of a partition) or misses it (an earlier one).
    consumer = _SlowMetadataConsumer(assigned=True)
    context = ClientContext("127.0.0.1:1")
    list_topics(consumer, AuthenticationWatch(context), context, 5.0, "leaders")  # type: ignore[arg-type]
    assert consumer.slices == 2
    assert consumer.waiting == ["fetched message"]


def test_a_retried_metadata_wait_serves_the_callbacks_of_a_consumer_with_nothing_assigned() -> None:
    # Nothing is fetched before an assignment, so polling takes no message and lets a refused login end the wait.
    consumer = _SlowMetadataConsumer(assigned=False)
    consumer.waiting = []
    polled: list[float] = []
    consumer.poll = lambda timeout=-1: polled.append(timeout)  # type: ignore[method-assign]
    context = ClientContext("127.0.0.1:1")
    list_topics(consumer, AuthenticationWatch(context), context, 5.0, "leaders")  # type: ignore[arg-type]
    assert polled == [0]


def test_a_reader_with_partitions_assigned_asks_for_the_metadata_once_for_the_whole_wait() -> None:
    # Its request waits behind a fetch in flight (up to fetch.wait.max.ms, 500 ms by default): half-second
    # slices would time out one after the other.
    consumer = _SlowMetadataConsumer(assigned=True)
    consumer.slices = 1  # answers the first request
    context = ClientContext("127.0.0.1:1")
    list_topics(consumer, AuthenticationWatch(context), context, 5.0, "leaders")  # type: ignore[arg-type]
    assert len(consumer.timeouts) == 1 and consumer.timeouts[0] > 4.5
