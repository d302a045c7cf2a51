"""Gym's ``LineageResolver`` over a run topic: request-time parent lookup straight from the Kafka log.

Before answering, ``resolve`` reads the rollout's partition up to its end as of the call
(``partition_reader``), so any ``put`` acknowledged before the call is seen: read-your-writes per rollout,
on any node, including a resolver built after the put. What was read is folded through the rules the
materializer applies and indexed by call (``rollout_logs``); the answer is decided over that index, with
Gym 0.7.0's decisions and hashes.

Nameable in the config block as ``lineage_store: transports.kafka.lineage:KafkaLineageResolver`` with
``lineage_store_kwargs: {bootstrap_servers: ..., topic: ...}`` (or ``run_id``). It is Gym's ``CaptureLedger``
for engine-side staging too (``transports.kafka.ledger.KafkaCaptureLedger``): ledger rows are events on the
topic, read back from a materializer's projection, and a continuation no put resolves is looked up among the
committed ledger rows, as the file resolver does. The projection lives in ``store_dir`` when given; without
it, in a ledger-only projection in a directory the process makes for itself (``private_projection``), so the
one block every model server reads needs no per-process setting. It is started at the first ledger call, or
at the first continuation whose rollout has ledger rows on the topic: a resolver of puts alone never starts it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError, TransportError
from tokcap.fingerprint import assistant_fingerprint
from tokcap.ledger import PendingRollout
from tokcap.lineage import LineageResolution
from tokcap.log.records import ParentResolutionStatus
from tokcap.metrics import source_timed
from transports.kafka.client.clients import ClientContext
from transports.kafka.client.topics import resolve_topic
from transports.kafka.ledger import DEFAULT_STAGE_TIMEOUT_S, KafkaCaptureLedger
from transports.kafka.lineage.partition_reader import PartitionReader
from transports.kafka.lineage.rollout_logs import RolloutLogs
from transports.kafka.wire.partitioner import PARTITIONERS

__all__ = ["KafkaLineageResolver"]


class KafkaLineageResolver:
    """Resolves each request's parent from the run topic, with Gym 0.7.0's decisions and hashes."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        run_id: str | None = None,
        topic: str | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        partitioner: str = "consistent_random",
        timeout_s: float = 10.0,
        threads: int = 32,
        max_kept_tokens: int = 8_000_000,
        store_dir: str | Path | None = None,
        delivery_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        """The resolver is Gym's ``CaptureLedger`` too (engine-side staging): ledger rows are events on the topic,
        read back from a materializer's projection of it, in ``store_dir`` when given (a whole projection, which
        sources of this process may share), else in a ledger-only one of this process's own.
        """
        if not bootstrap_servers:
            raise ConfigError("bootstrap_servers must name at least one broker")
        if partitioner not in PARTITIONERS:
            raise ConfigError(
                f"partitioner {partitioner!r} is not one of {', '.join(sorted(PARTITIONERS))}; "
                "use the producer_config 'partitioner' of the sinks writing the topic"
            )
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if threads < 1:
            raise ConfigError(f"threads must be at least 1, got {threads}")
        self._topic = resolve_topic(run_id, topic)
        self._closed = False
        self._lock = threading.Lock()
        """Guards the folded state; never held while waiting on the broker."""
        self._logs = RolloutLogs(self._topic, max_kept_tokens)
        self._reader = PartitionReader(
            context=ClientContext(bootstrap_servers, dict(consumer_config or {})),
            topic=self._topic,
            partitioner=partitioner,
            timeout_s=timeout_s,
            lock=self._lock,
            logs=self._logs,
            raise_if_closed=self._raise_if_closed,
        )
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokcap-lineage")
        self._ledger: KafkaCaptureLedger | None = None
        self._ledger_lock = threading.Lock()
        self._ledger_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "store_dir": store_dir,
            "topic": self._topic,
            "delivery_timeout_s": delivery_timeout_s,
            "producer_config": producer_config,
            "consumer_config": consumer_config,
        }
        if store_dir is not None:
            self._capture_ledger()

    def __repr__(self) -> str:
        """Names the topic only: consumer settings may hold credentials."""
        return f"KafkaLineageResolver(topic={self._topic!r})"

    @property
    def topic(self) -> str:
        """The run topic this resolver reads."""
        return self._topic

    @source_timed("kafka", "resolve")
    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> LineageResolution:
        """Return ROOT, RESOLVED with the proven parent's cumulative tokens, or UNRESOLVED with a reason."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        # Its own threads: a call mostly waits on the broker, and the default pool (a few threads) would queue
        # concurrent rollouts' calls behind each other.
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._resolve_continuation, rollout_id, request_items, fingerprint
        )

    def resolve_now(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution:
        """The blocking form of ``resolve``."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        return self._resolve_continuation(rollout_id, request_items, fingerprint)

    def _resolve_continuation(
        self, rollout_id: str, request_items: Sequence[Any], fingerprint: str
    ) -> LineageResolution:
        """Read the rollout's partition up to its end as of now, then decide; the request has a model turn."""
        self._reader.read_rollout_partition(rollout_id)
        answer = self._answer(rollout_id, request_items, fingerprint)
        if answer.status is not ParentResolutionStatus.UNRESOLVED:
            return answer
        with self._lock:
            ledger_rows = self._logs.has_ledger_rows(rollout_id)
        if self._ledger is not None or ledger_rows:
            # Engine-side staging: the parent is a ledger row, not a put.
            staged = self._capture_ledger().staged_resolution(rollout_id, request_items)
            if staged is not None:
                return staged
        return answer

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise TransportError(f"{self!r} is closed; build a new resolver")

    def _answer(
        self, rollout_id: str, request_items: Sequence[Any], fingerprint: str | None = None
    ) -> LineageResolution:
        """The decision over what has been read of the log so far."""
        with self._lock:
            log = self._logs.current(rollout_id)
        return self._logs.answer(log, request_items, fingerprint)

    def is_process_shared(self) -> bool:
        """True: every worker reads the same topic."""
        return True

    def _capture_ledger(self) -> KafkaCaptureLedger:
        """The ledger, started on first use (it starts a materializer: call it off the event loop)."""
        with self._ledger_lock:
            self._raise_if_closed()
            if self._ledger is None:
                self._ledger = KafkaCaptureLedger(**self._ledger_settings)
            return self._ledger

    async def _started_ledger(self) -> KafkaCaptureLedger:
        ledger = self._ledger
        return ledger if ledger is not None else await asyncio.to_thread(self._capture_ledger)

    async def record(self, commit: Any) -> None:
        """Gym's ``CaptureLedger.record``: returns once every serving worker can read the row."""
        await (await self._started_ledger()).record(commit)

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Gym's ``CaptureLedger.record_failure``: the row poisons the rollout and never resolves a parent."""
        await (await self._started_ledger()).record_failure(rollout_id, model_call_id, reason)

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """Gym's ``CaptureLedger.manifest``, as plain JSON."""
        return await (await self._started_ledger()).manifest(rollout_id)

    async def has_rows(self, rollout_id: str) -> bool:
        """Gym's ``CaptureLedger.has_rows``; failure rows count."""
        return await (await self._started_ledger()).has_rows(rollout_id)

    async def pending_rollouts(self) -> list[PendingRollout]:
        """The rollouts with committed rows, not retired or deleted, each saying if it has failure rows."""
        return await (await self._started_ledger()).pending_rollouts()

    async def retire(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Gym main's ``CaptureLedger.retire``: remove the rollouts' rows and keep their fences."""
        return await (await self._started_ledger()).retire(rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Gym main's ``CaptureLedger.delete``: remove the rollouts and their fences."""
        return await (await self._started_ledger()).delete(rollout_ids)

    async def close(self) -> None:
        """Close the consumer (and the ledger's clients); calling it again is a no-op."""
        with self._ledger_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            ledger = self._ledger
        if ledger is not None:
            await ledger.close()
        with self._lock:
            self._logs.clear()
            self._reader.wake_waiting()
        await asyncio.to_thread(self._reader.close)
        self._executor.shutdown(wait=False)
