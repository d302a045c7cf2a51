"""What an operator asks the broker: is it there, what does the run topic look like, delete it.

Every librdkafka failure is translated here into a tokcap error with a message that says what to check,
so command-line tools print one clear line instead of a ``KafkaException``.
librdkafka's own log lines go to the Python logger ``transports.kafka.librdkafka`` instead of stderr.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from tokcap.errors import BrokerUnreachableError, TopicNotFoundError, TransportError
from transports.kafka.topics import validate_topic_name

__all__ = [
    "DURABILITY_CONFIGS",
    "LIBRDKAFKA_LOGGER",
    "PartitionDescription",
    "TopicDescription",
    "client_settings",
    "delete_topic",
    "describe_topic",
    "probe_broker",
    "route_client_logs",
    "watermarks",
]

LIBRDKAFKA_LOGGER = logging.getLogger("transports.kafka.librdkafka")
"""Where librdkafka's log lines go; they would otherwise be printed straight to stderr."""

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


def route_client_logs(client_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The caller's client settings with librdkafka's log lines sent to ``LIBRDKAFKA_LOGGER``."""
    return {"logger": LIBRDKAFKA_LOGGER, **dict(client_config or {})}


def client_settings(bootstrap_servers: str, client_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A client configuration: the caller's settings (security, timeouts), the bootstrap, and log routing."""
    return {**route_client_logs(client_config), "bootstrap.servers": bootstrap_servers}


def _reason(exc: BaseException) -> str:
    """librdkafka's own sentence for an error, without the ``KafkaError{...}`` wrapping."""
    error = exc.args[0] if exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


def _unreachable(bootstrap_servers: str, timeout_s: float, exc: BaseException) -> BrokerUnreachableError:
    return BrokerUnreachableError(
        f"no Kafka broker answered at {bootstrap_servers} within {timeout_s:g} s ({_reason(exc)}); check the "
        "address, that the broker is running, and the security settings passed with -X"
    )


def _admin(bootstrap_servers: str, client_config: Mapping[str, Any] | None) -> AdminClient:
    return AdminClient(client_settings(bootstrap_servers, client_config))


def _topic_metadata(admin: AdminClient, bootstrap_servers: str, topic: str, timeout_s: float) -> Any:
    """The topic's metadata from a listing of every topic; asking for one topic by name could create it."""
    try:
        topics = admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise _unreachable(bootstrap_servers, timeout_s, exc) from exc
    metadata = topics.get(topic)
    if metadata is None:
        raise TopicNotFoundError(
            f"topic {topic!r} does not exist on {bootstrap_servers}; check the run id, or create it with "
            "`tokcap topic create`"
        )
    if metadata.error is not None:
        raise TransportError(f"the metadata of topic {topic!r} could not be read: {metadata.error}")
    return metadata


def probe_broker(
    bootstrap_servers: str, *, client_config: Mapping[str, Any] | None = None, timeout_s: float = 10.0
) -> int:
    """Ask the cluster for its metadata; return how many brokers answered, or raise ``BrokerUnreachableError``."""
    admin = _admin(bootstrap_servers, client_config)
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise _unreachable(bootstrap_servers, timeout_s, exc) from exc
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

    @property
    def messages(self) -> int:
        """Messages currently held, over every partition (high minus low offsets)."""
        return sum(p.high_offset - p.low_offset for p in self.partitions)

    @property
    def replayable_from_start(self) -> bool:
        """Whether every partition still holds offset 0; otherwise retention removed part of the run."""
        return all(p.low_offset == 0 for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form for ``--json``."""
        return {
            "topic": self.topic,
            "messages": self.messages,
            "replayable_from_start": self.replayable_from_start,
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
    metadata = _topic_metadata(_admin(bootstrap_servers, client_config), bootstrap_servers, topic, timeout_s)
    consumer = Consumer(
        {
            **client_settings(bootstrap_servers, client_config),
            "group.id": f"tokcap-admin-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    try:
        result: dict[int, tuple[int, int]] = {}
        for partition in sorted(metadata.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
            result[partition] = (int(low), int(high))
        return result
    except KafkaException as exc:
        raise _unreachable(bootstrap_servers, timeout_s, exc) from exc
    finally:
        consumer.close()


def describe_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> TopicDescription:
    """Partitions, replicas, in-sync replicas, offsets and the durability configs of a topic."""
    validate_topic_name(topic)
    admin = _admin(bootstrap_servers, client_config)
    metadata = _topic_metadata(admin, bootstrap_servers, topic, timeout_s)
    offsets = watermarks(bootstrap_servers, topic, client_config=client_config, timeout_s=timeout_s)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    try:
        described = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(
            timeout=timeout_s
        )
    except KafkaException as exc:
        raise TransportError(f"could not read the configs of topic {topic!r}: {_reason(exc)}") from exc
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
    return TopicDescription(topic=topic, partitions=partitions, configs=configs)


def delete_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Delete a topic; raise ``TopicNotFoundError`` when there is none to delete."""
    validate_topic_name(topic)
    admin = _admin(bootstrap_servers, client_config)
    _topic_metadata(admin, bootstrap_servers, topic, timeout_s)
    future = admin.delete_topics([topic], operation_timeout=timeout_s, request_timeout=timeout_s)[topic]
    try:
        future.result(timeout=timeout_s)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise TopicNotFoundError(f"topic {topic!r} does not exist on {bootstrap_servers}") from exc
        raise TransportError(
            f"could not delete topic {topic!r} on {bootstrap_servers}: {_reason(exc)}"
        ) from exc
