"""Messages the materializer cannot apply are dead-lettered, mask their rollout, and never stall it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_helpers import tokcap
from confluent_kafka import Producer
from staging_calls import commit_for, conversation, staged_call
from store_contract import make_entry

from tokcap.delivery import finalize_rollout_token_capture
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import ledger_event
from tokcap.lineage import stamp_continuation
from tokcap.log.events import (
    EVENT_SCHEMA_VERSION,
    FreezeEvent,
    IntentEvent,
    LedgerEvent,
    LedgerFailureEvent,
    PutEvent,
    StageEvent,
    encode_event,
)
from tokcap.log.records import TokenEntry
from tokcap.staging import finalize_rollout
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.staging import KafkaCaptureLedger, KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.codec import encode_event_messages

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


# Messages a sink would have refused to send, produced by hand: each must be dead-lettered with a reason holding
# the fragments given (the rule and the field), and its rollout delivered masked, whichever reader takes it
# (materializer, timeline, lineage resolver). Numbers no JSON reader can hold exactly are refused by the parser.
REQUEST = [{"role": "user", "content": "hi"}]
CONTINUATION = [*REQUEST, {"role": "assistant", "content": "one"}, {"role": "user", "content": "more"}]


def crafted_put(
    rollout_id: str, encoding: str, *, literal: tuple[bytes, bytes] = (b"", b""), **fields: Any
) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """A put of call c1 a continuation could resolve to, with ``fields`` as a hand-made message carries them.

    ``literal`` replaces one JSON token by another in the value, for numbers no encoder writes (2**64, 1e400).
    """
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id="c1",
        prompt_token_ids=[1, 2, 3],
        generation_token_ids=[7, 8],
        generation_log_probs=[-0.5, -0.25],
        output_items=[{"type": "message", "role": "assistant", "content": "one"}],
        token_item_index=0,
    )
    stamp_continuation(entry, REQUEST)
    # A JSON put carries ``fields`` only in its bytes: the entry model would coerce or warn about them.
    event = PutEvent(
        rollout_id=rollout_id, entry=entry.model_copy(update=fields if encoding == "packed" else {})
    )
    if encoding == "packed":
        (message,) = encode_event_messages(event, next_chunk_group=lambda: "unused:0")
        return message.key, message.value, message.headers
    raw = orjson.loads(encode_event(event))
    raw["entry"].update(fields)
    headers = [("tokcap.type", b"put"), ("tokcap.schema_version", b"1"), ("tokcap.encoding", b"json")]
    return rollout_id.encode(), orjson.dumps(raw).replace(*literal), headers


def crafted_intent(rollout_id: str, call_id: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    headers = [("tokcap.type", b"intent"), ("tokcap.schema_version", b"1"), ("tokcap.encoding", b"json")]
    return (
        rollout_id.encode(),
        encode_event(IntentEvent(rollout_id=rollout_id, model_call_id=call_id)),
        headers,
    )


REFUSED_ON_THE_TOPIC = [
    (
        "r-json-negative",
        crafted_put("r-json-negative", "json", prompt_token_ids=[5, -7, 9]),
        ("input rules", "prompt_token_ids"),
    ),
    (
        "r-packed-negative",
        crafted_put("r-packed-negative", "packed", prompt_token_ids=[-7, 5, 9]),
        ("input rules", "prompt_token_ids"),
    ),
    (
        "r-json-true",
        crafted_put("r-json-true", "json", generation_token_ids=[True, 8]),
        ("input rules", "generation_token_ids"),
    ),
    (
        "r-json-float-id",
        crafted_put("r-json-float-id", "json", prompt_token_ids=[1, 2.0, 3]),
        ("input rules", "prompt_token_ids"),
    ),
    (
        "r-json-wide-id",
        crafted_put(
            "r-json-wide-id",
            "json",
            literal=(b"[4242,", b"[18446744073709551616,"),
            prompt_token_ids=[4242, 2, 3],
        ),
        ("input rules", "prompt_token_ids"),
    ),
    (
        "r-json-infinite-log-prob",
        crafted_put(
            "r-json-infinite-log-prob",
            "json",
            literal=(b"-0.125", b"-1e400"),
            generation_log_probs=[-0.125, -0.25],
        ),
        ("not valid JSON", "infinity"),
    ),
    (
        "r-json-short-log-probs",
        crafted_put("r-json-short-log-probs", "json", generation_log_probs=[-0.5]),
        ("invalid put event", "generation_log_probs"),
    ),
    ("r-newline-call", crafted_intent("r-newline-call", "a\nb"), ("input rules", "model_call_id")),
    ("r-nul-call", crafted_intent("r-nul-call", "c9\r\x00c1"), ("input rules", "model_call_id")),
    ("r-long-call", crafted_intent("r-long-call", "z" * 5000), ("input rules", "model_call_id")),
]
REFUSED_PUTS = [rollout_id for rollout_id, _, _ in REFUSED_ON_THE_TOPIC if not rollout_id.endswith("-call")]


def test_events_the_sinks_would_refuse_are_dead_lettered_naming_the_field_and_their_rollouts_delivered_masked(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    produce_raw(kafka_bootstrap, kafka_topic, [message for _, message, _ in REFUSED_ON_THE_TOPIC])
    rollouts = [rollout_id for rollout_id, _, _ in REFUSED_ON_THE_TOPIC]

    async def scenario() -> dict[str, Any]:
        sink = KafkaTokenSink(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, spill_dir=tmp_path / "spill"
        )
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            # The control: the same put sent by a sink is delivered unmasked.
            good_key, good_value, good_headers = crafted_put("r-healthy", "packed")
            produce_raw(kafka_bootstrap, kafka_topic, [(good_key, good_value, good_headers)])
            for rollout_id in rollouts[-3:]:
                await sink.put(make_entry(rollout_id, "c1"))
            results = {}
            for rollout_id in ["r-healthy", *rollouts]:
                record = {"rollout_id": rollout_id, "response": {"output": []}}
                results[rollout_id] = await finalize_rollout_token_capture(record, source)
            return results
        finally:
            await sink.close()
            await source.close()

    results = asyncio.run(scenario())
    assert not results["r-healthy"].masked
    assert {rollout_id: results[rollout_id].masked for rollout_id in rollouts} == dict.fromkeys(
        rollouts, True
    )
    lines = [
        orjson.loads(line) for line in (tmp_path / "kafka-dead-letter-p0.jsonl").read_bytes().splitlines()
    ]
    reasons = {line["rollout_id"]: line["reason"] for line in lines}
    assert sorted(reasons) == sorted(rollouts)
    for rollout_id, _, fragments in REFUSED_ON_THE_TOPIC:
        assert all(fragment in reasons[rollout_id] for fragment in fragments), reasons[rollout_id]
    store = TokenCaptureStore(tmp_path)
    for rollout_id in rollouts:
        assert store.read_intents(rollout_id) == {}
        assert not store.intents_path_for(rollout_id).exists()
        kept = [entry.prompt_token_ids for entry in store.read_entries(rollout_id)]
        assert kept == ([[0, 1, 2]] if rollout_id in rollouts[-3:] else [])


def test_the_timeline_and_the_lineage_resolver_are_not_fooled_by_events_the_sinks_would_refuse(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    produce_raw(kafka_bootstrap, kafka_topic, [message for _, message, _ in REFUSED_ON_THE_TOPIC])
    produce_raw(kafka_bootstrap, kafka_topic, [crafted_put("r-healthy", "packed")])
    produce_raw(kafka_bootstrap, kafka_topic, [message for _, message, _ in REFUSED_STAGING_EVENTS])
    for rollout_id, _, fragments in REFUSED_ON_THE_TOPIC + REFUSED_STAGING_EVENTS:
        completed = tokcap(
            "log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", rollout_id, "--json"
        )  # fmt: skip
        assert completed.returncode == 0, completed.stderr
        (event,) = completed.json()["events"]
        assert event["decision"] == "dead-lettered", event
        assert all(fragment in event["detail"] for fragment in fragments), event

    async def resolutions() -> dict[str, str]:
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        try:
            answers = {}
            for rollout_id in ("r-healthy", *REFUSED_PUTS):
                resolution = await resolver.resolve(rollout_id, CONTINUATION)
                answers[rollout_id] = resolution.status.value
            return answers
        finally:
            await resolver.close()

    assert asyncio.run(resolutions()) == {
        "r-healthy": "resolved",
        **dict.fromkeys(REFUSED_PUTS, "unresolved"),
    }


# Engine-side staging events a sink or ledger would have refused to send, produced by hand. Each rollout first
# has a call staged and recorded through the API; the crafted message must be dead-lettered naming the field,
# and both Kafka ledgers' manifest must answer (never raise) with a failure that masks the rollout and says why.
def crafted_json(event: Any) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    headers = [("tokcap.type", event.type.value.encode()), ("tokcap.schema_version", b"1")]
    return event.rollout_id.encode(), encode_event(event), headers


def crafted_ledger(
    rollout_id: str, call_id: str = "call-9", *, without: str = "", **row: Any
) -> tuple[bytes, bytes, Any]:
    """The ledger row of the rollout's call-0 under ``call_id``, ``row``'s columns replaced, ``without`` left out."""
    [turn] = conversation(rollout_id, 1)
    event = ledger_event(commit_for(turn))
    columns = {name: value for name, value in {**event.row, **row}.items() if name != without}
    return crafted_json(event.model_copy(update={"model_call_id": call_id, "row": columns}))


def crafted_failure(rollout_id: str, call_id: str, reason: str) -> tuple[bytes, bytes, Any]:
    return crafted_json(LedgerFailureEvent(rollout_id=rollout_id, model_call_id=call_id, reason=reason))


def crafted_stage(
    rollout: str, *, key: str | None = None, without: str = "", **row: Any
) -> tuple[bytes, bytes, Any]:
    """A stage of call-9 of the rollout with ``row``'s columns replaced and ``without`` left out."""
    call = staged_call(rollout, "call-9", [1, 2], [3, 4])
    columns = {
        name: value
        for name, value in {**call.model_dump(mode="json", exclude={"extras"}), **row}.items()
        if name != without
    }
    event = StageEvent(
        rollout_id=rollout,
        staging_key=key or f"{rollout}/call-9",
        model_call_id="call-9",
        row=columns,
    )
    (message,) = encode_event_messages(event, next_chunk_group=lambda: "unused:0")
    return message.key, message.value, list(message.headers)


