"""One set of size limits per topic, on a real broker: recorded once when the topic is made, used by every writer
and reader, checked against any limit still given to a constructor.

The limits record is produced by hand here, in the documented wire form (docs/events.md), where a test
needs a topic with limits: what the test checks is what every sink and reader makes of it.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from staging_calls import Turn, assistant, commit_for, cumulative_tokens, staged_call, user
from store_contract import make_entry

from tokcap.errors import ConfigError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import PutEvent
from tokcap.staging import verify_and_linearize
from tokcap.staging.records import RolloutReceipt
from transports.kafka import KafkaTokenSink
from transports.kafka.cli.log import rollout_timeline
from transports.kafka.cli.replay import run_replay
from transports.kafka.client.admin import watermarks
from transports.kafka.client.topics import ensure_topic
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.dead_letters import dead_letter_files
from transports.kafka.staging import KafkaCaptureLedger, KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.codec import encode_event_messages

pytestmark = pytest.mark.kafka

MIB = 1024 * 1024
DEFAULT_EVENT_LIMIT = 256 * MIB


def record_limits(bootstrap: str, topic: str, max_event_bytes: int, max_open_chunk_bytes: int) -> None:
    """Write the limits record as `tokcap topic create` does: the topic's first message, on partition 0."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    value = orjson.dumps(
        {"max_event_bytes": max_event_bytes, "max_open_chunk_bytes": max_open_chunk_bytes},
        option=orjson.OPT_SORT_KEYS,
    )
    headers = [
        ("tokcap.type", b"topic-limits"),
        ("tokcap.schema_version", b"1"),
        ("tokcap.writer", b"tokcap-topic-create"),
        ("tokcap.encoding", b"json"),
    ]
    producer.produce(topic, value=value, headers=headers, partition=0)
    assert producer.flush(30) == 0
    assert watermarks(bootstrap, topic)[0] == (0, 1)


def _messages_on(bootstrap: str, topic: str) -> int:
    return sum(high - low for low, high in watermarks(bootstrap, topic).values())


def _dead_letters(store_dir: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line) for path in dead_letter_files(store_dir) for line in path.read_bytes().splitlines()
    ]


def _rollout_files(directory: Path) -> dict[str, bytes]:
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if path.is_file() and not path.name.startswith("kafka-") and not path.name.endswith(".lock")
    }


def _materialize(bootstrap: str, topic: str, directory: Path) -> TokenCaptureStore:
    ends = {partition: high for partition, (_, high) in watermarks(bootstrap, topic).items()}
    materializer = Materializer(bootstrap, topic, directory)
    materializer.start()
    try:
        for partition, high in ends.items():
            if high:
                assert materializer.wait_for(partition, high - 1, 60)
    finally:
        materializer.stop()
    return TokenCaptureStore(directory)


def _produce_raw(bootstrap: str, topic: str, event: PutEvent, chunk_bytes: int, limit: int) -> None:
    """Send an event as a sink with its own, larger limit would have: what no sink may do any more."""
    from transports.kafka.wire.topic_limits import TopicLimits

    producer = Producer({"bootstrap.servers": bootstrap})
    messages = encode_event_messages(
        event, chunk_bytes=chunk_bytes, limits=TopicLimits(limit), next_chunk_group=lambda: "raw:0"
    )
    for message in messages:
        producer.produce(topic, key=message.key, value=message.value, headers=message.headers, partition=0)
    assert producer.flush(30) == 0


# ------------------------------------------------------------------ the record and topic creation


