"""Large events over a real broker with default settings (1 MiB messages) and tokcap's default topic limits.

A legitimate stage of a 4 MiB attachment with several MiB of routed experts is chunked, reassembled by the
router, digest-checked and fetched exactly. A stage or put over the maximum event size is refused by its
sink with nothing sent. A chunk group on the topic that declares more than the limit is dead-lettered at
its first chunk and its rollout masked, its later chunks are orphans, and the other rollouts apply; the
lineage resolver, reassembling through the same router, still resolves a chunked parent beside it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource
from staging_calls import Turn, assistant, commit_for, cumulative_tokens, staged_call, user
from store_contract import make_entry

from tokcap.errors import EventTooLargeError
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import LineageResolution, stamp_continuation
from tokcap.log.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.staging import verify_and_linearize
from tokcap.staging.digest import compute_extras_digest
from tokcap.staging.records import RolloutReceipt
from transports.kafka import KafkaTokenSink
from transports.kafka.client.admin import watermarks
from transports.kafka.client.topics import ensure_topic
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.materializer.dead_letters import dead_letter_files
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.codec import DEFAULT_CHUNK_BYTES
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

pytestmark = pytest.mark.kafka

KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588


def _dead_letters(store_dir: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line) for path in dead_letter_files(store_dir) for line in path.read_bytes().splitlines()
    ]


def _messages_on(bootstrap: str, topic: str) -> int:
    return sum(high - low for low, high in watermarks(bootstrap, topic).values())


def _max_message_bytes(bootstrap: str, topic: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    [future] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
    return int(future.result(timeout=30)["max.message.bytes"].value)


def _routed_experts(tokens: int) -> dict[str, Any]:
    """Routed experts of a 48-layer top-8 MoE for ``tokens`` tokens, as a JSON extras envelope."""
    return {
        "format": "nrlre1",
        "layers": 48,
        "top_k": 8,
        "experts": [[(token * 7 + slot) % 128 for slot in range(48 * 8)] for token in range(tokens)],
    }


def test_a_4_mib_attachment_and_several_mib_of_routed_experts_are_reassembled_verified_and_fetched_exactly(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    assert _max_message_bytes(kafka_bootstrap, kafka_topic) <= KAFKA_DEFAULT_MAX_MESSAGE_BYTES
    image = os.urandom(4 * 1024 * 1024)
    experts = _routed_experts(2000)
    assert len(orjson.dumps(experts)) > 2 * 1024 * 1024
    call = staged_call("moe-r", "call-0", [1, 2, 3], list(range(10, 2010)), extras=experts)
    turn = Turn(call, [user("moe-r question")], [assistant("moe-r answer")])
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
    try:
        result = sink.stage(call, attachments={"image": image})
    finally:
        sink.close()
    assert result.ok, result
    # Over the broker's message limit, so it crossed as a chunk group.
    assert _messages_on(kafka_bootstrap, kafka_topic) >= (len(image) // DEFAULT_CHUNK_BYTES) + 1
    source = KafkaStagingSource(
        bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "s"
    )
    try:
        [full] = source.fetch_full([result.staging_key])
        assert full.extras == experts and compute_extras_digest(full.extras) == call.extras_digest
        assert full.generation_log_probs_delta == call.generation_log_probs_delta
        assert source.fetch_attachments(result.staging_key) == {"image": image}
        receipt = RolloutReceipt(
            rollout_id="moe-r",
            manifest=[commit_for(turn).record],
            terminal_model_call_id="call-0",
            terminal_selection="declared",
        )
        row = verify_and_linearize(receipt, source.fetch([result.staging_key]))
        assert row.token_ids == cumulative_tokens(call)
    finally:
        source.close()
    assert not _dead_letters(tmp_path / "s")


def test_a_stage_or_put_over_the_maximum_event_size_is_refused_by_its_sink_and_nothing_reaches_the_topic(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    limit = 2 * 1024 * 1024
    kafka_topic = f"tokcap-test-small-limits-{os.urandom(5).hex()}"
    kafka_topic_factory.created.append(kafka_topic)
    ensure_topic(kafka_bootstrap, kafka_topic, limits=TopicLimits(max_event_bytes=limit))
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
    try:
        call = staged_call("huge-r", "call-0", [1, 2], [3])
        result = sink.stage(call, attachments={"video": os.urandom(3 * 1024 * 1024)})
        assert result.ok is False
        assert f"over the topic's maximum event size of {limit:,} bytes (max_event_bytes)" in result.error
        assert "nothing was sent" in result.error and "huge-r/call-0" in result.error
    finally:
        sink.close()

    async def put_too_large() -> None:
        puts = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        try:
            with pytest.raises(EventTooLargeError, match="max_event_bytes"):
                await puts.put(make_entry("huge-r", "c1", tokens=600_000))
        finally:
            await puts.close()

    asyncio.run(put_too_large())
    assert _messages_on(kafka_bootstrap, kafka_topic) == 1  # the topic's limits record alone


def test_a_crafted_chunk_group_over_the_event_limit_is_dead_lettered_and_masked_while_other_rollouts_apply(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    count = 300
    piece = b"\x00" * DEFAULT_CHUNK_BYTES
    assert (count - 1) * len(piece) + 1 > TOPIC_DEFAULTS.max_event_bytes

    def crafted(index: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        headers = [
            ("tokcap.type", b"stage"),
            ("tokcap.schema_version", b"1"),
            ("tokcap.encoding", b"staged"),
            ("tokcap.chunk.group", b"crafted:0"),
            ("tokcap.chunk.index", str(index).encode()),
            ("tokcap.chunk.count", str(count).encode()),
            ("tokcap.chunk.sha256", b"0" * 64),
        ]
        return b"crafted-r", piece, headers

    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce_crafted(indexes: range) -> None:
        for index in indexes:
            key, value, headers = crafted(index)
            producer.produce(kafka_topic, key=key, value=value, headers=headers)
        assert producer.flush(30) == 0

    image = os.urandom(4 * 1024 * 1024)
    call = staged_call("honest-r", "call-0", [1, 2, 3], [4, 5], extras=_routed_experts(300))
    produce_crafted(range(0, 1))
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
    try:
        honest = sink.stage(call, attachments={"image": image})
        produce_crafted(range(1, 3))
        after = sink.stage(staged_call("after-r", "call-0", [1], [2]))
    finally:
        sink.close()
    assert honest.ok and after.ok, (honest, after)

    store_dir = tmp_path / "s"
    source = KafkaStagingSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=store_dir)
    try:
        [full] = source.fetch_full([honest.staging_key])
        assert full.extras == call.extras and source.fetch_attachments(honest.staging_key) == {"image": image}
        assert len(source.fetch([after.staging_key])) == 1
        store = TokenCaptureStore(store_dir)
        assert store.is_incomplete("crafted-r")
        assert not store.is_incomplete("honest-r") and not store.is_incomplete("after-r")
    finally:
        source.close()
    lines = _dead_letters(store_dir)
    assert [(line["offset"], line["rollout_id"]) for line in lines][:1] == [(0, "crafted-r")]
    assert "declares at least 269,100,001 bytes" in lines[0]["reason"]
    assert "max_event_bytes" in lines[0]["reason"]
    assert [line["rollout_id"] for line in lines] == ["crafted-r"] * 3
    assert all("orphaned chunk" in line["reason"] for line in lines[1:])


def test_the_lineage_resolver_resolves_a_chunked_parent_beside_a_crafted_oversized_group(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    request: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    prompt = list(range(400_000))
    entry = TokenEntry(
        rollout_id="long-r",
        model_call_id="root",
        prompt_token_ids=prompt,
        generation_token_ids=[4, 5],
        generation_log_probs=[-0.5, -0.25],
        output_items=[{"role": "assistant", "content": "a long answer"}],
    )
    stamp_continuation(entry, request)
    stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    headers = [("tokcap.type", b"put"), ("tokcap.schema_version", b"1"), ("tokcap.encoding", b"packed")]
    for index in range(2):
        chunk = [
            ("tokcap.chunk.group", b"crafted:0"),
            ("tokcap.chunk.index", str(index).encode()),
            ("tokcap.chunk.count", b"300"),
            ("tokcap.chunk.sha256", b"0" * 64),
        ]
        producer.produce(
            kafka_topic, key=b"crafted-r", value=b"\x00" * DEFAULT_CHUNK_BYTES, headers=headers + chunk
        )
    assert producer.flush(30) == 0
    continuation = [
        *request,
        {"role": "assistant", "content": "a long answer"},
        {"role": "user", "content": "more"},
    ]

    async def run() -> LineageResolution:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, timeout_s=20)
        try:
            await sink.put(entry)
            return await resolver.resolve("long-r", continuation)
        finally:
            await asyncio.gather(sink.close(), resolver.close())

    resolution = asyncio.run(run())
    assert _messages_on(kafka_bootstrap, kafka_topic) >= 4  # two crafted chunks and the put's chunks
    assert resolution.status is ParentResolutionStatus.RESOLVED
    assert resolution.match is not None and resolution.match.cumulative_token_ids == (*prompt, 4, 5)
