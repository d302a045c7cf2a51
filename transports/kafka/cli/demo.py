"""``tokcap demo --bootstrap``: the demo workload over Kafka sinks, a Kafka source and its materializer.

The workload, its faults and its report are the core demo's (``tokcap.cli.demo``); only the sinks, the
source and the lineage resolvers differ, as they would between a file-store run and a Kafka run of a trainer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tokcap.cli.demo import (
    DemoReport,
    DemoSettings,
    ProgressCallback,
    RolloutOutcome,
    run_workload,
    store_directory,
)
from tokcap.errors import InvalidInputError
from transports.kafka.client.admin import probe_broker
from transports.kafka.client.topics import TopicSettings, ensure_topic, topic_for_run
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource

__all__ = ["run_demo_over_kafka"]


def run_demo_over_kafka(
    settings: DemoSettings,
    bootstrap: str,
    run_id: str,
    *,
    servers: int = 3,
    partitions: int = 3,
    directory: Path | None = None,
    keep: bool = False,
    on_progress: ProgressCallback | None = None,
    broker_timeout_s: float = 10.0,
) -> DemoReport:
    """The same workload with one Kafka sink per simulated model server and a Kafka source.

    The source runs an in-process materializer that projects the run topic into the store directory.
    The run topic must not exist yet, so the demo never mixes with an earlier run.
    """
    if servers < 1:
        raise InvalidInputError(f"--servers must be at least 1, got {servers}")
    topic = topic_for_run(run_id)
    probe_broker(bootstrap, timeout_s=broker_timeout_s)
    if not ensure_topic(bootstrap, topic, TopicSettings(partitions=partitions)):
        raise InvalidInputError(
            f"topic {topic!r} already exists; pick a new --run (the demo writes a fresh run), "
            f"or delete it with `tokcap topic delete --run {run_id} --bootstrap {bootstrap}`"
        )
    with store_directory(directory, keep) as store_dir:

        async def run() -> tuple[list[RolloutOutcome], float, float]:
            sinks = [
                KafkaTokenSink(
                    bootstrap_servers=bootstrap,
                    run_id=run_id,
                    writer_id=f"demo-server-{number}",
                )
                for number in range(servers)
            ]
            source = KafkaTokenSource(
                bootstrap_servers=bootstrap,
                run_id=run_id,
                store_dir=store_dir.path,
                writer_id="demo-trainer",
            )
            # Each simulated server resolves parents from the topic, as its model server would.
            resolvers = [
                KafkaLineageResolver(bootstrap_servers=bootstrap, run_id=run_id) for _ in range(servers)
            ]
            try:
                return await run_workload(
                    settings,
                    lambda index: sinks[index % servers],
                    source,
                    on_progress,
                    lambda index: resolvers[index % servers],
                )
            finally:
                for sink in sinks:
                    await sink.close()
                for resolver in resolvers:
                    await resolver.close()
                await source.close()

        outcomes, capture_s, finalize_s = asyncio.run(run())
        return DemoReport(
            transport="kafka",
            store_dir=str(store_dir.path),
            store_kept=store_dir.keep,
            settings=settings,
            capture_seconds=capture_s,
            finalize_seconds=finalize_s,
            rollouts=outcomes,
            topic=topic,
            bootstrap=bootstrap,
            servers=servers,
        )
