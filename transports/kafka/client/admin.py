"""What an operator asks the broker: is it there, what does the run topic look like, delete it.

librdkafka failures become tokcap errors through ``transports.kafka.client.error_map``, so command-line tools
print one clear line instead of a ``KafkaException``; a refused login or TLS handshake ends a wait at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from tokcap.errors import TransportError
from transports.kafka.client.client_log import LIBRDKAFKA_LOGGER
from transports.kafka.client.clients import (
    AuthenticationWatch,
    ClientContext,
    build_client,
    list_topics,
    open_reader,
)
from transports.kafka.client.error_map import Request, kafka_error_of, translated
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.topics import KEEP_WHOLE_RUN, validate_topic_name
from transports.kafka.errors import TopicNotFoundError
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = [
    "DURABILITY_CONFIGS",
    "LIBRDKAFKA_LOGGER",
    "PartitionDescription",
    "TopicDescription",
    "TopicIdReader",
    "delete_topic",
    "describe_topic",
    "partition_count",
    "probe_broker",
    "watermarks",
]

DURABILITY_CONFIGS: tuple[str, ...] = (
    "cleanup.policy",
    "retention.ms",
    "retention.bytes",
    "min.insync.replicas",
    "unclean.leader.election.enable",
    "max.message.bytes",
    "segment.bytes",
    "compression.type",
)
"""Topic configs that decide whether a run can be replayed; ``describe_topic`` reports them."""


def _admin(context: ClientContext, watch: AuthenticationWatch | None = None) -> AdminClient:
    fixed = {} if watch is None else {"error_cb": watch}
    return build_client(AdminClient, context.settings(fixed), context, "admin client")


def partition_count(
    client: AdminClient | Consumer,
    watch: AuthenticationWatch,
    context: ClientContext,
    timeout_s: float,
    topic: str,
) -> int:
    """How many partitions the topic has; a topic without readable partitions is a ``TransportError``."""
    described = list_topics(client, watch, context, timeout_s, topic).topics.get(topic)
    if described is None or described.error is not None or not described.partitions:
        raise TransportError(f"topic {topic!r} has no readable partitions; create it first")
    return len(described.partitions)


def _topic_metadata(
    admin: AdminClient, watch: AuthenticationWatch, context: ClientContext, topic: str, timeout_s: float
) -> Any:
    """The topic's metadata from a listing of every topic; asking for one topic by name could create it."""
    metadata = list_topics(admin, watch, context, timeout_s).topics.get(topic)
    if metadata is None:
        raise TopicNotFoundError(
            f"topic {topic!r} does not exist on {context.bootstrap}; check the run id, or create it with "
            "`tokcap topic create`"
        )
    if metadata.error is not None:
        with translated(context, Request(f"describe topic {topic!r}", timeout_s, topic)):
            raise KafkaException(metadata.error)
    return metadata


def probe_broker(
    bootstrap_servers: str, *, client_config: Mapping[str, Any] | None = None, timeout_s: float = 10.0
) -> int:
    """Ask the cluster for its metadata; return how many brokers answered.

    Raises ``BrokerUnreachableError`` when none answers in time, ``BrokerAuthenticationError`` (or its
    ``BrokerTlsError``) as soon as the broker refuses the login or the handshake.
    """
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    metadata = list_topics(_admin(context, watch), watch, context, timeout_s)
    return len(metadata.brokers)


@dataclass(frozen=True)
class PartitionDescription:
    """One partition: who leads it, who holds copies, who is in sync, and which offsets it holds."""

    partition: int
    leader: int
    replicas: tuple[int, ...]
    in_sync_replicas: tuple[int, ...]
    low_offset: int
    high_offset: int

    @property
    def under_replicated(self) -> bool:
        """Fewer replicas in sync than assigned: an acknowledged write has fewer copies than configured."""
        return len(self.in_sync_replicas) < len(self.replicas)


