"""Messages the materializer cannot apply are dead-lettered, mask their rollout, and never stall it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from cli_helpers import tokcap
from confluent_kafka import Producer
from store_contract import make_entry

from tokcap.events import EVENT_SCHEMA_VERSION, FreezeEvent, PutEvent, encode_event
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.codec import encode_event_messages

pytestmark = pytest.mark.kafka


def produce_raw(
    bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]
) -> None:
    """Write messages straight to the topic, bypassing the sink."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value, headers in records:
        producer.produce(topic, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0


def test_poison_messages_are_dead_lettered_with_reasons_and_consumption_goes_on(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    newer = orjson.dumps(
        {"schema_version": EVENT_SCHEMA_VERSION + 1, "type": "freeze", "rollout_id": "r-newer"}
    )
    chunk_headers = [
        ("tokcap.type", b"put"),
        ("tokcap.encoding", b"packed"),
        ("tokcap.chunk.group", b"ghost:1"),
        ("tokcap.chunk.index", b"1"),
        ("tokcap.chunk.count", b"3"),
        ("tokcap.chunk.sha256", b"00"),
    ]
    produce_raw(
        kafka_bootstrap,
        kafka_topic,
        [
            (b"r-garbage", b"\x00not json", []),
            (
                b"r-unknown",
                orjson.dumps({"schema_version": 1, "type": "teleport", "rollout_id": "r-unknown"}),
                [],
            ),
            (b"r-newer", newer, [("tokcap.schema_version", str(EVENT_SCHEMA_VERSION + 1).encode())]),
            (b"r-orphan", b"half of something", chunk_headers),
            (b"../escape", b"{}", []),
            (b"r-mismatch", encode_event(FreezeEvent(rollout_id="r-other")), []),
        ],
    )

    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            await sink.put(make_entry("r-healthy", "c1"))
            healthy = await source.freeze("r-healthy")
            assert (len(healthy.entries), healthy.incomplete) == (1, False)
            for rid in ("r-garbage", "r-unknown", "r-newer", "r-orphan", "r-mismatch"):
                await sink.put(make_entry(rid, "c1"))
                snapshot = await source.freeze(rid)
                assert (len(snapshot.entries), snapshot.incomplete) == (1, True), rid
        finally:
            await sink.close()
            await source.close()

    asyncio.run(scenario())
    lines = [
        orjson.loads(line) for line in (tmp_path / "kafka-dead-letter-p0.jsonl").read_bytes().splitlines()
    ]
    assert [(line["partition"], line["offset"]) for line in lines] == [(0, offset) for offset in range(6)]
    assert [line["rollout_id"] for line in lines] == [
        "r-garbage",
        "r-unknown",
        "r-newer",
        "r-orphan",
        None,
        "r-mismatch",
    ]
    assert "not valid JSON" in lines[0]["reason"]
    assert "unknown event type" in lines[1]["reason"]
    assert "newer" in lines[2]["reason"]
    assert "orphaned chunk" in lines[3]["reason"]
    assert not (tmp_path / "r-other.tokens.state.json").exists()


def test_a_freeze_while_a_put_is_half_written_in_chunks_answers_an_incomplete_snapshot(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    messages = encode_event_messages(
        PutEvent(rollout_id="r-half", entry=make_entry("r-half", "c1", tokens=1200)),
        chunk_bytes=2048,
        next_chunk_group=lambda: "killed-writer:0",
    )
    assert len(messages) >= 3
    produce_raw(kafka_bootstrap, kafka_topic, [(m.key, m.value, m.headers) for m in messages[:1]])

    async def scenario() -> None:
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            snapshot = await source.freeze("r-half")
            assert (list(snapshot.entries), snapshot.incomplete) == ([], True)
        finally:
            await source.close()

    asyncio.run(scenario())
    (line,) = [
        orjson.loads(line) for line in (tmp_path / "kafka-dead-letter-p0.jsonl").read_bytes().splitlines()
    ]
    assert (line["offset"], line["rollout_id"]) == (0, "r-half")
    assert "its rollout was frozen at offset 1 first" in line["reason"]


def test_tokcap_materialize_reports_each_dead_letter_in_one_line(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produce_raw(
        kafka_bootstrap,
        kafka_topic,
        [
            (b"r-garbage", b"\x00not json", []),
            (b"r-ok", encode_event(FreezeEvent(rollout_id="r-ok")), []),
            (b"r-late", b"half", [("tokcap.chunk.group", b"g:1")]),
        ],
    )
    completed = tokcap(
        "materialize", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--dir", str(tmp_path),
        "--until-caught-up",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    reported = [line for line in completed.stderr.splitlines() if line.startswith("dead letter: ")]
    assert len(reported) == 2, completed.stderr
    assert reported[0].startswith("dead letter: partition 0 offset 0 rollout r-garbage: ")
    assert "not valid JSON" in reported[0]
    assert reported[1].startswith("dead letter: partition 0 offset 2 rollout r-late: ")