REFUSED_STAGING_EVENTS = [
    ("r-ledger-empty-row", crafted_json(LedgerEvent(
        rollout_id="r-ledger-empty-row", model_call_id="call-9", commit_digest="0" * 64, row={}
    )), ("input rules", "column")),
    ("r-ledger-missing-column", crafted_ledger("r-ledger-missing-column", without="cum_len"), (
        "input rules", "cum_len"
    )),
    ("r-ledger-digest-shape", crafted_ledger("r-ledger-digest-shape", staging_digest="xyz"), (
        "input rules", "staging_digest"
    )),
    ("r-ledger-extra-column", crafted_ledger("r-ledger-extra-column", failure_reason="x"), (
        "input rules", "failure_reason"
    )),
    ("r-ledger-newline-call", crafted_ledger("r-ledger-newline-call", "a\nb"), ("input rules", "model_call_id")),
    ("r-ledger-nul-call", crafted_ledger("r-ledger-nul-call", "c9\x00"), ("input rules", "model_call_id")),
    ("r-ledger-empty-call", crafted_ledger("r-ledger-empty-call", ""), ("input rules", "model_call_id")),
    ("r-failure-empty-reason", crafted_failure("r-failure-empty-reason", "call-9", ""), ("input rules", "reason")),
    ("r-failure-newline-call", crafted_failure("r-failure-newline-call", "a\nb", "lost"), (
        "input rules", "model_call_id"
    )),
    ("r-stage-missing-column", crafted_stage("r-stage-missing-column", without="digest"), ("input rules", "digest")),
    ("r-stage-other-rollout-row", crafted_stage("r-stage-other-rollout-row", rollout_id="r-other"), (
        "input rules", "rollout_id"
    )),
    ("r-stage-foreign-key", crafted_stage("r-stage-foreign-key", key="r-other/call-9"), (
        "input rules", "staging_key"
    )),
]  # fmt: skip


