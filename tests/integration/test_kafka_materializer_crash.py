"""A materializer process killed at random points resumes exactly: the end state equals a clean replay."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from store_contract import directory_contents, make_entry

from tokcap.events import CancelEvent, DeleteEvent, DropEvent, Event, FreezeEvent, IntentEvent, RetireEvent
from transports.kafka import KafkaTokenSink, Materializer
from transports.kafka.checkpoint import applied_next_offset
from transports.kafka.codec import encode_event_messages
from transports.kafka.producer_bridge import Delivered, ProducerBridge

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PARTITIONS = 3


async def write_long_topic(bootstrap: str, topic: str, rollouts: int) -> None:
    """Publish a long mixed log directly, commands included, without waiting for any materializer."""
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=2048)
    commands = ProducerBridge(bootstrap)

    async def command(event: Event) -> Delivered:
        messages = encode_event_messages(event, next_chunk_group=lambda: "unused:0")
        (delivered,) = await commands.send(topic, messages, what=event.type.value)
        return delivered

    async def one_rollout(index: int) -> None:
        rid = f"crash-{index}"
        await sink.begin_call(rid, "c0")
        for call in range(4):
            await sink.put(make_entry(rid, f"c{call}", tokens=20 + call))
        await sink.put(make_entry(rid, "big", tokens=1200 + index))
        if index % 3 == 0:
            await sink.begin_call(rid, "dangling")
        if index % 4 == 0:
            await sink.mark_incomplete(rid, "c9", "lost")
        frozen = await command(FreezeEvent(rollout_id=rid))
        if index % 2 == 0:
            await sink.put(make_entry(rid, "late"))
        snapshot_id = f"{topic}:{frozen.partition}:{frozen.offset}"
        await command(DropEvent(rollout_id=rid, snapshot_id=snapshot_id, version=1))
        if index % 5 == 1:
            await command(RetireEvent(rollout_id=rid))
        if index % 5 == 2:
            await command(DeleteEvent(rollout_id=rid))
            await sink.put(make_entry(rid, "reused"))
            await command(FreezeEvent(rollout_id=rid))

    try:
        await asyncio.gather(*(one_rollout(index) for index in range(rollouts)))
    finally:
        await sink.close()
        commands.close()


def high_watermarks(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        }
    finally:
        consumer.close()


def checkpointed(store_dir: Path, topic: str) -> dict[int, int]:
    """The next offset each partition's checkpoint names (0 when there is none yet)."""
    return {partition: applied_next_offset(store_dir, topic, partition) for partition in range(PARTITIONS)}


