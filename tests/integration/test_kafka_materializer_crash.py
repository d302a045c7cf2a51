"""A materializer process killed at random points resumes exactly: the end state equals a clean replay."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from conversations import conversation
from store_contract import directory_contents, make_entry

from tests.topic_replay import replay_topic
from tokcap.log.events import (
    CancelEvent,
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IntentEvent,
    RetireEvent,
)
from transports.kafka import KafkaTokenSink
from transports.kafka.client.producer_bridge import Delivered, ProducerBridge
from transports.kafka.materializer.checkpoint import applied_next_offset
from transports.kafka.timeline import read_log
from transports.kafka.wire.codec import (
    ENCODING_DELTA,
    HEADER_ENCODING,
    encode_event_messages,
    headers_to_dict,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PARTITIONS = 3


class TopicWriter:
    """Writes a log directly: capture events through a sink, commands without waiting for any materializer."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=2048)
        self._commands = ProducerBridge(bootstrap)

    async def send(self, *events: Event) -> list[Delivered]:
        """Produce the events in one batch, so they are adjacent in their partition."""
        messages = [
            m for event in events for m in encode_event_messages(event, next_chunk_group=lambda: "u:0")
        ]
        return await self._commands.send(self.topic, messages, what="events")

    async def finish(self, rid: str, index: int) -> None:
        """A chunked put; a dangling intent or an incomplete mark on some rollouts; freeze; a late write on
        even rollouts; drop version 1; retire some, delete and reuse others."""
        await self.sink.begin_call(rid, "big")
        await self.sink.put(make_entry(rid, "big", tokens=1200 + index))
        if index % 3 == 0:
            await self.sink.begin_call(rid, "dangling")
        if index % 4 == 0:
            await self.sink.mark_incomplete(rid, "c9", "lost")
        (frozen,) = await self.send(FreezeEvent(rollout_id=rid))
        if index % 2 == 0:
            await self.sink.put(make_entry(rid, "late"))
        snapshot_id = f"{self.topic}:{frozen.partition}:{frozen.offset}"
        await self.send(DropEvent(rollout_id=rid, snapshot_id=snapshot_id, version=1))
        if index % 5 == 1:
            await self.send(RetireEvent(rollout_id=rid))
        if index % 5 == 2:
            await self.send(DeleteEvent(rollout_id=rid))
            await self.sink.put(make_entry(rid, "reused"))
            await self.send(FreezeEvent(rollout_id=rid))

    async def close(self) -> None:
        await self.sink.close()
        self._commands.close()


def write_rollouts(
    bootstrap: str, topic: str, rollouts: int, one_rollout: Callable[[TopicWriter, int], Awaitable[None]]
) -> dict[int, int]:
    """Write every rollout's events at once, so rollouts interleave in the partitions; return the log's end."""

    async def write() -> None:
        writer = TopicWriter(bootstrap, topic)
        try:
            await asyncio.gather(*(one_rollout(writer, index) for index in range(rollouts)))
        finally:
            await writer.close()

    asyncio.run(write())
    return high_watermarks(bootstrap, topic)


async def long_rollout(writer: TopicWriter, index: int) -> None:
    """Puts, then the shared ending."""
    rid = f"crash-{index}"
    sink = writer.sink
    await sink.begin_call(rid, "c0")
    for call in range(4):
        await sink.put(make_entry(rid, f"c{call}", tokens=20 + call))
    await writer.finish(rid, index)


async def lifecycle_rollout(writer: TopicWriter, index: int) -> None:
    """Intents closed by cancels, adjacent in the partition and apart, then the shared ending: every event kind."""
    rid = f"life-{index}"
    sink = writer.sink
    await sink.begin_call(rid, "c0")
    await sink.put(make_entry(rid, "c0", tokens=10))
    await writer.send(
        IntentEvent(rollout_id=rid, model_call_id="c1"), CancelEvent(rollout_id=rid, model_call_id="c1")
    )
    await sink.begin_call(rid, "c2")
    await sink.cancel_call(rid, "c2")
    await writer.finish(rid, index)


async def conversation_rollout(writer: TopicWriter, index: int) -> None:
    """Eight calls, each prompt continuing the last (sent as wire deltas), then the shared ending."""
    rid = f"talk-{index}"
    for entry in conversation(rid, 8, prompt=100, generated=20, tool=10, seed=index):
        await writer.sink.begin_call(rid, entry.model_call_id)
        await writer.sink.put(entry)
    await writer.finish(rid, index)


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


def start_process(
    bootstrap: str, topic: str, store_dir: Path, log: Path, block_messages: int | None = None
) -> subprocess.Popen[bytes]:
    """Start a materializer process logging to ``log``; return once it has assigned its partitions."""
    command = [sys.executable, "-m", "transports.kafka.materializer", "--bootstrap", bootstrap]
    command += ["--topic", topic, "--dir", str(store_dir)]
    if block_messages is not None:
        command += ["--block-messages", str(block_messages)]
    with log.open("ab") as handle:
        start = handle.tell()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle)
    deadline = time.monotonic() + 60
    while b"materializer ready" not in log.read_bytes()[start:]:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return process