def test_staging_events_the_api_would_refuse_are_dead_lettered_naming_the_field_and_the_manifest_says_why(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollouts = [rollout_id for rollout_id, _, _ in REFUSED_STAGING_EVENTS]

    async def scenario() -> dict[str, list[dict[str, Any]]]:
        sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        capture_ledger = KafkaCaptureLedger(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "ledger"
        )
        resolver = KafkaLineageResolver(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "resolver"
        )
        source = KafkaStagingSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "ledger"
        )
        try:
            for rollout_id in ["r-healthy", *rollouts]:
                [turn] = conversation(rollout_id, 1)
                assert sink.stage(turn.call).ok
                await capture_ledger.record(commit_for(turn))
            produce_raw(kafka_bootstrap, kafka_topic, [message for _, message, _ in REFUSED_STAGING_EVENTS])
            answers: dict[str, list[dict[str, Any]]] = {}
            for rollout_id in ["r-healthy", *rollouts]:
                manifests = [await capture_ledger.manifest(rollout_id), await resolver.manifest(rollout_id)]
                assert manifests[0] == manifests[1], rollout_id
                done = finalize_rollout(manifests[0], source)
                assert done.masked is (rollout_id != "r-healthy"), (rollout_id, done)
                answers[rollout_id] = manifests[0]["failures"]
            return answers
        finally:
            sink.close()
            source.close()
            await capture_ledger.close()
            await resolver.close()

    failures = asyncio.run(scenario())
    assert failures["r-healthy"] == []
    for store_dir in ("ledger", "resolver"):
        lines = [
            orjson.loads(line)
            for line in (tmp_path / store_dir / "kafka-dead-letter-p0.jsonl").read_bytes().splitlines()
        ]
        reasons = {line["rollout_id"]: line["reason"] for line in lines}
        assert sorted(reasons) == sorted(rollouts)
        for rollout_id, _, fragments in REFUSED_STAGING_EVENTS:
            assert all(fragment in reasons[rollout_id] for fragment in fragments), reasons[rollout_id]
    for rollout_id, _, fragments in REFUSED_STAGING_EVENTS:
        said = " ".join(failure["reason"] for failure in failures[rollout_id])
        assert "dead-lettered" in said and fragments[1] in said, (rollout_id, failures[rollout_id])
