"""The journal behind an in-memory staging store on a real broker: cursor as offsets, restage from the projection."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from kafka_broker_fixture import TopicFactory
from memory_staging_store import MemoryStagingStore
from staging_calls import commit_for, conversation, staged_call

from tokcap.ledger import PendingRollout
from tokcap.staging import (
    JournalCursor,
    JournaledStagingSink,
    RestageReport,
    cursors_taken,
    restage,
    staged_rollouts,
)
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

pytestmark = pytest.mark.kafka

ATTACHMENTS = {"empty": b"", "image": bytes(range(256)) * 40}


_APART: set[str] = set()
"""The journal topics made with a staged-payload topic (and so a limits record at offset 0 of partition 0)."""


@pytest.fixture(params=["staged inline", "staged apart"])
def journal_topic(kafka_topic_factory: TopicFactory, request: pytest.FixtureRequest) -> str:
    """Three partitions, so a cursor holds an offset per partition and rollouts land on several; once with
    stages inline (a topic made before payload topics), once with their payloads on a topic of their own."""
    if request.param == "staged apart":
        topic = kafka_topic_factory.staged_apart("journal", partitions=3)
        _APART.add(topic)
        return topic
    return kafka_topic_factory("journal", partitions=3)


@pytest.fixture
def journal_sink(kafka_bootstrap: str, journal_topic: str) -> Iterator[KafkaStagingSink]:
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=journal_topic)
    try:
        yield sink
    finally:
        sink.close()


def _restaged(
    bootstrap: str, topic: str, store_dir: Path, inner: MemoryStagingStore, after: JournalCursor | None = None
) -> RestageReport:
    source = KafkaStagingSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    try:
        return restage(source, inner, after=after)
    finally:
        source.close()


def test_a_kafka_cursor_is_offsets_per_partition_and_restage_gives_back_exactly_the_calls_staged_after_it(
    kafka_bootstrap: str, journal_topic: str, journal_sink: KafkaStagingSink, tmp_path: Path
) -> None:
    first = MemoryStagingStore()
    sink = JournaledStagingSink(first, journal_sink, cursor_dir=tmp_path / "cursors")
    (tmp_path / "cursors").mkdir()
    before = [turn.call for rollout in ("a", "b", "c") for turn in conversation(rollout, 2)]
    for call in before:
        assert sink.stage(call).ok
    cursor = JournalCursor.from_json(sink.cursor("step-10").to_json())
    assert cursor.topic == journal_topic and sorted(cursor.offsets) == [0, 1, 2]
    # A topic made with a payload topic holds its limits record first; each staged call is one message after it.
    recorded = 1 if journal_topic in _APART else 0
    assert sum(cursor.offsets.values()) == recorded + len(before)
    after = [
        staged_call("a", "late", [7], [8], extras={"n": 1}),
        *(t.call for t in conversation("d", 2, extras=True)),
    ]
    for number, call in enumerate(after):
        assert sink.stage(call, attachments=ATTACHMENTS if number else None).ok
    fresh = MemoryStagingStore()
    report = _restaged(kafka_bootstrap, journal_topic, tmp_path / "p1", fresh, after=cursor)
    assert report.restaged == 3
    assert fresh.stored == {
        key: call for key, call in first.stored.items() if key in {"a/late", "d/call-0", "d/call-1"}
    }
    assert [
        orjson.loads(c.record_json)["model_call_id"] for c in fresh.given if c.record_json.find('"d"') > 0
    ] == [
        "call-0",
        "call-1",
    ]
    everything = MemoryStagingStore()
    assert _restaged(kafka_bootstrap, journal_topic, tmp_path / "p2", everything).restaged == 9
    assert everything.stored == first.stored
    assert cursors_taken(tmp_path / "cursors") == [cursor]


def test_two_fresh_stores_restaged_from_two_projections_are_equal_and_twice_gives_identical_repeats(
    kafka_bootstrap: str, journal_topic: str, journal_sink: KafkaStagingSink, tmp_path: Path
) -> None:
    sink = JournaledStagingSink(MemoryStagingStore(), journal_sink)
    for number, turn in enumerate(conversation("a", 3, extras=True) + conversation("b", 2)):
        assert sink.stage(turn.call, attachments={"n": bytes([number])}).ok
    one, two = MemoryStagingStore(), MemoryStagingStore()
    _restaged(kafka_bootstrap, journal_topic, tmp_path / "p1", one)
    _restaged(kafka_bootstrap, journal_topic, tmp_path / "p2", two)
    assert one.given == two.given and one.stored == two.stored and len(one.given) == 5
    _restaged(kafka_bootstrap, journal_topic, tmp_path / "p1", one)
    assert one.given == two.given + two.given and one.stored == two.stored


def test_a_refused_stage_is_recorded_on_the_topic_and_never_restaged_and_retired_rollouts_are_skipped(
    kafka_bootstrap: str, journal_topic: str, journal_sink: KafkaStagingSink, tmp_path: Path
) -> None:
    inner = MemoryStagingStore(refuse=frozenset({"a/call-1"}))
    sink = JournaledStagingSink(inner, journal_sink)
    results = [sink.stage(turn.call) for rollout in ("a", "b", "c") for turn in conversation(rollout, 2)]
    assert [result.ok for result in results] == [True, False, True, True, True, True]
    ledger = KafkaLineageResolver(
        bootstrap_servers=kafka_bootstrap, topic=journal_topic, store_dir=tmp_path / "l"
    )
    try:
        asyncio.run(ledger.record(commit_for(conversation("b", 1)[0])))
        asyncio.run(ledger.record(commit_for(conversation("a", 1)[0])))
        asyncio.run(ledger.record_failure("a", "call-1", "worker_capture_failed"))
        asyncio.run(ledger.retire(["c"]))
        asyncio.run(ledger.delete(["d"]))
        assert asyncio.run(ledger.pending_rollouts()) == [
            PendingRollout("a", has_failures=True),
            PendingRollout("b", has_failures=False),
        ]
    finally:
        asyncio.run(ledger.close())
    fresh = MemoryStagingStore()
    report = _restaged(kafka_bootstrap, journal_topic, tmp_path / "p", fresh)
    assert (report.restaged, report.failed, report.retired) == (3, 1, 1)
    assert sorted(fresh.stored) == ["a/call-0", "b/call-0", "b/call-1"]
    source = KafkaStagingSource(
        bootstrap_servers=kafka_bootstrap, topic=journal_topic, store_dir=tmp_path / "p"
    )
    try:
        status = {rollout.rollout_id: rollout for rollout in staged_rollouts(source)}
    finally:
        source.close()
    assert sorted(status) == ["a", "b"]
    assert (status["a"].staged_calls, status["a"].unledgered_calls) == (2, 0)
    assert (status["b"].staged_calls, status["b"].unledgered_calls) == (2, 1)
