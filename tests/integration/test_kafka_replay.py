"""Replaying a run topic into an empty directory reproduces the store byte for byte."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from store_contract import directory_contents, make_entry

from tests.topic_replay import replay_topic
from tokcap.errors import RolloutRetiredError
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka


async def mixed_run(bootstrap: str, topic: str, store_dir: Path, rollouts: int = 12) -> None:
    """Several rollouts through two sinks: entries, intents, cancels, conflicts, late writes, drops, retire, delete."""
    sinks = [KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=2048) for _ in range(2)]
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    try:
        for index in range(rollouts):
            rid = f"rollout-{index}"
            sink = sinks[index % 2]
            await sink.begin_call(rid, "c0")
            await asyncio.gather(
                *(sink.put(make_entry(rid, f"c{call}", tokens=40 + call)) for call in range(4))
            )
            await sinks[1 - index % 2].put(make_entry(rid, "c1", salt=9))
            await sink.put(make_entry(rid, "big", tokens=1500))
            if index % 3 == 0:
                await sink.begin_call(rid, "dangling")
            if index % 4 == 1:
                await sink.begin_call(rid, "cancelled")
                await sink.cancel_call(rid, "cancelled")
            snapshot = await source.freeze(rid)
            if index % 2 == 0:
                await sink.put(make_entry(rid, "late"))
            await source.drop(rid, snapshot.snapshot_id, snapshot.version)
            if index % 5 == 2:
                await source.retire([rid])
            if index % 5 == 3:
                await source.delete([rid])
                await sink.put(make_entry(rid, "reused"))
                await source.freeze(rid)
        await source.delete(["rollout-0"])
        await sinks[0].mark_incomplete("rollout-1", "c7", "lost")
        with pytest.raises(RolloutRetiredError):
            await source.freeze("rollout-2")
        assert source.materializer.wait_until_caught_up(60)
    finally:
        for sink in sinks:
            await sink.close()
        await source.close()


def test_replaying_a_mixed_run_into_an_empty_directory_gives_byte_identical_files(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("replay", partitions=3)
    live = tmp_path / "live"
    asyncio.run(mixed_run(kafka_bootstrap, topic, live))
    replayed = tmp_path / "replayed"
    replay_topic(kafka_bootstrap, topic, replayed)
    live_files, replayed_files = directory_contents(live), directory_contents(replayed)
    assert sorted(live_files) == sorted(replayed_files)
    assert live_files == replayed_files
    assert any(name.endswith(".tokens.state.json") for name in live_files)
    assert any(name.startswith("kafka-checkpoint-p") for name in live_files)


def test_two_directories_fed_by_the_same_topic_end_identical(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("two-dirs", partitions=2)
    asyncio.run(mixed_run(kafka_bootstrap, topic, tmp_path / "live", rollouts=4))
    replay_topic(kafka_bootstrap, topic, tmp_path / "a")
    replay_topic(kafka_bootstrap, topic, tmp_path / "b")
    assert directory_contents(tmp_path / "a") == directory_contents(tmp_path / "b")
