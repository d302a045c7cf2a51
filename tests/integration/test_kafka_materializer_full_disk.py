"""The materializer's own disk fills up: it stops with a clear error, its checkpoint never runs ahead of what it
wrote, and once space returns it resumes to the same bytes as a clean replay.

The disk is a real tmpfs of a few pages, mounted by the test (it needs root, as CI runs it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_contract import directory_contents, make_entry
from tmpfs import fill, mounted_tmpfs

from tests.topic_replay import replay_topic
from tokcap.errors import TokcapError
from transports.kafka import KafkaTokenSink
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.checkpoint import applied_next_offset

pytestmark = pytest.mark.kafka


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "2m") as mount_point:
        yield mount_point


def write(bootstrap: str, topic: str, rollouts: range, calls: int, tokens: int) -> None:
    async def run() -> None:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        try:
            for index in rollouts:
                for call in range(calls):
                    await sink.begin_call(f"r{index}", f"c{call}")
                    await sink.put(make_entry(f"r{index}", f"c{call}", tokens=tokens))
        finally:
            await sink.close()

    asyncio.run(run())


def files_but_locks(store_dir: Path) -> dict[str, bytes]:
    return {name: data for name, data in directory_contents(store_dir).items() if not name.endswith(".lock")}


def test_a_full_disk_stops_the_materializer_clearly_and_it_resumes_byte_identical_once_space_returns(
    kafka_bootstrap: str, kafka_topic: str, small_disk: Path, tmp_path: Path
) -> None:
    store_dir = small_disk / "store"
    write(kafka_bootstrap, kafka_topic, range(4), calls=2, tokens=20)
    first = Materializer(kafka_bootstrap, kafka_topic, store_dir)
    first.start()
    try:
        assert first.wait_until_caught_up(60)
    finally:
        first.stop()
    applied_before = applied_next_offset(store_dir, kafka_topic, 0)
    assert applied_before == 16

    write(kafka_bootstrap, kafka_topic, range(4, 40), calls=3, tokens=400)
    filler = small_disk / "filler"
    fill(filler, room=8192)
    full = Materializer(kafka_bootstrap, kafka_topic, store_dir)
    with pytest.raises(TokcapError) as caught:
        full.start()
        full.wait_until_caught_up(120)
    full.stop()
    message = str(caught.value)
    assert "No space left on device" in message or "errno 28" in message or "ENOSPC" in message, message
    stopped_at = applied_next_offset(store_dir, kafka_topic, 0)
    assert applied_before <= stopped_at < 16 + 36 * 6, "the materializer applied everything on a full disk"

    filler.unlink()
    resumed = Materializer(kafka_bootstrap, kafka_topic, store_dir)
    resumed.start()
    try:
        assert resumed.wait_until_caught_up(120)
    finally:
        resumed.stop()
    replay_topic(kafka_bootstrap, kafka_topic, tmp_path / "clean")
    after, clean = files_but_locks(store_dir), files_but_locks(tmp_path / "clean")
    differing = sorted(name for name in after.keys() | clean.keys() if after.get(name) != clean.get(name))
    assert differing == [], differing[:5]