def test_a_topic_made_with_limits_records_them_first_and_an_other_request_for_it_is_refused(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    from transports.kafka.client.clients import ClientContext
    from transports.kafka.client.limits_record import read_topic_limits
    from transports.kafka.errors import TopicLimitsMismatchError
    from transports.kafka.wire.topic_limits import TopicLimits

    name = f"tokcap-test-limits-{os.urandom(4).hex()}"
    limits = TopicLimits(max_event_bytes=300 * MIB)
    kafka_topic_factory.created.append(name)
    assert ensure_topic(kafka_bootstrap, name, limits=limits) is True
    kafka_topic_factory.created.append(f"tokcap-staged.{name}")
    assert watermarks(kafka_bootstrap, name)[0] == (0, 1)
    # The record also names the staged-payload topic made with it (asking for limits asks nothing of that).
    recorded = read_topic_limits(ClientContext(kafka_bootstrap, {}), name)
    assert recorded == TopicLimits(max_event_bytes=300 * MIB, staged_payload_topic=f"tokcap-staged.{name}")
    assert limits.max_open_chunk_bytes == 600 * MIB
    assert ensure_topic(kafka_bootstrap, name) is False  # asking for nothing accepts the topic's limits
    assert ensure_topic(kafka_bootstrap, name, limits=limits) is False
    with pytest.raises(TopicLimitsMismatchError) as refused:
        ensure_topic(kafka_bootstrap, name, limits=TopicLimits())
    assert "max_event_bytes=314,572,800" in str(refused.value) and "new run id" in str(refused.value)
    assert _messages_on(kafka_bootstrap, name) == 1


# ------------------------------------------------------------------ every writer and reader uses them


def test_a_stage_over_the_topics_limit_fails_at_stage_naming_its_size_and_the_limit_and_sends_nothing(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    record_limits(kafka_bootstrap, kafka_topic, 2 * MIB, 4 * MIB)
    for store_dir in (None, tmp_path / "own"):
        sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=store_dir)
        try:
            call = staged_call("huge-r", "call-0", [1, 2], [3])
            result = sink.stage(call, attachments={"video": os.urandom(3 * MIB)})
            assert result.ok is False, store_dir
            assert "huge-r/call-0" in result.error and "bytes encoded" in result.error
            assert "over the topic's maximum event size of 2,097,152 bytes" in result.error
            assert "different payload" not in result.error
        finally:
            sink.close()

    async def put_too_large() -> None:
        from tokcap.errors import EventTooLargeError

        puts = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        try:
            with pytest.raises(EventTooLargeError, match="2,097,152 bytes"):
                await puts.put(make_entry("huge-r", "c1", tokens=600_000))
        finally:
            await puts.close()

    asyncio.run(put_too_large())
    assert _messages_on(kafka_bootstrap, kafka_topic) == 1  # the limits record alone


def test_every_reader_refuses_an_event_over_the_topics_limit_that_it_would_take_by_default(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    record_limits(kafka_bootstrap, kafka_topic, 2 * MIB, 4 * MIB)
    big = PutEvent(rollout_id="big-r", entry=make_entry("big-r", "c1", tokens=800_000))
    _produce_raw(kafka_bootstrap, kafka_topic, big, chunk_bytes=900_000, limit=8 * MIB)
    small = PutEvent(rollout_id="small-r", entry=make_entry("small-r", "c1", tokens=5))
    _produce_raw(kafka_bootstrap, kafka_topic, small, chunk_bytes=900_000, limit=8 * MIB)

    store = _materialize(kafka_bootstrap, kafka_topic, tmp_path / "materialized")
    assert store.is_incomplete("big-r") and store.read_entries("big-r") == []
    assert store.read_entries("small-r") == [small.entry]
    reasons = [line["reason"] for line in _dead_letters(tmp_path / "materialized")]
    assert "over the maximum event size of 2,097,152 bytes" in reasons[0]
    assert all(reason.startswith("orphaned chunk") for reason in reasons[1:])

    timeline = rollout_timeline(
        kafka_bootstrap, "big-r", run_id=None, topic=kafka_topic, client_options=[], timeout_s=20
    )
    assert {event["decision"] for event in timeline["events"]} >= {"dead-lettered"}
    assert timeline["incomplete"] is True

    summary = run_replay(
        kafka_bootstrap,
        tmp_path / "replayed",
        run_id=None,
        topic=kafka_topic,
        rollout_id=None,
        until="end",
        force=False,
        client_options=[],
        timeout_s=20,
        show_progress=False,
    )
    assert summary["rollouts"] == 2
    assert _rollout_files(tmp_path / "replayed") == _rollout_files(tmp_path / "materialized")


def test_a_run_with_raised_limits_stages_records_resolves_materializes_and_replays_as_one_with_the_defaults(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    raised, default = kafka_topic_factory("raised"), kafka_topic_factory("default")
    record_limits(kafka_bootstrap, raised, 300 * MIB, 600 * MIB)
    record_limits(kafka_bootstrap, default, DEFAULT_EVENT_LIMIT, 2 * DEFAULT_EVENT_LIMIT)
    image = bytes(range(256)) * (3 * MIB // 256)
    outcomes = {}
    for topic in (raised, default):
        work = tmp_path / topic
        outcomes[topic] = asyncio.run(_staged_run(kafka_bootstrap, topic, work, image))
        _materialize(kafka_bootstrap, topic, work / "materialized")
        run_replay(
            kafka_bootstrap,
            work / "replayed",
            run_id=None,
            topic=topic,
            rollout_id=None,
            until="end",
            force=False,
            client_options=[],
            timeout_s=20,
            show_progress=False,
        )
        timeline = rollout_timeline(
            kafka_bootstrap, "run-r", run_id=None, topic=topic, client_options=[], timeout_s=20
        )
        outcomes[topic]["timeline"] = [
            # A chunk's detail names its group, which holds the sink's random session id.
            (event["partition"], event["offset"], event["event_type"], event["decision"])
            for event in timeline["events"]
        ]
        # The state names the topic it was read from; all else must match byte for byte.
        for copy in ("materialized", "replayed"):
            files = _rollout_files(work / copy)
            outcomes[topic][copy] = {
                name: data.replace(topic.encode(), b"<topic>") for name, data in files.items()
            }
        assert outcomes[topic]["materialized"] == outcomes[topic]["replayed"]
        assert not _dead_letters(work / "materialized")
    for key in outcomes[raised]:
        assert outcomes[raised][key] == outcomes[default][key], key


async def _staged_run(bootstrap: str, topic: str, work: Path, image: bytes) -> dict[str, Any]:
    """Stage a chunked call, record it, read it back by its receipt; put a chunked entry the sink reads again."""
    call = staged_call("run-r", "call-0", [1, 2, 3], list(range(10, 40)))
    turn = Turn(call, [user("run-r question")], [assistant("run-r answer")])
    sink = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, writer_id="w")
    ledger = KafkaCaptureLedger(
        bootstrap_servers=bootstrap, topic=topic, store_dir=work / "ledger", writer_id="w"
    )
    source = KafkaStagingSource(bootstrap_servers=bootstrap, topic=topic, store_dir=work / "source")
    puts = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, writer_id="w", spill_dir=work / "spill")
    try:
        staged = await asyncio.to_thread(sink.stage, call, attachments={"image": image})
        assert staged.ok, staged
        await ledger.record(commit_for(turn))
        manifest = await ledger.manifest("run-r")
        receipt = RolloutReceipt(
            rollout_id="run-r",
            manifest=[commit_for(turn).record],
            terminal_model_call_id="call-0",
            terminal_selection="declared",
        )
        row = verify_and_linearize(receipt, await asyncio.to_thread(source.fetch, [staged.staging_key]))
        assert row.token_ids == cumulative_tokens(call)
        attachments = await asyncio.to_thread(source.fetch_attachments, staged.staging_key)
        await puts.put(make_entry("run-r", "c-put", tokens=300_000))
        return {"manifest": manifest, "tokens": row.token_ids, "same_image": attachments == {"image": image}}
    finally:
        sink.close()
        source.close()
        await asyncio.gather(ledger.close(), puts.close())


@pytest.mark.slow
def test_a_stage_over_the_default_limit_is_staged_and_fetched_exactly_on_a_topic_made_with_raised_limits(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    record_limits(kafka_bootstrap, kafka_topic, 260 * MIB, 520 * MIB)
    media = os.urandom(DEFAULT_EVENT_LIMIT + MIB)
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, delivery_timeout_s=120)
    source = KafkaStagingSource(
        bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path, timeout_s=120
    )
    try:
        result = sink.stage(staged_call("media-r", "call-0", [1, 2], [3]), attachments={"video": media})
        assert result.ok, result
        assert source.fetch_attachments(result.staging_key) == {"video": media}
    finally:
        sink.close()
        source.close()
    assert not _dead_letters(tmp_path)


# ------------------------------------------------------------------ limits given to a constructor


def test_a_sink_or_materializer_given_other_limits_than_the_topics_is_refused_naming_both(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    raised = 300 * MIB
    with pytest.warns(DeprecationWarning, match="max_event_bytes is deprecated"):
        sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, max_event_bytes=raised)
    try:
        with pytest.raises(ConfigError) as refused:
            sink.stage(staged_call("r", "call-0", [1, 2], [3]))
        assert type(refused.value).__name__ == "TopicLimitsMismatchError"
        assert "max_event_bytes=314,572,800 (the topic has 268,435,456)" in str(refused.value)
        assert "tokcap topic create --max-event-bytes" in str(refused.value)
    finally:
        sink.close()

    async def put() -> None:
        with pytest.warns(DeprecationWarning):
            puts = KafkaTokenSink(
                bootstrap_servers=kafka_bootstrap, topic=kafka_topic, max_event_bytes=raised
            )
        try:
            with pytest.raises(ConfigError, match="the topic has 268,435,456"):
                await puts.put(make_entry("r", "c1", tokens=3))
        finally:
            await puts.close()

    asyncio.run(put())
    with pytest.warns(DeprecationWarning):
        materializer = Materializer(kafka_bootstrap, kafka_topic, tmp_path, max_event_bytes=raised)
    with pytest.raises(ConfigError, match="the topic has 268,435,456"):
        materializer.start()
    materializer.stop()
    assert _messages_on(kafka_bootstrap, kafka_topic) == 0

    # Giving the topic's own value still works for this release, with the warning.
    with pytest.warns(DeprecationWarning):
        agreeing = KafkaStagingSink(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, max_event_bytes=DEFAULT_EVENT_LIMIT
        )
    try:
        assert agreeing.stage(staged_call("r", "call-0", [1, 2], [3])).ok
    finally:
        agreeing.close()


# ------------------------------------------------------------------ topics made before limits were recorded


def test_a_topic_made_before_limits_were_recorded_is_read_with_the_default_limits(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    from transports.kafka.client.clients import ClientContext
    from transports.kafka.client.limits_record import read_topic_limits
    from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS

    context = ClientContext(kafka_bootstrap, {})
    assert read_topic_limits(context, kafka_topic) == TOPIC_DEFAULTS  # empty: nothing recorded yet

    async def put() -> None:
        puts = KafkaTokenSink(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, spill_dir=tmp_path / "spill"
        )
        try:
            await puts.put(make_entry("old-r", "c1", tokens=300_000))
        finally:
            await puts.close()

    asyncio.run(put())
    assert read_topic_limits(context, kafka_topic) == TOPIC_DEFAULTS  # a put at offset 0: an older topic
    store = _materialize(kafka_bootstrap, kafka_topic, tmp_path / "materialized")
    assert len(store.read_entries("old-r")) == 1 and not _dead_letters(tmp_path / "materialized")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        other = Materializer(kafka_bootstrap, kafka_topic, tmp_path / "other", max_event_bytes=300 * MIB)
        with pytest.raises(ConfigError, match="the topic has 268,435,456"):
            other.start()
        other.stop()


def test_a_config_block_naming_other_limits_than_the_topics_builds_a_sink_that_refuses_its_first_put(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    from tokcap.config import token_id_capture_config

    config = token_id_capture_config(
        {
            "token_id_capture": {
                "enabled": True,
                "sink": "transports.kafka:KafkaTokenSink",
                "allow_unresolved_continuations": True,
                "sink_kwargs": {
                    "bootstrap_servers": kafka_bootstrap,
                    "topic": kafka_topic,
                    "max_event_bytes": 300 * MIB,
                    "spill_dir": str(tmp_path / "spill"),
                },
            }
        }
    )
    with pytest.warns(DeprecationWarning, match="KafkaTokenSink: max_event_bytes is deprecated"):
        sink = config.build_sink()

    async def put() -> None:
        try:
            with pytest.raises(
                ConfigError, match=r"max_event_bytes=314,572,800 \(the topic has 268,435,456\)"
            ):
                await sink.put(make_entry("r-config", "c1"))
        finally:
            await sink.close()

    asyncio.run(put())
    assert _messages_on(kafka_bootstrap, kafka_topic) == 0


def test_tokcap_topic_create_records_the_limits_given_and_describe_shows_them(
    kafka_bootstrap: str, kafka_topic_factory: Any
) -> None:
    from cli_helpers import tokcap

    run = f"limits-{os.urandom(5).hex()}"
    kafka_topic_factory.created.extend([f"tokcap.{run}", f"tokcap-staged.tokcap.{run}"])
    base = ("--bootstrap", kafka_bootstrap, "--run", run)
    created = tokcap("topic", "create", *base, "--max-event-bytes", str(300 * MIB), "--json")
    assert created.returncode == 0, created.stderr
    payload_topic = f"tokcap-staged.tokcap.{run}"
    expected = {
        "max_event_bytes": 300 * MIB,
        "max_open_chunk_bytes": 600 * MIB,
        "staged_payload_topic": payload_topic,
    }
    assert created.json()["limits"] == expected
    described = tokcap("topic", "describe", *base, "--json").json()
    assert described["limits"] == expected
    refused = tokcap("topic", "create", *base, "--max-event-bytes", str(DEFAULT_EVENT_LIMIT))
    assert refused.returncode == 1
    assert "already has limits max_event_bytes=314,572,800" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
