"""``PartitionedTokenSource``: one trainer-side source over materializers that each own a partition subset.

When the run topic's partitions are materialized on several nodes, each into its own directory (``tokcap
materialize --partitions 0-3 --dir A`` on one, ``--partitions 4-7 --dir B`` on another, on a filesystem the
trainer reads), a rollout's snapshot lives in the directory that owns the rollout's partition. This source:

1. computes the rollout's partition before publishing anything, exactly as the producer will
   (``partitioner``, the same librdkafka partitioner and the topic's partition count);
2. finds the directory whose owner record (``ownership``) names that partition: none is
   ``PartitionOwnerMissingError`` naming the partition, two are ``PartitionOwnershipConflictError``;
3. sends the command through that directory's ``KafkaTokenSource``, which follows the directory's external
   materializer, and refuses at once a command that landed on a partition the directory does not own.

Retire and delete of several rollouts go to each owner at once; their answer keeps the order of the ids given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.protocols import RolloutRemovalPayload, TokenCaptureSnapshot
from transports.kafka.client.admin import watermarks
from transports.kafka.client.producer_bridge import DEFAULT_DELIVERY_TIMEOUT_S
from transports.kafka.client.topics import resolve_topic
from transports.kafka.materializer.ownership import PartitionOwners
from transports.kafka.source import DEFAULT_APPLY_TIMEOUT_S, KafkaTokenSource
from transports.kafka.wire.partitioner import partition_of_rollout, partitioner_of

__all__ = ["PartitionedTokenSource"]


class PartitionedTokenSource:
    """Freezes, drops, retires and deletes through the log, answered by the directory owning each rollout."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        store_dirs: Sequence[str | Path] | None = None,
        parent_dir: str | Path | None = None,
        run_id: str | None = None,
        topic: str | None = None,
        timeout_s: float = DEFAULT_APPLY_TIMEOUT_S,
        writer_id: str | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        broker_timeout_s: float = 10.0,
    ) -> None:
        """Give the owners' directories as ``store_dirs``, or their common parent as ``parent_dir``.

        The topic's partition count is read once here: partitions must never be added to a live run topic.
        """
        if (store_dirs is None) == (parent_dir is None):
            raise ConfigError("give exactly one of store_dirs (the owners' directories) or parent_dir")
        self._topic = resolve_topic(run_id, topic)
        self._partitioner = partitioner_of(producer_config)
        self._owners = (
            PartitionOwners(self._topic, store_dirs)
            if store_dirs is not None
            else PartitionOwners.under(self._topic, parent_dir or ".")
        )
        self._partition_count = len(
            watermarks(
                bootstrap_servers, self._topic, client_config=consumer_config, timeout_s=broker_timeout_s
            )
        )
        self._settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "topic": self._topic,
            "external_materializer": True,
            "timeout_s": timeout_s,
            "writer_id": writer_id,
            "delivery_timeout_s": delivery_timeout_s,
            "producer_config": producer_config,
            "consumer_config": consumer_config,
        }
        self._sources: dict[Path, KafkaTokenSource] = {}
        self._closed = False

    def __repr__(self) -> str:
        """Names the topic only: client settings may hold credentials."""
        return f"PartitionedTokenSource(topic={self._topic!r})"

    @property
    def partition_count(self) -> int:
        """The run topic's partitions, as read when the source was built."""
        return self._partition_count

    def partition_of(self, rollout_id: str) -> int:
        """The partition the rollout's messages land on."""
        return partition_of_rollout(rollout_id, self._partition_count, self._partitioner)

    def owner_of(self, rollout_id: str) -> Path:
        """The directory holding the rollout: the owner of its partition."""
        return self._owners.owner_of(self.partition_of(rollout_id))

    def store_for(self, rollout_id: str) -> TokenCaptureStore:
        """The store the rollout's snapshot is read from."""
        return self._source_for(rollout_id).store

    def _source_for(self, rollout_id: str) -> KafkaTokenSource:
        if self._closed:
            raise ConfigError("this source is closed")
        directory = self.owner_of(rollout_id)
        source = self._sources.get(directory)
        if source is None:
            source = KafkaTokenSource(
                store_dir=directory,
                owns_partition=lambda partition: self._owners.owner_of(partition) == directory,
                **self._settings,
            )
            self._sources[directory] = source
        return source

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze the rollout through its owner; the snapshot is read from the owner's directory."""
        return await self._source_for(validate_rollout_id(rollout_id)).freeze(rollout_id)

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire exactly this snapshot through the rollout's owner; ``False`` if the rollout changed since."""
        return await self._source_for(validate_rollout_id(rollout_id)).drop(rollout_id, snapshot_id, version)

    async def _remove(self, rollout_ids: Sequence[str], what: str) -> RolloutRemovalPayload:
        ids = validate_rollout_ids(rollout_ids)
        by_source: dict[int, tuple[KafkaTokenSource, list[str]]] = {}
        for rollout_id in ids:
            source = self._source_for(rollout_id)
            by_source.setdefault(id(source), (source, []))[1].append(rollout_id)
        answers = await asyncio.gather(
            *(
                source.retire(group) if what == "retire" else source.delete(group)
                for source, group in by_source.values()
            )
        )
        removed = {rollout_id for answer in answers for rollout_id in answer.removed}
        return RolloutRemovalPayload(
            removed=tuple(r for r in ids if r in removed), not_found=tuple(r for r in ids if r not in removed)
        )

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and keep their fences, each through its owner."""
        return await self._remove(rollout_ids, "retire")

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and fences, each through its owner, so their ids can be reused."""
        return await self._remove(rollout_ids, "delete")

    async def close(self) -> None:
        """Close every owner's source; idempotent."""
        self._closed = True
        sources, self._sources = list(self._sources.values()), {}
        for source in sources:
            await source.close()
