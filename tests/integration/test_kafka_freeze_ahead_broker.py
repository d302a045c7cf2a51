"""A real broker: a trainer's batch of freezes is answered ahead of the rollouts' backlog, and every answer is
the snapshot the store holds once the materializer caught up; an answer memory does not hold still gives the
right snapshot, from the files after the apply."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from store_contract import make_entry

from tokcap.files.log_projection import Projection
from tokcap.protocols import TokenCaptureSnapshot
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka

ROLLOUTS = 24


async def write_then_freeze_all(
    bootstrap: str, topic: str, store_dir: Path
) -> tuple[list[TokenCaptureSnapshot], list[TokenCaptureSnapshot], int]:
    """Write every rollout, freeze them all at once; the answers, the store's snapshots after, the ahead count."""
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    try:
        rollouts = [f"rollout-{n}" for n in range(ROLLOUTS)]
        for call in range(3):
            for rollout_id in rollouts:
                await sink.begin_call(rollout_id, f"c{call}")
            await asyncio.gather(*(sink.put(make_entry(r, f"c{call}", tokens=200 + call)) for r in rollouts))
        await sink.begin_call(rollouts[0], "lost")
        answers = await asyncio.gather(*(source.freeze(rollout_id) for rollout_id in rollouts))
        assert source.materializer.wait_until_caught_up(60)
        store = source.store
        stored = []
        for answer in answers:
            state = store.read_state(answer.rollout_id)
            position = next(a.position for a in state.freeze_answers)
            stored.append(store.snapshot(answer.rollout_id, as_of=position))
        return answers, stored, source.materializer.counters().freezes_answered_ahead
    finally:
        await sink.close()
        await source.close()


def test_a_batch_of_freezes_is_answered_ahead_and_each_answer_is_the_snapshot_the_store_then_holds(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory()
    answers, stored, ahead = asyncio.run(write_then_freeze_all(kafka_bootstrap, topic, tmp_path))
    assert answers == stored
    assert [len(answer.entries) for answer in answers] == [3] * ROLLOUTS
    assert answers[0].incomplete and not any(answer.incomplete for answer in answers[1:])
    assert ahead == ROLLOUTS


def test_a_freeze_whose_answer_memory_does_not_hold_waits_for_its_apply_and_gets_the_same_snapshot(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory()

    def forgotten(self: Projection, rollout_id: str, state: object) -> None:
        """No rollout's entries are all kept: every snapshot is read from the files."""

    with mock.patch.object(Projection, "_kept", forgotten):
        answers, stored, _ = asyncio.run(write_then_freeze_all(kafka_bootstrap, topic, tmp_path))
    assert answers == stored
    assert [len(answer.entries) for answer in answers] == [3] * ROLLOUTS
