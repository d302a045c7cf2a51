"""One Kafka topic per run: its name, and its idempotent creation.

The topic of run ``R`` is ``tokcap.R``.
Kafka accepts topic names of ASCII letters, digits, ``.``, ``_`` and ``-`` up to 249 characters,
so a run id must use those characters and leave room for the prefix.
Creating a topic that already exists succeeds only when the existing topic has the requested
partition count, replication factor and configs; anything else raises ``TopicMismatchError``,
because silently writing to a differently configured topic could lose durability guarantees.

A run topic is the only complete record of the run, so two settings are decided here: compaction is
refused (it keeps only the last message per key, and every event of a rollout shares its key), and the
topic keeps every message (``retention.ms=-1``) unless the caller gives a retention.

The topic's size limits (``TopicLimits``) are decided here too: the broker takes no custom topic settings, so
``ensure_topic`` writes them as the topic's first message (``topic_limits``), before any sink can send.

A new run topic gets a staged-payload topic beside it, ``tokcap-staged.<topic>``, made with the same settings
before the limits record names it: staged calls' bytes go there and the run topic keeps a reference to each
(``wire.staged_payloads``), so readers of ledger rows and commands never fetch staged tokens. The prefix keeps
the name apart from every run topic's; a name that would be too long leaves staged calls inline.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from tokcap.errors import ConfigError, TransportError
from transports.kafka.client.clients import ClientContext, build_client
from transports.kafka.client.error_map import Request, kafka_error_of, translated
from transports.kafka.client.limits_record import partition_marks, read_topic_limits, write_limits_record
from transports.kafka.errors import TopicLimitsMismatchError, TopicMismatchError
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

__all__ = [
    "KEEP_WHOLE_RUN",
    "MAX_TOPIC_NAME_LENGTH",
    "STAGED_PAYLOAD_PREFIX",
    "TOPIC_PREFIX",
    "TopicSettings",
    "ensure_topic",
    "resolve_topic",
    "staged_payload_topic_for",
    "topic_for_run",
    "validate_topic_name",
]

TOPIC_PREFIX = "tokcap."

STAGED_PAYLOAD_PREFIX = "tokcap-staged."
"""Every staged-payload topic starts with this and ends with its run topic's whole name."""
_METADATA_RETRY_S = 0.1
"""Every run topic starts with this, so operators can list and clean tokcap topics together."""

MAX_TOPIC_NAME_LENGTH = 249
"""Kafka's own limit on topic name length."""

KEEP_WHOLE_RUN = "-1"
"""The ``retention.ms`` a run topic gets unless one is given: the broker never deletes the run's events."""

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")


def validate_topic_name(name: str) -> str:
    """Refuse a name Kafka would refuse, with a message saying what to change; return the name."""
    if not isinstance(name, str) or not name:
        raise ConfigError("a Kafka topic name must be a non-empty string")
    if name in {".", ".."}:
        raise ConfigError(f"{name!r} is not a valid Kafka topic name")
    if len(name) > MAX_TOPIC_NAME_LENGTH:
        raise ConfigError(
            f"topic name is {len(name)} characters long; Kafka allows at most {MAX_TOPIC_NAME_LENGTH}"
        )
    if _TOPIC_NAME.fullmatch(name) is None:
        raise ConfigError(
            f"topic name {name!r} has characters Kafka does not accept; use ASCII letters, digits, '.', '_' and '-'"
        )
    return name


def topic_for_run(run_id: str) -> str:
    """The documented topic name of a run: ``tokcap.<run_id>``."""
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError("run id must be a non-empty string")
    limit = MAX_TOPIC_NAME_LENGTH - len(TOPIC_PREFIX)
    if len(run_id) > limit:
        raise ConfigError(f"run id is {len(run_id)} characters long; at most {limit} fit in a topic name")
    if _TOPIC_NAME.fullmatch(run_id) is None:
        raise ConfigError(
            f"run id {run_id!r} cannot name a Kafka topic; use ASCII letters, digits, '.', '_' and '-'"
        )
    return validate_topic_name(TOPIC_PREFIX + run_id)


