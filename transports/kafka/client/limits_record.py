"""Read a run topic's limits from its log, and write them there when the topic is made.

``topic_limits`` says what the first message of partition 0 means; this module fetches it. A component reads
the limits once, as it reads the topic's id (``TopicIdReader``): a reader before its first message, a writer
before its first event that needs chunks (``WriterLimits``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from tokcap.errors import DeliveryError, EventDecodeError, EventTooLargeError
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, build_client, open_reader
from transports.kafka.client.error_map import Request, translated
from transports.kafka.client.offset_reader import OffsetReader
from transports.kafka.wire.codec import LogMessage, check_size_settings, headers_to_dict
from transports.kafka.wire.topic_limits import (
    LIMITS_PARTITION,
    TopicLimits,
    check_given,
    encode_limits_record,
    limits_at_start,
    warn_given,
)

__all__ = [
    "TopicLimitsReader",
    "WriterLimits",
    "logger",
    "partition_marks",
    "read_first_message",
    "read_topic_limits",
    "write_limits_record",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def read_first_message(
    context: ClientContext,
    topic: str,
    *,
    watch: AuthenticationWatch | None = None,
    factory: Callable[[dict[str, Any]], Consumer] = Consumer,
    timeout_s: float = 30.0,
) -> LogMessage | None:
    """The message at offset 0 of partition 0, where a limits record counts; ``None`` while there is none.

    Raise ``TransportError`` when the broker does not answer in time: guessing would let a writer send what
    readers refuse.
    """
    watch = watch or AuthenticationWatch(context)
    low, high = partition_marks(
        context, topic, [LIMITS_PARTITION], watch=watch, factory=factory, timeout_s=timeout_s
    )[LIMITS_PARTITION]
    if high <= 0:
        return None
    if low > 0:
        logger.warning(
            "retention removed offset 0 of partition %d of %s, where the topic's limits are recorded; "
            "reading it with the default limits",
            LIMITS_PARTITION,
            topic,
        )
        return None
    reader = OffsetReader(context, topic, purpose="limits", watch=watch, factory=factory, timeout_s=timeout_s)
    try:
        return reader.read(LIMITS_PARTITION, 0)
    finally:
        reader.close()


def partition_marks(
    context: ClientContext,
    topic: str,
    partitions: Iterable[int],
    *,
    watch: AuthenticationWatch | None = None,
    factory: Callable[[dict[str, Any]], Consumer] = Consumer,
    timeout_s: float = 30.0,
) -> dict[int, tuple[int, int]]:
    """The first offset held and the offset after the last message, of each of these partitions."""
    watch = watch or AuthenticationWatch(context)
    asker = open_reader(context, topic, purpose="limits", watch=watch, timeout_s=timeout_s, factory=factory)
    try:
        with translated(context, Request(f"read the offsets of {topic!r}", timeout_s, topic)):
            marks: dict[int, tuple[int, int]] = {}
            for partition in partitions:
                low, high = asker.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
                marks[partition] = (int(low), int(high))
            return marks
    finally:
        asker.close()


def read_topic_limits(
    context: ClientContext,
    topic: str,
    *,
    watch: AuthenticationWatch | None = None,
    factory: Callable[[dict[str, Any]], Consumer] = Consumer,
    timeout_s: float = 30.0,
) -> TopicLimits:
    """The topic's limits: its limits record, else the defaults (``topic_limits`` says when which)."""
    first = read_first_message(context, topic, watch=watch, factory=factory, timeout_s=timeout_s)
    if first is None:
        return limits_at_start(None)
    try:
        headers = headers_to_dict(first.headers)
    except EventDecodeError:
        return limits_at_start((first.value, {}))  # headers no writer sends: an event, not a limits record
    return limits_at_start((first.value, headers))


class TopicLimitsReader:
    """Reads a topic's limits once and keeps them: a component's limits do not change while it runs."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        client_config: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._context = ClientContext(bootstrap_servers, dict(client_config or {}))
        self._topic = topic
        self._timeout_s = timeout_s

    def __repr__(self) -> str:
        """Names the topic only: client settings may hold credentials."""
        return f"TopicLimitsReader(topic={self._topic!r})"

    def __call__(self) -> TopicLimits:
        """The topic's limits now."""
        return read_topic_limits(self._context, self._topic, timeout_s=self._timeout_s)


class WriterLimits:
    """A writer's limits: its topic's, read when first needed and kept, checked against any it was given.

    An event that fits one message is under every reader's limit (readers check only what they reassemble), so
    a writer reads the topic's limits only for its first event that needs chunks: a sink stays constructible
    and usable for small events without reading, and a marker still reaches the broker when nothing else can
    be read. ``max_event_bytes`` is what the writer's constructor or config block named (deprecated; ``None``
    when not given); given, it is checked at the first send, whatever its size.
    """

    def __init__(
        self,
        who: str,
        bootstrap_servers: str,
        topic: str,
        *,
        client_config: Mapping[str, Any] | None,
        chunk_bytes: int,
        max_event_bytes: int | None,
        timeout_s: float = 30.0,
    ) -> None:
        check_size_settings(chunk_bytes, max_event_bytes)
        warn_given(who, {"max_event_bytes": max_event_bytes})
        self._who = who
        self._topic = topic
        self._chunk_bytes = chunk_bytes
        self._one_message = TopicLimits(max_event_bytes=chunk_bytes)
        self._given = max_event_bytes
        self._read = TopicLimitsReader(
            bootstrap_servers, topic, client_config=client_config, timeout_s=timeout_s
        )
        self._lock = threading.Lock()
        self._limits: TopicLimits | None = None

    def __repr__(self) -> str:
        """Names the topic only."""
        return f"WriterLimits(topic={self._topic!r})"

    @property
    def check_first(self) -> bool:
        """Whether the next send must read the limits first: a limit was given and is not checked yet."""
        return self._given is not None and self.known() is None

    def get(self) -> TopicLimits:
        """The topic's limits; the first call reads them (blocking, one short request)."""
        with self._lock:
            if self._limits is None:
                limits = self._read()
                check_given(self._who, self._topic, limits, max_event_bytes=self._given)
                check_size_settings(self._chunk_bytes, limits.max_event_bytes)
                self._limits = limits
            return self._limits

    def known(self) -> TopicLimits | None:
        """The limits once read, without reading."""
        with self._lock:
            return self._limits

    def encode(self, encode: Callable[[TopicLimits], _T]) -> _T:
        """Encode with the topic's limits, reading them only when the event does not fit one message."""
        limits = self.known()
        if limits is not None:
            return encode(limits)
        try:
            return encode(self._one_message)
        except EventTooLargeError:
            return encode(self.get())


def write_limits_record(context: ClientContext, topic: str, limits: TopicLimits, timeout_s: float) -> None:
    """Append the limits record to partition 0, acknowledged by every in-sync replica."""
    value, headers = encode_limits_record(limits)
    producer = build_client(
        Producer,
        context.settings({"enable.idempotence": True, "acks": "all"}),
        context,
        "producer",
    )
    failures: list[Any] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            failures.append(error)

    with translated(context, Request(f"record the limits of topic {topic!r}", timeout_s, topic)):
        producer.produce(
            topic, value=value, headers=headers, partition=LIMITS_PARTITION, on_delivery=delivered
        )
        left = producer.flush(timeout_s)
        if failures:
            raise KafkaException(failures[0])
    if left:
        raise DeliveryError(
            f"the limits record of topic {topic!r} was not acknowledged within {timeout_s:g} s; run "
            "`tokcap topic create` again once the broker answers"
        )
