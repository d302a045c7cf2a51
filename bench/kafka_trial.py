"""One trial of the load through Kafka: sink puts (acks=all), source freezes, then a full replay.

Each trial gets its own topic, deleted afterwards, so trials never read each other's events.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from bench.apply_rate import ApplyRate, measure_apply_rate
from bench.file_store_trial import directory_bytes
from bench.load import LoadResult, PreparedWorkload, drive
from bench.workers import WorkersMismatchError, directory_contents, measure_workers
from tokcap.log.records import TokenEntry
from tokcap.protocols import TokenCaptureSnapshot
from transports.kafka.client.topics import TopicSettings, ensure_topic
from transports.kafka.materializer import Materializer, MaterializerCounters
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource

__all__ = [
    "KafkaTarget",
    "KafkaTrial",
    "ReplayFigures",
    "ReplayTimeoutError",
    "delete_topic",
    "run_kafka_trial",
    "warm_up_broker",
]

_CATCH_UP_TIMEOUT_S = 600.0

WORKER_REPLAY_PARTITIONS = 2
"""Partitions of a trial's topic when it is replayed by workers too: enough for two worker processes side by
side, as ``tokcap materialize --workers 2`` runs them; the load's rollouts spread over them by key."""


class ReplayTimeoutError(RuntimeError):
    """A materializer did not reach the end of the topic in time; its rate cannot be reported."""


@dataclass(frozen=True)
class ReplayFigures:
    """How long a fresh materializer took to project the whole topic into an empty directory."""

    seconds: float
    events: int
    puts: int
    tokens: int
    disk_bytes: int

    @property
    def events_per_s(self) -> float:
        """Messages consumed and applied per second."""
        return self.events / self.seconds

    @property
    def puts_per_s(self) -> float:
        """Entries applied per second."""
        return self.puts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Tokens of applied entries per second."""
        return self.tokens / self.seconds


@dataclass(frozen=True)
class KafkaTrial:
    """The load's figures, the replay's, and the apply step's alone."""

    load: LoadResult
    replay: ReplayFigures
    apply: ApplyRate
    lag_at_end_of_puts: int
    live_counters: MaterializerCounters | None = None
    """What the live materializer did: how many freezes went ahead of other rollouts' backlog."""
    one_worker_replay: ReplayFigures | None = None
    """With ``replay_in_workers``: the replay by one worker process, timed from its start, not its interpreter's."""
    parallel_replay: ReplayFigures | None = None
    """With ``replay_in_workers``: one worker process per partition, from their start to the last caught up."""


class KafkaTarget:
    """The load's view of the Kafka path: the sink writes, the source freezes."""

    def __init__(self, sink: KafkaTokenSink, source: KafkaTokenSource) -> None:
        self._sink = sink
        self._source = source

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Publish the call's intent through the sink."""
        await self._sink.begin_call(rollout_id, model_call_id)

    async def put(self, entry: TokenEntry) -> None:
        """Publish the entry through the sink."""
        await self._sink.put(entry)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze through the source, which waits for the materializer."""
        return await self._source.freeze(rollout_id)


def _replay(
    bootstrap: str, topic: str, directory: Path, workload: PreparedWorkload
) -> tuple[ReplayFigures, dict[int, int]]:
    """Project the whole topic into an empty directory and time it from consumer start to the last offset."""
    materializer = Materializer(bootstrap, topic, directory)
    high = materializer.high_watermarks()
    started = time.perf_counter()
    materializer.start()
    try:
        deadline = started + _CATCH_UP_TIMEOUT_S
        for partition, end in high.items():
            if end and not materializer.wait_for(
                partition, end - 1, max(0.0, deadline - time.perf_counter())
            ):
                raise ReplayTimeoutError(
                    f"replay of {topic} did not reach offset {end - 1} of partition {partition} "
                    f"within {_CATCH_UP_TIMEOUT_S} s"
                )
        seconds = time.perf_counter() - started
    finally:
        materializer.stop()
    figures = ReplayFigures(
        seconds=seconds,
        events=sum(high.values()),
        puts=workload.puts,
        tokens=workload.tokens,
        disk_bytes=directory_bytes(directory),
    )
    return figures, high


def _replay_in_workers(
    bootstrap: str,
    topic: str,
    ends: dict[int, int],
    workers: int,
    directory: Path,
    one_process: Path,
    workload: PreparedWorkload,
) -> ReplayFigures:
    """Project the whole topic again with worker processes; the directory must match the replay's byte for byte.

    Each worker is timed from its partitions' assignment, so interpreter start-up is left out; a directory that
    differs from the one-process replay's means the workers' rate is not of the same work, so it is refused.
    """
    figure = measure_workers(bootstrap, topic, ends, workers, directory)
    if directory_contents(directory) != directory_contents(one_process):
        raise WorkersMismatchError(
            f"the replay of {topic} by {workers} workers left {directory} different from the one-process "
            f"replay's {one_process}; the workers' rate is not of the same work"
        )
    return ReplayFigures(
        seconds=figure.seconds,
        events=figure.events,
        puts=workload.puts,
        tokens=workload.tokens,
        disk_bytes=directory_bytes(directory),
    )


def delete_topic(bootstrap: str, topic: str) -> None:
    """Delete a trial's topic so the broker's disk does not fill over a run."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=30).values():
        future.result(timeout=60)


