"""The Kafka lineage resolver against a real broker: Gym's middleware and tokcap's capture path link calls."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from gym_rollouts import drive, tool_use_rollout
from gym_wheel import GymModules
from test_gym_lineage import EXPECTED_PARENTS, drive_with_tokcap

from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.wire.partitioner import partition_of_rollout

pytestmark = pytest.mark.kafka


def _expected() -> dict[str, tuple[str | None, str]]:
    return {call: (parent, "resolved" if parent else "root") for call, parent in EXPECTED_PARENTS.items()}


async def _parents(source: KafkaTokenSource, rollout_id: str) -> dict[str, tuple[str | None, str | None]]:
    snapshot = await source.freeze(rollout_id)
    return {e.model_call_id: (e.parent_call_id, e.parent_resolution) for e in snapshot.entries}


def test_gyms_middleware_with_the_kafka_resolver_links_every_call_of_a_tool_use_rollout(
    gym: GymModules, kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("lineage-gym", partitions=4)

    async def run() -> dict[str, tuple[str | None, str | None]]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic)
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=topic)
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=topic, store_dir=tmp_path)
        try:
            await drive(gym, tool_use_rollout("r-kafka-gym"), sink, resolver)
            return await _parents(source, "r-kafka-gym")
        finally:
            await asyncio.gather(sink.close(), resolver.close(), source.close())

    assert asyncio.run(run()) == _expected()


class _FreshResolverEachCall:
    """A resolver built anew for every request, as a worker that never saw the earlier puts would be."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._bootstrap, self._topic = bootstrap, topic

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        resolver = KafkaLineageResolver(bootstrap_servers=self._bootstrap, topic=self._topic)
        try:
            return await resolver.resolve(rollout_id, request_items)
        finally:
            await resolver.close()

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        return None


def test_tokcaps_capture_path_links_calls_over_kafka_with_a_fresh_resolver_for_every_call(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("lineage-fresh", partitions=3)

    async def run() -> dict[str, tuple[str | None, str | None]]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic)
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=topic, store_dir=tmp_path)
        try:
            await drive_with_tokcap(
                tool_use_rollout("r-kafka-fresh"), sink, _FreshResolverEachCall(kafka_bootstrap, topic)
            )
            return await _parents(source, "r-kafka-fresh")
        finally:
            await asyncio.gather(sink.close(), source.close())

    assert asyncio.run(run()) == _expected()


def test_a_dropped_rollout_resolves_no_parent_over_kafka(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-kafka-drop")

    async def run() -> tuple[str, str]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            await drive(gym, rollout, sink, resolver)
            before = await resolver.resolve(rollout.rollout_id, rollout.calls[-1].request)
            snapshot = await source.freeze(rollout.rollout_id)
            assert await source.drop(rollout.rollout_id, snapshot.snapshot_id, snapshot.version)
            after = await resolver.resolve(rollout.rollout_id, rollout.calls[-1].request)
            return str(before.status.value), str(after.status.value)
        finally:
            await asyncio.gather(sink.close(), resolver.close(), source.close())

    assert asyncio.run(run()) == ("resolved", "unresolved")


@pytest.mark.parametrize("partitioner", ["consistent_random", "murmur2_random", "fnv1a_random"])
def test_the_resolver_computes_the_partition_the_producer_chose_for_every_key(
    kafka_bootstrap: str, kafka_topic_factory: Any, partitioner: str
) -> None:
    topic = kafka_topic_factory(f"partitioner-{partitioner}", partitions=7)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": partitioner})
    chosen: dict[str, int] = {}
    keys = [f"rollout-{n}.attempt_{n % 3}" for n in range(60)]
    for key in keys:
        producer.produce(
            topic,
            key=key.encode(),
            value=b"x",
            on_delivery=lambda _e, m: chosen.update({m.key().decode(): m.partition()}),
        )
    assert producer.flush(30) == 0
    assert {key: partition_of_rollout(key, 7, partitioner) for key in keys} == chosen