def staged_payload_topic_for(topic: str) -> str | None:
    """The staged-payload topic of a run topic; ``None`` when the name would be longer than Kafka allows."""
    name = STAGED_PAYLOAD_PREFIX + topic
    return name if len(name) <= MAX_TOPIC_NAME_LENGTH else None


def resolve_topic(run_id: str | None, topic: str | None) -> str:
    """Pick the topic from exactly one of a run id or an explicit topic name."""
    if (run_id is None) == (topic is None):
        raise ConfigError("pass exactly one of run_id (topic tokcap.<run_id>) or topic")
    if topic is not None:
        return validate_topic_name(topic)
    assert run_id is not None
    return topic_for_run(run_id)


@dataclass(frozen=True)
class TopicSettings:
    """What a run topic must look like: partitions, replication and topic-level configs."""

    partitions: int = 1
    replication_factor: int = 1
    config: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Reject settings the broker would reject later with a less useful message."""
        if self.partitions < 1:
            raise ConfigError(f"partitions must be at least 1, got {self.partitions}")
        if self.replication_factor < 1:
            raise ConfigError(f"replication_factor must be at least 1, got {self.replication_factor}")
        policy = str(self.config.get("cleanup.policy", "delete"))
        if "compact" in policy.lower():
            raise ConfigError(
                f"cleanup.policy={policy} is refused: compaction keeps only the last event of each rollout "
                "(they share one key) and destroys the run's history; use cleanup.policy=delete"
            )

    @property
    def topic_config(self) -> dict[str, str]:
        """The topic-level configs to create the topic with: the caller's, and no deletion by age unless given."""
        config = {key: str(value) for key, value in self.config.items()}
        config.setdefault("retention.ms", KEEP_WHOLE_RUN)
        return config


def _admin(context: ClientContext) -> AdminClient:
    return build_client(AdminClient, context.settings(), context, "admin client")