async def warm_up_broker(bootstrap: str) -> None:
    """Write a few events to a throwaway topic, so a fresh broker's coordinator load is not timed."""
    topic = f"tokcap.bench-warmup-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    try:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        try:
            for call in range(10):
                await sink.begin_call("bench-warmup", f"call-{call}")
        finally:
            await sink.close()
    finally:
        await asyncio.to_thread(delete_topic, bootstrap, topic)


async def run_kafka_trial(
    workload: PreparedWorkload,
    bootstrap: str,
    directory: Path,
    sink_kwargs: Mapping[str, Any] | None = None,
    *,
    replay_in_workers: bool = False,
) -> KafkaTrial:
    """Drive the load through a fresh topic with a live materializer, then replay the topic elsewhere.

    ``sink_kwargs`` go to the sink (``wire_deltas``, say). With ``replay_in_workers`` the topic has
    ``WORKER_REPLAY_PARTITIONS`` partitions (one otherwise) and is replayed again by one worker process and by
    one per partition.
    """
    topic = f"tokcap.bench-{uuid.uuid4().hex[:12]}"
    partitions = WORKER_REPLAY_PARTITIONS if replay_in_workers else 1
    ensure_topic(bootstrap, topic, TopicSettings(partitions=partitions))
    try:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, **dict(sink_kwargs or {}))
        source = KafkaTokenSource(bootstrap_servers=bootstrap, store_dir=directory / "live", topic=topic)
        lag: list[int] = []

        def note_lag() -> None:
            """Events in the log the live materializer had not applied when the last put returned."""
            high = source.materializer.high_watermarks()
            applied = source.materializer.applied_offsets()
            lag.append(sum(end - applied.get(partition, 0) for partition, end in high.items()))

        try:
            load = await drive(workload, KafkaTarget(sink, source), note_lag)
            counters = source.materializer.counters()
        finally:
            await sink.close()
            await source.close()
        replay, ends = await asyncio.to_thread(_replay, bootstrap, topic, directory / "replay", workload)
        worker_replays = [
            await asyncio.to_thread(
                _replay_in_workers,
                bootstrap,
                topic,
                ends,
                workers,
                directory / f"replay-{workers}-workers",
                directory / "replay",
                workload,
            )
            for workers in ((1, len(ends)) if replay_in_workers else ())
        ]
        apply = await asyncio.to_thread(measure_apply_rate, bootstrap, topic, ends, directory / "apply")
    finally:
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return KafkaTrial(
        load=load,
        replay=replay,
        apply=apply,
        lag_at_end_of_puts=lag[0],
        live_counters=counters,
        one_worker_replay=worker_replays[0] if worker_replays else None,
        parallel_replay=worker_replays[1] if worker_replays else None,
    )