@dataclass(frozen=True)
class TopicDescription:
    """A run topic as the broker sees it."""

    topic: str
    partitions: tuple[PartitionDescription, ...]
    configs: dict[str, str | None] = field(default_factory=dict)
    topic_id: str | None = None
    """The id the broker gave the topic when it was created: store directories are bound to it."""
    limits: TopicLimits | None = None
    """The size limits every sink and reader of the topic uses (``topic_limits``)."""

    @property
    def messages(self) -> int:
        """Messages currently held, over every partition (high minus low offsets)."""
        return sum(p.high_offset - p.low_offset for p in self.partitions)

    @property
    def replayable_from_start(self) -> bool:
        """Whether every partition still holds offset 0; otherwise retention removed part of the run."""
        return all(p.low_offset == 0 for p in self.partitions)

    @property
    def warnings(self) -> list[str]:
        """What threatens a full replay of the run: finite retention, or a start already deleted."""
        found: list[str] = []
        retention = self.configs.get("retention.ms")
        if retention is not None and retention != KEEP_WHOLE_RUN:
            found.append(
                f"retention.ms={retention}: the broker deletes events older than {int(retention) / 3_600_000:g} h, "
                "after which the run cannot be replayed; set retention.ms=-1 to keep the whole run"
            )
        if not self.replayable_from_start:
            found.append("retention removed the start of the run; a full replay is no longer possible")
        return found

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form for ``--json``."""
        return {
            "topic": self.topic,
            "topic_id": self.topic_id,
            "limits": None if self.limits is None else self.limits.to_dict(),
            "messages": self.messages,
            "replayable_from_start": self.replayable_from_start,
            "warnings": self.warnings,
            "partitions": [
                {
                    "partition": p.partition,
                    "leader": p.leader,
                    "replicas": list(p.replicas),
                    "in_sync_replicas": list(p.in_sync_replicas),
                    "under_replicated": p.under_replicated,
                    "low_offset": p.low_offset,
                    "high_offset": p.high_offset,
                }
                for p in self.partitions
            ],
            "configs": dict(self.configs),
        }


def watermarks(
    bootstrap_servers: str,
    topic: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> dict[int, tuple[int, int]]:
    """Per partition of an existing topic, the first offset still held and the offset after the last message."""
    validate_topic_name(topic)
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    metadata = _topic_metadata(_admin(context, watch), watch, context, topic, timeout_s)
    consumer = open_reader(context, topic, purpose="admin", watch=watch)
    try:
        with translated(context, Request(f"read the offsets of topic {topic!r}", timeout_s, topic)):
            result: dict[int, tuple[int, int]] = {}
            deadline = time.monotonic() + timeout_s
            for partition in sorted(metadata.partitions):
                low, high = _watermarks_once_led(consumer, TopicPartition(topic, partition), deadline)
                result[partition] = (int(low), int(high))
            return result
    finally:
        consumer.close()


_LEADERSHIP_SETTLING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)
"""Answers of a partition whose leader is moving or not yet known to the broker asked (a topic just made)."""


def _watermarks_once_led(consumer: Consumer, partition: TopicPartition, deadline: float) -> tuple[int, int]:
    """A partition's watermarks, asked again while its leadership settles, until ``deadline``."""
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                partition, timeout=max(0.1, deadline - time.monotonic())
            )
            return int(low), int(high)
        except KafkaException as exc:
            error = kafka_error_of(exc)
            if error is None or error.code() not in _LEADERSHIP_SETTLING or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


def describe_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> TopicDescription:
    """Partitions, replicas, in-sync replicas, offsets and the durability configs of a topic."""
    validate_topic_name(topic)
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    admin = _admin(context, watch)
    metadata = _topic_metadata(admin, watch, context, topic, timeout_s)
    offsets = watermarks(bootstrap_servers, topic, client_config=client_config, timeout_s=timeout_s)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    with translated(context, Request(f"read the configs of topic {topic!r}", timeout_s, topic)):
        described = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(
            timeout=timeout_s
        )
    configs = {key: (described[key].value if key in described else None) for key in DURABILITY_CONFIGS}
    partitions = tuple(
        PartitionDescription(
            partition=number,
            leader=int(meta.leader),
            replicas=tuple(int(r) for r in meta.replicas),
            in_sync_replicas=tuple(int(r) for r in meta.isrs),
            low_offset=offsets[number][0],
            high_offset=offsets[number][1],
        )
        for number, meta in sorted(metadata.partitions.items())
    )
    topic_id = TopicIdReader(bootstrap_servers, topic, client_config=client_config, timeout_s=timeout_s)()
    limits = read_topic_limits(context, topic, watch=watch, timeout_s=timeout_s)
    return TopicDescription(
        topic=topic, partitions=partitions, configs=configs, topic_id=topic_id, limits=limits
    )


def delete_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Delete a topic; raise ``TopicNotFoundError`` when there is none to delete."""
    validate_topic_name(topic)
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    admin = _admin(context, watch)
    _topic_metadata(admin, watch, context, topic, timeout_s)
    with translated(context, Request(f"delete topic {topic!r}", timeout_s, topic)):
        future = admin.delete_topics([topic], operation_timeout=timeout_s, request_timeout=timeout_s)[topic]
        future.result(timeout=timeout_s)


class TopicIdReader:
    """Reads a topic's id: what tells one incarnation of a topic from the next one created under its name.

    Deleting a topic and creating it again keeps the name and starts its offsets again at 0; only the id,
    which the broker gives each topic when it is created, differs. Consumer metadata does not carry it, so
    this asks the admin API. One client is kept, so each read is a single request (about a millisecond).

    librdkafka sends the request to the broker its metadata names as controller and waits for that one: a
    client that learned of a node that was killed since waited "for controller" for minutes on a three-node
    cluster. So a client whose read failed is dropped, and the next read starts a new one from the bootstrap
    addresses, which learns of the nodes alive now.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        client_config: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._topic = validate_topic_name(topic)
        self._context = ClientContext(bootstrap_servers, dict(client_config or {}))
        self._watch = AuthenticationWatch(self._context)
        self._timeout_s = timeout_s
        self._request = Request(f"read the id of topic {self._topic!r}", timeout_s, self._topic)
        self._admin: AdminClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        """Names the topic only: client settings may hold credentials."""
        return f"TopicIdReader(topic={self._topic!r})"

    def __call__(self) -> str:
        """The topic's id now; ``TopicNotFoundError`` when the broker knows no topic of that name."""
        with self._lock:
            if self._admin is None:
                self._admin = _admin(self._context, self._watch)
            admin = self._admin
        self._watch.raise_if_failed()
        with translated(self._context, self._request):
            future = admin.describe_topics(TopicCollection([self._topic]), request_timeout=self._timeout_s)[
                self._topic
            ]
            try:
                described = future.result(timeout=self._timeout_s + 1.0)
            except (KafkaException, TimeoutError) as exc:
                self._watch.raise_if_failed()
                error = kafka_error_of(exc)
                if error is None or error.code() not in (
                    KafkaError.UNKNOWN_TOPIC_OR_PART,
                    KafkaError._UNKNOWN_TOPIC,
                ):
                    with self._lock:
                        if self._admin is admin:
                            self._admin = None
                raise
        return str(described.topic_id)
