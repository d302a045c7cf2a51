"""A freeze over Kafka answers as of its own log position, so a write that raced it keeps its drop from succeeding."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap
from confluent_kafka import Consumer, TopicPartition
from factories import make_entry

from tokcap.protocols import TokenCaptureSnapshot
from transports.kafka import KafkaTokenSink, KafkaTokenSource, Materializer

pytestmark = pytest.mark.kafka


def _wait_for_end_offset(bootstrap: str, topic: str, end: int) -> None:
    """Block until partition 0 of ``topic`` holds ``end`` messages: the freeze has been published."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "drop-guard-watcher"})
    try:
        deadline = time.monotonic() + 60
        while consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1] < end:
            assert time.monotonic() < deadline, "the freeze was never published"
            time.sleep(0.05)
    finally:
        consumer.close()


async def _freeze_raced_by_a_late_write(
    bootstrap: str, topic: str, store_dir: Path
) -> tuple[TokenCaptureSnapshot, bool, Materializer]:
    first = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, writer_id="server-a")
    other = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, writer_id="server-b")
    source = KafkaTokenSource(
        bootstrap_servers=bootstrap,
        topic=topic,
        store_dir=store_dir,
        external_materializer=True,
        timeout_s=60,
    )
    materializer = Materializer(bootstrap, topic, store_dir)
    try:
        await first.put(make_entry("r1", "c1"))
        freezing = asyncio.create_task(source.freeze("r1"))
        await asyncio.to_thread(_wait_for_end_offset, bootstrap, topic, 2)
        # The materializer has not run yet: this sink is told nothing of the freeze and gets its acks.
        await other.begin_call("r1", "late")
        await other.put(make_entry("r1", "late"))
        materializer.start()
        snapshot = await freezing
        dropped = await source.drop("r1", snapshot.snapshot_id, snapshot.version)
        return snapshot, dropped, materializer
    finally:
        await first.close()
        await other.close()
        await source.close()
        materializer.stop()


def test_a_write_that_raced_the_freeze_keeps_the_snapshot_from_being_dropped(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    snapshot, dropped, materializer = asyncio.run(
        _freeze_raced_by_a_late_write(kafka_bootstrap, kafka_topic, store_dir)
    )
    assert [entry.model_call_id for entry in snapshot.entries] == ["c1"]
    assert snapshot.version == 2  # Gym's counting: one for the entry, one for the freeze
    assert dropped is False
    store = materializer.store
    assert [entry.model_call_id for entry in store.read_entries("r1")] == ["c1"]
    state = store.read_state("r1")
    assert not state.retired and state.version == 4
    assert [(r.event_type, r.model_call_id) for r in state.rejections] == [
        ("intent", "late"),
        ("put", "late"),
    ]

    completed = tokcap(
        "log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "r1", "--json"
    )
    assert completed.returncode == 0, completed.stderr
    events: list[dict[str, Any]] = completed.json()["events"]
    assert [(e["event_type"], e["model_call_id"], e["decision"]) for e in events] == [
        ("put", "c1", "accepted"),
        ("freeze", "", "accepted"),
        ("intent", "late", "rejected-after-freeze"),
        ("put", "late", "rejected-after-freeze"),
        ("drop", "", "no-op"),
    ]
    assert events[1]["version"] == 2 and events[3]["version"] == 4
