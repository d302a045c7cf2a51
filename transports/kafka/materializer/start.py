"""A materializer's start: which partitions it reads, what it asks the broker first, and binding its directory.

Everything here runs once, before anything is applied: the topic's partitions (asked again for a few seconds
while a new topic is not known to every broker yet), the topic's id and limits (asked again while the broker
does not answer, never after a refused login), and the directory's owner records and checkpoints bound to the
topic's current incarnation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError

from tokcap.errors import ConfigError, TransportError
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, list_topics
from transports.kafka.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    MaterializerFailedError,
)
from transports.kafka.materializer.checkpoint import (
    PartitionCheckpoint,
    checkpoint_files,
    checkpoint_path,
    write_checkpoints,
)
from transports.kafka.materializer.ownership import check_owner_records, write_owner_records

__all__ = ["asked_until", "bind_directory", "check_skipped_types", "logger", "topic_partitions"]

logger = logging.getLogger(__name__)

_ASK_AGAIN_S = 0.2
"""Pause between two questions to a broker that did not answer yet."""

T = TypeVar("T")


def check_skipped_types(store_dir: Path, skipped_types: frozenset[str]) -> None:
    """Refuse a projection that skips event types over a directory that holds checkpoints already.

    Such a projection is partial by design: it starts from an empty directory only.
    """
    if skipped_types and checkpoint_files(store_dir):
        raise ConfigError(
            f"{store_dir} holds checkpoints already; a projection that skips {sorted(skipped_types)} "
            "events starts from an empty directory only"
        )


def topic_partitions(
    consumer: Consumer,
    watch: AuthenticationWatch,
    client: ClientContext,
    topic: str,
    *,
    unknown_wait_s: float,
    stop: threading.Event,
    timeout_s: float = 30.0,
) -> list[int]:
    """Every partition of ``topic``; an unknown topic is asked about again for ``unknown_wait_s`` first.

    Right after a topic is created, a broker other than the controller may not know it yet (seen on a 3-node
    cluster).
    """
    deadline = time.monotonic() + unknown_wait_s
    while True:
        metadata = list_topics(consumer, watch, client, timeout_s, topic).topics.get(topic)
        if metadata is not None and metadata.error is None and metadata.partitions:
            return sorted(metadata.partitions)
        unknown = (
            metadata is None
            or metadata.error is None
            or (metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)
        )
        if not unknown or time.monotonic() >= deadline or stop.is_set():
            raise MaterializerFailedError(
                f"topic {topic!r} has no readable partitions ({metadata and metadata.error}); create it first"
            )
        time.sleep(_ASK_AGAIN_S)


def asked_until(ask: Callable[[], T], what: str, *, timeout_s: float, stop: threading.Event) -> T:
    """``ask()``'s answer, asked again for ``timeout_s`` while the broker fails to answer.

    A refused login or permission is raised at once: asking again cannot change it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ask()
        except (BrokerAuthenticationError, BrokerAuthorizationError):
            raise
        except TransportError as exc:
            if time.monotonic() >= deadline or stop.is_set():
                raise
            logger.warning("reading %s again: %s", what, exc)
            time.sleep(_ASK_AGAIN_S)


def bind_directory(
    root: Path, topic: str, partitions: Sequence[int], topic_id: str
) -> dict[int, PartitionCheckpoint]:
    """Bind the directory to the topic's current incarnation; the checkpoints to resume from, by partition.

    Owner records and checkpoints of another incarnation are refused here, before anything is applied.
    Those without an id (written before records had one) are rewritten with it now.
    """
    check_owner_records(root, topic, partitions, topic_id)
    checkpoints = {
        partition: PartitionCheckpoint.of_directory(root, topic, partition, topic_id)
        for partition in partitions
    }
    unbound: dict[int, bytes] = {}
    for partition, checkpoint in checkpoints.items():
        with contextlib.suppress(FileNotFoundError):
            if checkpoint_path(root, partition).read_bytes() != checkpoint.encode():
                unbound[partition] = checkpoint.encode()
    if unbound:
        logger.info(
            "binding the checkpoints of partitions %s in %s to topic %s id %s",
            sorted(unbound),
            root,
            topic,
            topic_id,
        )
    write_checkpoints(root, unbound)
    write_owner_records(root, topic, partitions, topic_id)
    return checkpoints
