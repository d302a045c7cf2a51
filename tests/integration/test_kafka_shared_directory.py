"""Many sources on one directory: one owner materializes it, the others follow, and a follower takes over."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from factories import make_entry
from test_kafka_external_materializer import start_materializer_process

from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.materializer.shared_materializers import shared_materializers

pytestmark = pytest.mark.kafka


async def _many_sources_in_one_process(bootstrap: str, topic: str, store_dir: Path) -> list[int]:
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    sources = [
        KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir, timeout_s=30)
        for _ in range(4)
    ]
    try:
        assert len({id(source.materializer) for source in sources}) == 1
        versions = []
        for n, source in enumerate(sources):
            await sink.put(make_entry(f"r{n}", "c1"))
            snapshot = await source.freeze(f"r{n}")
            versions.append(snapshot.version)
        await sources[0].close()
        # The first source owned nothing alone: the others keep answering after it closed.
        await sink.put(make_entry("after-close", "c1"))
        snapshot = await sources[1].freeze("after-close")
        assert [entry.model_call_id for entry in snapshot.entries] == ["c1"]
        return versions
    finally:
        await sink.close()
        for source in sources:
            await source.close()


def test_every_source_of_a_process_on_one_directory_shares_one_materializer_until_the_last_closes(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    versions = asyncio.run(_many_sources_in_one_process(kafka_bootstrap, kafka_topic, tmp_path / "store"))
    assert versions == [2, 2, 2, 2]
    # Once every source closed, the directory is free again.
    materializer = shared_materializers.acquire(kafka_bootstrap, kafka_topic, tmp_path / "store")
    assert materializer is not None
    shared_materializers.release(materializer)


async def _follow_then_take_over(
    bootstrap: str, topic: str, store_dir: Path, owner_log: Path
) -> tuple[bool, bool]:
    owner = start_materializer_process(bootstrap, topic, store_dir, owner_log)
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir, timeout_s=20)
    try:
        following = source._materializer is None
        await sink.put(make_entry("r1", "c1"))
        first = await source.freeze("r1")
        assert [entry.model_call_id for entry in first.entries] == ["c1"]
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        await sink.put(make_entry("r2", "c1"))
        second = await source.freeze("r2")
        assert [entry.model_call_id for entry in second.entries] == ["c1"]
        return following, source._materializer is not None
    finally:
        if owner.poll() is None:
            owner.kill()
        await sink.close()
        await source.close()


def test_a_source_follows_another_processs_materializer_and_takes_over_when_it_dies(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    following, owns_now = asyncio.run(
        _follow_then_take_over(kafka_bootstrap, kafka_topic, tmp_path / "store", tmp_path / "owner.log")
    )
    assert following and owns_now
