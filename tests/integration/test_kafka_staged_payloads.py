"""On a topic made now, staged bytes lie on the staged-payload topic and the run topic holds small references.

Against the real broker: a ledger reads no staged byte, a fresh reader gets every byte back exactly, a
reference whose payload the log no longer holds masks only its own rollout, and the topic commands make and
remove both topics together.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_helpers import tokcap
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from staging_calls import commit_for, conversation

from tokcap.errors import StagingKeyNotFoundError
from tokcap.store import TokenCaptureStore
from transports.kafka.client.clients import ClientContext
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.materializer.dead_letters import dead_letter_files
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.codec import headers_to_dict

pytestmark = pytest.mark.kafka

MIB = 1024 * 1024


def _all_messages(bootstrap: str, topic: str, partitions: int) -> list[Any]:
    """Every message of the topic, read from the start up to its end."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "tokcap-test-read", "enable.auto.commit": False}
    )
    try:
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        messages: list[Any] = []
        while len(messages) < sum(ends.values()):
            for message in consumer.consume(500, 1.0):
                assert message.error() is None, message.error()
                messages.append(message)
        return messages
    finally:
        consumer.close()


def test_the_run_topic_holds_small_references_and_a_fresh_reader_gets_every_staged_byte_back(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory.staged_apart("apart", partitions=2)
    payload_topic = read_topic_limits(ClientContext(kafka_bootstrap, {}), topic).staged_payload_topic
    assert payload_topic == f"tokcap-staged.{topic}"
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=topic)
    staged: dict[str, tuple[Any, dict[str, bytes]]] = {}
    try:
        for index in range(4):
            [turn] = conversation(f"apart-{index}", 1, extras=True)
            attachments = {"image": bytes([index]) * (2 * MIB), "empty": b""}
            result = sink.stage(turn.call, attachments=attachments)
            assert result.ok, result.error
            staged[result.staging_key] = (turn.call, attachments)
    finally:
        sink.close()
    run_messages = _all_messages(kafka_bootstrap, topic, 2)
    stage_messages = [m for m in run_messages if headers_to_dict(m.headers()).get("tokcap.type") == "stage"]
    assert len(stage_messages) == 4
    assert all(len(m.value()) < 1024 for m in stage_messages), [len(m.value()) for m in stage_messages]
    payload_bytes = sum(len(m.value()) for m in _all_messages(kafka_bootstrap, payload_topic, 2))
    assert payload_bytes > 8 * MIB

    source = KafkaStagingSource(bootstrap_servers=kafka_bootstrap, topic=topic)
    try:
        keys = sorted(staged)
        for key, snapshot in zip(keys, source.fetch_full(keys), strict=True):
            call, attachments = staged[key]
            assert snapshot.model_dump() == call.model_dump()
            assert source.fetch_attachments(key) == attachments
    finally:
        source.close()


def test_a_ledger_without_a_store_dir_commits_rows_on_a_topic_whose_stages_are_references(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    topic = kafka_topic_factory.staged_apart("ledger")
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=topic)
    turns = conversation("ledgered", 2)
    try:
        for turn in turns:
            assert sink.stage(turn.call, attachments={"image": b"\x01" * MIB}).ok
    finally:
        sink.close()

    async def record() -> dict[str, Any]:
        ledger = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=topic)
        try:
            for turn in turns:
                await ledger.record(commit_for(turn))
            return await ledger.manifest("ledgered")
        finally:
            await ledger.close()

    manifest = asyncio.run(record())
    assert [row["model_call_id"] for row in manifest["records"]] == [
        turn.call.model_call_id for turn in turns
    ]
    assert manifest["failures"] == []


def test_a_reference_whose_payload_the_log_no_longer_holds_masks_only_its_own_rollout(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory.staged_apart("trimmed")
    payload_topic = f"tokcap-staged.{topic}"
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=topic)
    [lost] = conversation("lost", 1)
    [kept] = conversation("kept", 1)
    try:
        lost_key = sink.stage(lost.call, attachments={"image": b"\x02" * 1000}).staging_key
        kept_key = sink.stage(kept.call, attachments={"image": b"\x03" * 1000}).staging_key
    finally:
        sink.close()
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    (trimmed,) = admin.delete_records([TopicPartition(payload_topic, 0, 1)]).values()
    trimmed.result(timeout=30)

    source = KafkaStagingSource(bootstrap_servers=kafka_bootstrap, topic=topic, store_dir=tmp_path / "store")
    try:
        assert [snapshot.staging_key for snapshot in source.fetch([kept_key])] == [kept_key]
        with pytest.raises(StagingKeyNotFoundError):
            source.fetch([lost_key])
    finally:
        source.close()
    store = TokenCaptureStore(tmp_path / "store")
    assert store.read_state("lost").incomplete and not store.read_state("kept").incomplete
    [reason] = [
        orjson.loads(line)["reason"]
        for path in dead_letter_files(tmp_path / "store")
        for line in path.read_bytes().splitlines()
    ]
    assert "no longer in the log" in reason and payload_topic in reason


def test_topic_create_makes_the_payload_topic_and_delete_removes_both(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    run_id = f"apart-{uuid.uuid4().hex[:12]}"
    kafka_topic_factory.created.extend([f"tokcap.{run_id}", f"tokcap-staged.tokcap.{run_id}"])
    base = ("--bootstrap", kafka_bootstrap, "--run", run_id)
    created = tokcap("topic", "create", *base, "--json")
    assert created.returncode == 0, created.stderr
    payload_topic = f"tokcap-staged.tokcap.{run_id}"
    assert created.json()["limits"]["staged_payload_topic"] == payload_topic
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    assert payload_topic in admin.list_topics(timeout=10).topics
    deleted = tokcap("topic", "delete", *base, "--yes", "--json")
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.json() == {
        "deleted": True,
        "topic": f"tokcap.{run_id}",
        "staged_payload_topic": payload_topic,
    }
    described = tokcap("topic", "describe", "--bootstrap", kafka_bootstrap, "--topic", payload_topic)
    assert described.returncode != 0 and "does not exist" in described.stderr
