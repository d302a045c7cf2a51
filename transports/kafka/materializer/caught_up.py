"""A store directory this process materializes, read once it holds everything a rollout's writers sent.

Engine-side staging reads its rows where every other event of a run topic lands: the store directory the
materializer projects the topic into, through the same apply step as the file transport. A staged row or
ledger row is acknowledged by the broker before its writer returns, so a reader that waits until the
materializer has applied the rollout's partition up to its end as of the read sees it (read-your-writes per
rollout partition, on any node), exactly as a freeze sees the puts acknowledged before it.

The materializer is the process-wide one of the directory (``shared_materializers``). A directory another
process materializes is refused: give each reading process a directory of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from tokcap.errors import ConfigError, DeliveryTimeoutError, TransportError
from tokcap.files.store import TokenCaptureStore
from transports.kafka.client.admin import partition_count
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, open_reader
from transports.kafka.client.error_map import Request, translated
from transports.kafka.materializer.loop import Materializer
from transports.kafka.materializer.shared_materializers import shared_materializers
from transports.kafka.wire.partitioner import DEFAULT_PARTITIONER, partition_of_rollout

__all__ = ["CaughtUpStore", "end_offsets"]


def end_offsets(
    asker: Consumer, watch: AuthenticationWatch, context: ClientContext, topic: str, timeout_s: float
) -> dict[int, int]:
    """The end offset (the next offset to be written) of every partition of ``topic``, asked now."""
    partitions = partition_count(asker, watch, context, timeout_s, topic)
    ends = {}
    with translated(context, Request(f"read the end of {topic!r}", timeout_s)):
        for partition in range(partitions):
            _, end = asker.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=timeout_s, cached=False
            )
            ends[partition] = int(end)
    return ends


class CaughtUpStore:
    """The materialized store directory of a run topic, and the wait that makes a rollout's reads current."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        topic: str,
        store_dir: str | Path,
        consumer_config: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
        partitioner: str = DEFAULT_PARTITIONER,
        skipped_types: frozenset[str] = frozenset(),
    ) -> None:
        """``skipped_types``: event types the directory's materializer passes over (``Materializer``)."""
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self._topic = topic
        self._timeout_s = timeout_s
        self._partitioner = partitioner
        materializer = shared_materializers.acquire(
            bootstrap_servers, topic, store_dir, consumer_config, skipped_types
        )
        if materializer is None:
            raise ConfigError(
                f"{store_dir} is materialized by another process; give this staging reader a store_dir of its own"
            )
        self._materializer: Materializer | None = materializer
        self._context = ClientContext(bootstrap_servers, dict(consumer_config or {}))
        self._watch = AuthenticationWatch(self._context)
        self._asker: Consumer = open_reader(self._context, topic, purpose="staging", watch=self._watch)
        self._partitions: int | None = None
        self._lock = threading.Lock()

    @property
    def store(self) -> TokenCaptureStore:
        """The projection every read is answered from."""
        return self._materializer_now().store

    @property
    def materializer(self) -> Materializer:
        """The process's materializer of the directory."""
        return self._materializer_now()

    def _materializer_now(self) -> Materializer:
        if self._materializer is None:
            raise TransportError(f"the staging reader of {self._topic!r} is closed; build a new one")
        return self._materializer

    def _partition_of(self, rollout_id: str) -> int:
        with self._lock:
            if self._partitions is None:
                self._partitions = partition_count(
                    self._asker, self._watch, self._context, self._timeout_s, self._topic
                )
            return partition_of_rollout(rollout_id, self._partitions, self._partitioner)

    def catch_up(self, rollout_id: str) -> None:
        """Block until the store holds every event of the rollout's partition acknowledged before this call."""
        materializer = self._materializer_now()
        partition = self._partition_of(rollout_id)
        with translated(self._context, Request(f"read the end of {self._topic!r}", self._timeout_s)):
            _, end = self._asker.get_watermark_offsets(
                TopicPartition(self._topic, partition), timeout=self._timeout_s, cached=False
            )
        if end > 0 and not materializer.wait_for(partition, int(end) - 1, self._timeout_s):
            raise DeliveryTimeoutError(
                f"the materializer of {self._topic!r} did not apply partition {partition} up to offset {end - 1} "
                f"within {self._timeout_s} s, so rollout {rollout_id!r} cannot be read current; check that it "
                "is running and keeping up",
                rollout_id=rollout_id,
            )

    def catch_up_all(self) -> None:
        """Block until the store holds every event of every partition acknowledged before this call."""
        materializer = self._materializer_now()
        ends = end_offsets(self._asker, self._watch, self._context, self._topic, self._timeout_s)
        for partition, end in sorted(ends.items()):
            if end > 0 and not materializer.wait_for(partition, end - 1, self._timeout_s):
                raise DeliveryTimeoutError(
                    f"the materializer of {self._topic!r} did not apply partition {partition} up to offset "
                    f"{end - 1} within {self._timeout_s} s, so the whole run cannot be read current; check that it "
                    "is running and keeping up"
                )

    def wait_applied(self, partition: int, offset: int, rollout_id: str) -> None:
        """Block until the store holds the event the broker acknowledged at this position, and all before it."""
        if not self._materializer_now().wait_for(partition, offset, self._timeout_s):
            raise DeliveryTimeoutError(
                f"the materializer of {self._topic!r} did not apply partition {partition} offset {offset} "
                f"(rollout {rollout_id!r}) within {self._timeout_s} s; check that it is running and keeping up",
                rollout_id=rollout_id,
            )

    def close(self) -> None:
        """Hand the materializer back and close the offset reader; calling it again is a no-op."""
        with self._lock:
            materializer, self._materializer = self._materializer, None
        if materializer is None:
            return
        shared_materializers.release(materializer)
        self._asker.close()