def start_process(bootstrap: str, topic: str, store_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start a materializer process logging to ``log``; return once it has assigned its partitions."""
    command = [sys.executable, "-m", "transports.kafka.materializer", "--bootstrap", bootstrap]
    command += ["--topic", topic, "--dir", str(store_dir)]
    with log.open("ab") as handle:
        start = handle.tell()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle)
    deadline = time.monotonic() + 60
    while b"materializer ready" not in log.read_bytes()[start:]:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return process


def test_a_materializer_killed_at_random_points_ends_byte_identical_to_a_clean_replay(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("crash", partitions=PARTITIONS)
    asyncio.run(write_long_topic(kafka_bootstrap, topic, rollouts=200))
    end = high_watermarks(kafka_bootstrap, topic)
    crashed = tmp_path / "crashed"
    log = tmp_path / "materializer.log"
    rng = random.Random(11)
    progress_seen: list[dict[int, int]] = []
    total = sum(end.values())
    for _ in range(10):
        process = start_process(kafka_bootstrap, topic, crashed, log)
        # Kill at a random point of the remaining log: wait for a random amount of progress, then a random
        # few milliseconds more, so kills land mid-batch and between batches however fast the machine is.
        already = sum(checkpointed(crashed, topic).values())
        target = already + rng.uniform(0.05, 0.5) * (total - already)
        deadline = time.monotonic() + 10
        while sum(checkpointed(crashed, topic).values()) < target and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        progress_seen.append(checkpointed(crashed, topic))
        if progress_seen[-1] == end:
            break
    assert progress_seen[0] != end, "the first kill must land before the end of the topic"
    run_to_the_end(kafka_bootstrap, topic, crashed, log, end)
    clean = tmp_path / "clean"
    replay_cleanly(kafka_bootstrap, topic, clean)
    assert directory_contents(crashed) == directory_contents(clean)


def run_to_the_end(bootstrap: str, topic: str, store_dir: Path, log: Path, end: dict[int, int]) -> None:
    """Let one last materializer process apply the rest of the log, then stop it cleanly."""
    process = start_process(bootstrap, topic, store_dir, log)
    deadline = time.monotonic() + 180
    while checkpointed(store_dir, topic) != end and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()[-3000:]
    assert checkpointed(store_dir, topic) == end


def replay_cleanly(bootstrap: str, topic: str, store_dir: Path) -> None:
    """Replay the whole topic into an empty directory with an in-process materializer that is never killed."""
    materializer = Materializer(bootstrap, topic, store_dir)
    materializer.start()
    try:
        assert materializer.wait_until_caught_up(180)
    finally:
        materializer.stop()


def files_but_locks(store_dir: Path) -> dict[str, bytes]:
    """Every file's bytes by name, lock files left out (they hold no state)."""
    return {name: data for name, data in directory_contents(store_dir).items() if not name.endswith(".lock")}


async def write_lifecycle_topic(bootstrap: str, topic: str, rollouts: int) -> None:
    """Every event kind, for many rollouts at once.

    Intents closed by cancels (adjacent, and apart), chunked puts, dangling intents, incomplete marks,
    freezes, late writes, drops that succeed and drops that must fail, retires, and deletes followed by
    reuse of the id.
    """
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=2048)
    commands = ProducerBridge(bootstrap)

    async def command(event: Event) -> Delivered:
        messages = encode_event_messages(event, next_chunk_group=lambda: "unused:0")
        (delivered,) = await commands.send(topic, messages, what=event.type.value)
        return delivered

    async def intent_then_cancel(rid: str, call_id: str) -> None:
        """A call that ends before generation, its two events adjacent in the partition (one produce batch)."""
        pair = [
            IntentEvent(rollout_id=rid, model_call_id=call_id),
            CancelEvent(rollout_id=rid, model_call_id=call_id),
        ]
        messages = [
            m for event in pair for m in encode_event_messages(event, next_chunk_group=lambda: "unused:0")
        ]
        await commands.send(topic, messages, what="intent and cancel")

    async def one_rollout(index: int) -> None:
        rid = f"life-{index}"
        await sink.begin_call(rid, "c0")
        await sink.put(make_entry(rid, "c0", tokens=10))
        await intent_then_cancel(rid, "c1")
        await sink.begin_call(rid, "c2")
        await sink.cancel_call(rid, "c2")
        await sink.begin_call(rid, "big")
        await sink.put(make_entry(rid, "big", tokens=1200 + index))
        if index % 3 == 0:
            await sink.begin_call(rid, "dangling")
        if index % 4 == 0:
            await sink.mark_incomplete(rid, "c9", "lost")
        frozen = await command(FreezeEvent(rollout_id=rid))
        if index % 2 == 0:
            await sink.put(make_entry(rid, "late"))
        snapshot_id = f"{topic}:{frozen.partition}:{frozen.offset}"
        await command(DropEvent(rollout_id=rid, snapshot_id=snapshot_id, version=1))
        if index % 5 == 1:
            await command(RetireEvent(rollout_id=rid))
        if index % 5 == 2:
            await command(DeleteEvent(rollout_id=rid))
            await sink.begin_call(rid, "reused")
            await sink.put(make_entry(rid, "reused", tokens=1500))
            await command(FreezeEvent(rollout_id=rid))

    try:
        await asyncio.gather(*(one_rollout(index) for index in range(rollouts)))
    finally:
        await sink.close()
        commands.close()


KILL_CYCLES = 50


def test_a_materializer_killed_fifty_times_mid_batch_ends_byte_identical_to_a_clean_replay(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("killloop", partitions=PARTITIONS)
    asyncio.run(write_lifecycle_topic(kafka_bootstrap, topic, rollouts=600))
    end = high_watermarks(kafka_bootstrap, topic)
    crashed = tmp_path / "crashed"
    log = tmp_path / "materializer.log"
    kills_before_the_end = 0
    rng = random.Random(50)
    for _ in range(KILL_CYCLES):
        process = start_process(kafka_bootstrap, topic, crashed, log)
        # Kill once the process has checkpointed one batch of its own, a random moment into the next batch:
        # inside its deferred-durability block, whose applied events are not yet checkpointed. Any moment
        # must do; the randomness only spreads the kills over the block.
        before = checkpointed(crashed, topic)
        while before != end and checkpointed(crashed, topic) == before and process.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL, log.read_text()[-3000:]
        kills_before_the_end += checkpointed(crashed, topic) != end
    assert kills_before_the_end > 0, "no kill landed before the end of the topic"
    run_to_the_end(kafka_bootstrap, topic, crashed, log, end)
    clean = tmp_path / "clean"
    replay_cleanly(kafka_bootstrap, topic, clean)
    resumed, replayed = files_but_locks(crashed), files_but_locks(clean)
    differing = sorted(
        name for name in resumed.keys() | replayed.keys() if resumed.get(name) != replayed.get(name)
    )
    assert differing == [], {name: (resumed.get(name), replayed.get(name)) for name in differing[:3]}
