"""The partition a source computes for a rollout is the one a real produce of that rollout landed on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokcap.log.events import FreezeEvent
from transports.kafka.client.producer_bridge import ProducerBridge
from transports.kafka.wire.codec import encode_event_messages
from transports.kafka.wire.partitioner import DEFAULT_PARTITIONER, partition_of_rollout, partitioner_of

pytestmark = pytest.mark.kafka

_ROLLOUTS = [f"rollout-{n}" for n in range(150)] + ["a", "ab", "abc", "abcd", "r.x:y@z+w=v,u~t", "x" * 97]


async def _landed_on(bootstrap: str, topic: str, producer_config: dict[str, Any]) -> dict[str, int]:
    """Produce one freeze per rollout through the bridge every tokcap sink and source uses."""
    bridge = ProducerBridge(bootstrap, producer_config=producer_config)
    try:
        landed = {}
        for rollout_id in _ROLLOUTS:
            event = FreezeEvent(rollout_id=rollout_id, writer="partitioner-test")
            messages = encode_event_messages(event, next_chunk_group=lambda: "never")
            (delivered,) = await bridge.send(topic, messages, what="put")
            landed[rollout_id] = delivered.partition
        return landed
    finally:
        bridge.close()


@pytest.mark.parametrize(
    "producer_config", [{}, {"partitioner": "murmur2_random"}, {"partitioner": "fnv1a_random"}]
)
def test_the_computed_partition_of_every_rollout_is_where_a_real_produce_landed(
    kafka_bootstrap: str, kafka_topic_factory: Any, producer_config: dict[str, Any]
) -> None:
    partitions = 7
    topic = kafka_topic_factory("partitioner", partitions=partitions)
    landed = asyncio.run(_landed_on(kafka_bootstrap, topic, producer_config))
    partitioner = partitioner_of(producer_config)
    assert partitioner == producer_config.get("partitioner", DEFAULT_PARTITIONER)
    computed = {
        rollout_id: partition_of_rollout(rollout_id, partitions, partitioner) for rollout_id in _ROLLOUTS
    }
    assert computed == landed
    assert len(set(landed.values())) == partitions