def _existing_mismatches(
    admin: AdminClient, topic: str, settings: TopicSettings, timeout_s: float
) -> list[str]:
    """Compare an existing topic with the requested settings; return one line per difference.

    The broker that refused the creation may know the topic before the broker answering metadata does, so an
    unknown topic is asked for again until ``timeout_s`` ends.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = max(0.05, deadline - time.monotonic())
        metadata = admin.list_topics(topic=topic, timeout=remaining).topics.get(topic)
        unknown = metadata is None or (
            metadata.error is not None and metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        )
        if not unknown or time.monotonic() >= deadline:
            break
        time.sleep(_METADATA_RETRY_S)
    if metadata is None or metadata.error is not None:
        raise TransportError(
            f"topic {topic!r} exists but its metadata could not be read: {metadata and metadata.error}"
        )
    problems: list[str] = []
    partitions = len(metadata.partitions)
    if partitions != settings.partitions:
        problems.append(f"partitions {partitions} (requested {settings.partitions})")
    replicas = {len(p.replicas) for p in metadata.partitions.values()}
    if replicas != {settings.replication_factor}:
        problems.append(f"replication factor {sorted(replicas)} (requested {settings.replication_factor})")
    wanted_config = settings.topic_config
    if wanted_config:
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        described = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(
            timeout=timeout_s
        )
        for key, wanted in sorted(wanted_config.items()):
            entry = described.get(key)
            actual = None if entry is None else entry.value
            if actual != str(wanted):
                problems.append(f"{key}={actual!r} (requested {wanted!r})")
    return problems


def ensure_topic(
    bootstrap_servers: str,
    topic: str,
    settings: TopicSettings | None = None,
    *,
    admin_config: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
    limits: TopicLimits | None = None,
    staged_payloads_apart: bool = True,
) -> bool:
    """Create the topic if it is missing, with its limits record first; return whether this call created it.

    An existing topic with other settings raises ``TopicMismatchError`` naming each difference, and one whose
    limits differ from ``limits`` (when given) ``TopicLimitsMismatchError``. An existing topic still empty
    gets its limits record now, so a topic made by another tool is made complete here.

    A topic that gets its record here also gets its staged-payload topic, made first with the same settings,
    unless ``staged_payloads_apart`` is false or ``limits`` names another one. The payload topic of an existing
    topic is never changed: its record decides, and a topic made before payload topics carries them inline.
    """
    validate_topic_name(topic)
    wanted = settings or TopicSettings()
    context = ClientContext(bootstrap_servers, dict(admin_config or {}))
    admin = _admin(context)
    if _created(admin, context, topic, wanted, timeout_s):
        _record_limits(
            context,
            topic,
            _new_limits(admin, context, topic, wanted, limits, staged_payloads_apart, timeout_s),
            timeout_s,
        )
        return True
    marks = partition_marks(context, topic, range(wanted.partitions), timeout_s=timeout_s)
    if all(high == 0 for _, high in marks.values()):
        _record_limits(
            context,
            topic,
            _new_limits(admin, context, topic, wanted, limits, staged_payloads_apart, timeout_s),
            timeout_s,
        )
    elif limits is not None:
        _compare_limits(topic, _recorded_limits(context, topic, timeout_s), limits)
    return False


def _created(
    admin: AdminClient, context: ClientContext, topic: str, wanted: TopicSettings, timeout_s: float
) -> bool:
    """Create the topic; ``False`` when it exists already with the settings asked for (else raise)."""
    new_topic = NewTopic(
        topic,
        num_partitions=wanted.partitions,
        replication_factor=wanted.replication_factor,
        config=wanted.topic_config,
    )
    with translated(context, Request(f"create topic {topic!r}", timeout_s)):
        future = admin.create_topics([new_topic], operation_timeout=timeout_s, request_timeout=timeout_s)[
            topic
        ]
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            error = kafka_error_of(exc)
            if error is None or error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            existing = exc
        else:
            return True
    with translated(context, Request(f"check the settings of topic {topic!r}", timeout_s)):
        problems = _existing_mismatches(admin, topic, wanted, timeout_s)
    if problems:
        raise TopicMismatchError(
            f"topic {topic!r} already exists with different settings: {'; '.join(problems)}. "
            "Use a new run id, or delete the topic and create it again"
        ) from existing
    return False


def _new_limits(
    admin: AdminClient,
    context: ClientContext,
    topic: str,
    wanted: TopicSettings,
    limits: TopicLimits | None,
    apart: bool,
    timeout_s: float,
) -> TopicLimits:
    """The limits a topic getting its record now records, its staged-payload topic made first when it has one."""
    chosen = limits or TOPIC_DEFAULTS
    payload_topic = chosen.staged_payload_topic
    if payload_topic is None and apart:
        payload_topic = staged_payload_topic_for(topic)
    if payload_topic is None:
        return chosen
    validate_topic_name(payload_topic)
    _created(admin, context, payload_topic, wanted, timeout_s)
    return replace(chosen, staged_payload_topic=payload_topic)


def _record_limits(context: ClientContext, topic: str, limits: TopicLimits, timeout_s: float) -> None:
    """Write the limits record, then read offset 0 back: a record another process wrote first wins."""
    write_limits_record(context, topic, limits, timeout_s)
    _compare_limits(topic, _recorded_limits(context, topic, timeout_s), limits)


def _recorded_limits(context: ClientContext, topic: str, timeout_s: float) -> TopicLimits:
    return read_topic_limits(context, topic, timeout_s=timeout_s)


def _compare_limits(topic: str, actual: TopicLimits, wanted: TopicLimits) -> None:
    """Refuse a topic whose limits differ from those asked for; asking for no payload topic asks nothing of it."""
    if wanted.staged_payload_topic is None and actual.sizes_equal(wanted):
        return
    if actual != wanted:
        raise TopicLimitsMismatchError(
            f"topic {topic!r} already has limits {actual.describe()}, not the {wanted.describe()} asked for: a "
            "topic's limits are decided once, when it is made (a topic made before limits were recorded has the "
            "defaults). Use a new run id to get other limits"
        )
