"""Wire deltas on a real broker: a run sent with them materializes, replays and reads back byte-identical to
the same run sent whole, and a corrupted delta is dead-lettered rather than applied."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from conversations import conversation
from store_contract import directory_contents

from tests.topic_replay import replay_topic
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.timeline import LogApplier, read_log
from transports.kafka.wire.codec import ENCODING_DELTA, HEADER_ENCODING, headers_to_dict

pytestmark = pytest.mark.kafka


def store_files(directory: Path) -> dict[str, bytes]:
    """The store's own files: not the materializer's checkpoints and dead letters, not locks."""
    return {
        name: data
        for name, data in directory_contents(directory).items()
        if not name.startswith("kafka-") and not name.endswith(".lock")
    }


async def run(bootstrap: str, topic: str, store_dir: Path, *, wire_deltas: bool) -> None:
    """Six rollouts through two sinks, one after the other call by call, then frozen; one is deleted and its
    id reused by a sink that does not know (its next put links a call from before the delete)."""
    sinks = [
        KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, wire_deltas=wire_deltas, chunk_bytes=8192)
        for _ in range(2)
    ]
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    rollouts = [conversation(f"wd-{index}", 6, seed=index) for index in range(6)]
    try:
        for turn in range(6):
            for index, entries in enumerate(rollouts):
                # Rollout 5 switches sink at turn 3: that put cannot link a call the other sink sent.
                sink = sinks[(index + (turn >= 3 and index == 5)) % 2]
                await sink.begin_call(entries[turn].rollout_id, entries[turn].model_call_id)
                await sink.put(entries[turn])
            if turn == 3:
                await source.freeze("wd-0")
                await source.delete(["wd-0"])
        for entries in rollouts:
            await source.freeze(entries[0].rollout_id)
        assert source.materializer.wait_until_caught_up(60)
    finally:
        for sink in sinks:
            await sink.close()
        await source.close()


def deltas_in(bootstrap: str, topic: str) -> int:
    return sum(
        headers_to_dict(list(m.headers)).get(HEADER_ENCODING) == ENCODING_DELTA
        for m in read_log(bootstrap, topic)
    )


def test_a_run_sent_with_wire_deltas_materializes_replays_and_reads_back_byte_identical_to_one_sent_whole(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    whole_topic = kafka_topic_factory("wd-whole", partitions=3)
    delta_topic = kafka_topic_factory("wd-delta", partitions=3)
    asyncio.run(run(kafka_bootstrap, whole_topic, tmp_path / "whole", wire_deltas=False))
    asyncio.run(run(kafka_bootstrap, delta_topic, tmp_path / "delta", wire_deltas=True))
    assert deltas_in(kafka_bootstrap, whole_topic) == 0
    # 6 rollouts x 5 continuations, less the one that changed sinks.
    assert deltas_in(kafka_bootstrap, delta_topic) == 29
    expected = store_files(tmp_path / "whole")
    # State files name the topic in their log positions; the two runs' messages sit at the same offsets.
    renamed = {
        k: v.replace(delta_topic.encode(), whole_topic.encode())
        for k, v in store_files(tmp_path / "delta").items()
    }
    assert renamed == expected
    assert not any(name.startswith("kafka-dead-letters") for name in directory_contents(tmp_path / "delta"))

    replay_topic(kafka_bootstrap, delta_topic, tmp_path / "replayed")
    assert directory_contents(tmp_path / "replayed") == directory_contents(tmp_path / "delta")

    # What `tokcap log` does: one rollout from the start of its partition, through the timeline's applier.
    applier = LogApplier.over_log(TokenCaptureStore(tmp_path / "one"), delta_topic, kafka_bootstrap)
    with contextlib.closing(applier):
        for message in read_log(kafka_bootstrap, delta_topic, key=b"wd-5", on_skipped=applier.pass_over):
            applier.take_all(message)
    assert store_files(tmp_path / "one") == {
        k: v for k, v in store_files(tmp_path / "delta").items() if k.startswith("wd-5.")
    }


def test_a_wire_delta_corrupted_on_the_log_is_dead_lettered_and_masks_its_rollout(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("wd-corrupt", partitions=1)
    entries: list[TokenEntry] = conversation("wd-bad", 3)

    async def write() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic)
        try:
            await sink.put(entries[0])
            await sink.put(entries[1])
        finally:
            await sink.close()

    asyncio.run(write())
    (sent,) = [m for m in read_log(kafka_bootstrap, topic) if m.offset == 1]
    assert headers_to_dict(list(sent.headers)).get(HEADER_ENCODING) == ENCODING_DELTA
    value = bytearray(sent.value or b"")
    value[-500] ^= 0x40  # one of the 20 suffix ids (80 B), ahead of 40 generated ids and log probs (480 B)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, value=bytes(value), key=sent.key, headers=list(sent.headers), partition=0)
    assert producer.flush(30) == 0
    replay_topic(kafka_bootstrap, topic, tmp_path / "store")
    store = TokenCaptureStore(tmp_path / "store")
    assert store.is_incomplete("wd-bad")
    assert [e.model_call_id for e in store.read_entries("wd-bad")] == ["call-0", "call-1"]
    (dead,) = [
        data for name, data in directory_contents(tmp_path / "store").items() if name.startswith("kafka-dead")
    ]
    assert b'"offset":2' in dead and b"digest" in dead


def test_sinks_and_materializers_restarted_between_wire_delta_parents_and_children_lose_no_token(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    """Each turn of every rollout goes through a new sink after a restart of the trainer's source."""
    rollouts = [conversation(f"restart-{index}", 6, seed=index) for index in range(4)]

    async def turn(number: int) -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, wire_deltas=True)
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "store"
        )
        try:
            for entries in rollouts:
                # Two calls per sink: the second is a wire delta whose parent the restarted materializer has
                # only on disk and in the log; the first follows a parent the new sink never sent.
                for entry in entries[number : number + 2]:
                    await sink.begin_call(entry.rollout_id, entry.model_call_id)
                    await sink.put(entry)
            assert source.materializer.wait_until_caught_up(60)
        finally:
            await sink.close()
            await source.close()

    for number in (0, 2, 4):
        asyncio.run(turn(number))
    assert deltas_in(kafka_bootstrap, kafka_topic) == 3 * len(rollouts)

    async def freeze_all() -> dict[str, list[TokenEntry]]:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "store"
        )
        try:
            return {e[0].rollout_id: list((await source.freeze(e[0].rollout_id)).entries) for e in rollouts}
        finally:
            await source.close()

    frozen = asyncio.run(freeze_all())
    for entries in rollouts:
        got = frozen[entries[0].rollout_id]
        assert [(e.model_call_id, e.prompt_token_ids, e.generation_token_ids) for e in got] == [
            (e.model_call_id, e.prompt_token_ids, e.generation_token_ids) for e in entries
        ]
    replay_topic(kafka_bootstrap, kafka_topic, tmp_path / "replayed")
    assert store_files(tmp_path / "replayed") == store_files(tmp_path / "store")