KILL_POINT_BLOCK = 200
"""Messages per durable block of the materializers killed at random points."""


def kill_at_a_random_point(
    bootstrap: str, topic: str, crashed: Path, log: Path, rng: random.Random, total: int
) -> None:
    """Start a materializer and SIGKILL it at a random point of the remaining log.

    It waits for a random amount of progress, then a random few milliseconds more, so kills land mid-batch and
    between batches however fast the machine is. Blocks of 200 messages give these short logs many checkpoints
    for that progress to be seen at; the fifty-kill test keeps the default block.
    """
    process = start_process(bootstrap, topic, crashed, log, block_messages=KILL_POINT_BLOCK)
    assert f"blocks of up to {KILL_POINT_BLOCK} messages" in log.read_text()
    already = sum(checkpointed(crashed, topic).values())
    target = already + rng.uniform(0.05, 0.5) * (total - already)
    deadline = time.monotonic() + 10
    while sum(checkpointed(crashed, topic).values()) < target and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.03))
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def test_a_materializer_killed_at_random_points_ends_byte_identical_to_a_clean_replay(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("crash", partitions=PARTITIONS)
    end = write_rollouts(kafka_bootstrap, topic, 200, long_rollout)
    crashed, log = tmp_path / "crashed", tmp_path / "materializer.log"
    rng = random.Random(11)
    progress_seen: list[dict[int, int]] = []
    total = sum(end.values())
    for _ in range(10):
        kill_at_a_random_point(kafka_bootstrap, topic, crashed, log, rng, total)
        progress_seen.append(checkpointed(crashed, topic))
        if progress_seen[-1] == end:
            break
    assert progress_seen[0] != end, "the first kill must land before the end of the topic"
    assert_resumes_as_a_clean_replay(kafka_bootstrap, topic, tmp_path, end)


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


def files_but_locks(store_dir: Path) -> dict[str, bytes]:
    """Every file's bytes by name, lock files left out (they hold no state)."""
    return {name: data for name, data in directory_contents(store_dir).items() if not name.endswith(".lock")}


def assert_resumes_as_a_clean_replay(bootstrap: str, topic: str, tmp_path: Path, end: dict[int, int]) -> None:
    """Finish ``tmp_path/crashed`` with one last process; it must equal a replay into an empty directory."""
    run_to_the_end(bootstrap, topic, tmp_path / "crashed", tmp_path / "materializer.log", end)
    replay_topic(bootstrap, topic, tmp_path / "clean")
    resumed, replayed = files_but_locks(tmp_path / "crashed"), files_but_locks(tmp_path / "clean")
    differing = sorted(
        name for name in resumed.keys() | replayed.keys() if resumed.get(name) != replayed.get(name)
    )
    assert differing == [], {name: (resumed.get(name), replayed.get(name)) for name in differing[:3]}


KILL_CYCLES = 50


def test_a_materializer_killed_fifty_times_mid_batch_ends_byte_identical_to_a_clean_replay(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("killloop", partitions=PARTITIONS)
    end = write_rollouts(kafka_bootstrap, topic, 600, lifecycle_rollout)
    crashed, log = tmp_path / "crashed", tmp_path / "materializer.log"
    kills_before_the_end = 0
    rng = random.Random(50)
    for _ in range(KILL_CYCLES):
        process = start_process(kafka_bootstrap, topic, crashed, log)
        # Kill once the process has checkpointed one batch of its own, a random moment into the next batch:
        # inside its projection block, whose applied events are not yet checkpointed. Any moment
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
    assert_resumes_as_a_clean_replay(kafka_bootstrap, topic, tmp_path, end)


def test_a_materializer_killed_at_random_points_while_restoring_wire_deltas_ends_byte_identical_to_a_clean_replay(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("crashdelta", partitions=PARTITIONS)
    end = write_rollouts(kafka_bootstrap, topic, 120, conversation_rollout)
    deltas = sum(
        headers_to_dict(list(m.headers)).get(HEADER_ENCODING) == ENCODING_DELTA
        for m in read_log(kafka_bootstrap, topic)
    )
    assert deltas == 120 * 7
    crashed, log = tmp_path / "crashed", tmp_path / "materializer.log"
    rng = random.Random(12)
    first_kill: dict[int, int] | None = None
    total = sum(end.values())
    for _ in range(10):
        kill_at_a_random_point(kafka_bootstrap, topic, crashed, log, rng, total)
        first_kill = first_kill or checkpointed(crashed, topic)
        if checkpointed(crashed, topic) == end:
            break
    assert first_kill != end, "the first kill must land before the end of the topic"
    assert_resumes_as_a_clean_replay(kafka_bootstrap, topic, tmp_path, end)
    assert not any(name.startswith("kafka-dead-letter") for name in directory_contents(tmp_path / "clean"))
