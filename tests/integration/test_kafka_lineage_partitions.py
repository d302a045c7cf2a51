"""The Kafka lineage resolver on a real broker: a call waits only for its own partition to be read."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tokcap.lineage import LineageResolution, stamp_continuation
from tokcap.log.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from transports.kafka import KafkaTokenSink
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.wire.partitioner import partition_of_rollout

pytestmark = pytest.mark.kafka

REQUEST: list[dict[str, Any]] = [{"role": "user", "content": "task"}]


def _root(rollout_id: str) -> TokenEntry:
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=f"{rollout_id}-root",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5, -0.25],
        output_items=[{"role": "assistant", "content": f"answer of {rollout_id}"}],
    )
    stamp_continuation(entry, REQUEST)
    stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    return entry


def _continuation(rollout_id: str) -> list[dict[str, Any]]:
    return [
        *REQUEST,
        {"role": "assistant", "content": f"answer of {rollout_id}"},
        {"role": "user", "content": "go on"},
    ]


def _rollouts_on(partition: int, partitions: int, count: int) -> list[str]:
    """The first ``count`` rollout ids the sink's default partitioner sends to ``partition``."""
    found = (f"r-{n}" for n in range(10_000))
    return [r for r in found if partition_of_rollout(r, partitions, "consistent_random") == partition][:count]


class _HeldOnOnePartition(KafkaLineageResolver):
    """Takes the held partition's end to be one message past what is written: its calls wait for one more."""

    def __init__(self, held: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.held = held
        self.held_end_asked = threading.Event()
        self._asked_ends_of = self._reader._ends_of
        self._reader._ends_of = self._ends_of  # type: ignore[method-assign]

    def _ends_of(self, partitions: frozenset[int]) -> dict[int, int]:
        ends = self._asked_ends_of(partitions)
        if self.held in ends:
            ends[self.held] += 1
            self.held_end_asked.set()
        return ends


def test_a_call_whose_partition_is_read_answers_while_a_call_on_another_partition_still_waits_for_its_data(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory("lineage-partitions", partitions=2)
    (answered,) = _rollouts_on(0, 2, 1)
    held, release = _rollouts_on(1, 2, 2)

    async def run() -> tuple[bool, LineageResolution, LineageResolution]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic)
        resolver = _HeldOnOnePartition(1, bootstrap_servers=kafka_bootstrap, topic=topic, timeout_s=20)
        try:
            await sink.put(_root(answered))
            await sink.put(_root(held))
            waiting = asyncio.ensure_future(
                asyncio.to_thread(resolver.resolve_now, held, _continuation(held))
            )
            assert await asyncio.to_thread(resolver.held_end_asked.wait, 30)
            other = await resolver.resolve(answered, _continuation(answered))
            held_done_first = waiting.done()
            await sink.put(_root(release))  # the one more message the held call waits for
            return held_done_first, other, await waiting
        finally:
            await asyncio.gather(sink.close(), resolver.close())

    held_done_first, other, outcome = asyncio.run(run())
    assert not held_done_first
    assert other.match is not None and other.match.model_call_id == f"{answered}-root"
    assert outcome.match is not None and outcome.match.model_call_id == f"{held}-root"
