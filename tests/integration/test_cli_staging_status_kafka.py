"""``tokcap staging status --bootstrap --run``: the run topic's staged calls not retired, each aged by its stage
message's time, the calls no ledger row names, and the pending rollouts, as the file store's status says them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from cli_helpers import tokcap
from staging_calls import commit_for, conversation

from tokcap.staging import JournaledStagingSink
from tokcap.staging.records import StageResult
from transports.kafka.client.clients import ClientContext
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.staging import KafkaStagingSink
from transports.kafka.wire.topic_limits import TopicLimits


async def _journal(bootstrap: str, topic: str, store_dir: Path) -> None:
    """``done`` committed whole; ``orphan``'s last call staged with no ledger row; ``old`` retired."""
    sink = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=4096)
    ledger = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    try:
        for rollout, turns, recorded in (("done", 2, 2), ("orphan", 2, 1), ("old", 1, 1)):
            for number, turn in enumerate(conversation(rollout, turns, extras=True)):
                attachments = {"image": b"i" * 10_000, "empty": b""} if number == 0 else None
                assert sink.stage(turn.call, attachments=attachments).ok
                if number < recorded:
                    await ledger.record(commit_for(turn))
        await ledger.retire(["old"])
    finally:
        sink.close()
        await ledger.close()


def test_the_status_of_a_run_topic_ages_each_staged_call_by_its_message_and_names_those_without_a_ledger_row(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory.staged_apart("staging-status", partitions=3)
    before = time.time()
    asyncio.run(_journal(kafka_bootstrap, topic, tmp_path / "ledger"))
    shown = tokcap("staging", "status", "--bootstrap", kafka_bootstrap, "--topic", topic, "--json")
    assert shown.returncode == 0, shown.stderr
    status = shown.json()
    assert status["topic"] == topic and status["age_basis"] == "message-time"
    by_id = {rollout["rollout_id"]: rollout for rollout in status["rollouts"]}
    assert sorted(by_id) == ["done", "orphan"]
    assert [call["staging_key"] for call in by_id["orphan"]["unledgered"]] == ["orphan/call-1"]
    ceiling = time.time() - before + 5
    assert all(0 <= call["age_s"] <= ceiling for call in by_id["orphan"]["unledgered"])
    assert 0 <= by_id["done"]["age_s"] <= ceiling
    assert by_id["done"]["staged_bytes"] > 10_000 and by_id["done"]["ledger_rows"] == 2
    assert status["pending_rollouts"] == [
        {"rollout_id": "done", "has_failures": False},
        {"rollout_id": "orphan", "has_failures": False},
    ]
    table = tokcap("staging", "status", "--bootstrap", kafka_bootstrap, "--topic", topic)
    assert table.returncode == 0, table.stderr
    assert "no ledger row: orphan/call-1" in table.stdout


class _Store:
    """A trainer's in-memory store: accepts every call."""

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        return StageResult(ok=True, staging_key=f"{record.rollout_id}/{record.model_call_id}")


def read_limits(bootstrap: str, topic: str) -> TopicLimits:
    return read_topic_limits(ClientContext(bootstrap, {}), topic)


def test_the_cursors_a_kafka_journal_recorded_are_listed_from_its_cursor_dir(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    journal = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic)
    sink = JournaledStagingSink(_Store(), journal, cursor_dir=tmp_path)

    try:
        (turn,) = conversation("cursored", 1)
        assert sink.stage(turn.call).ok
        sink.cursor("step-3")
    finally:
        journal.close()
    shown = tokcap(
        "staging",
        "status",
        "--bootstrap",
        kafka_bootstrap,
        "--topic",
        staging_topic,
        "--cursor-dir",
        str(tmp_path),
        "--json",
    )
    assert shown.returncode == 0, shown.stderr
    (cursor,) = shown.json()["cursors"]
    # The one staged call is the topic's one message, after the limits record of a topic made with a payload topic.
    ends = {"0": 2} if read_limits(kafka_bootstrap, staging_topic).staged_payload_topic else {"0": 1}
    assert cursor["label"] == "step-3" and cursor["topic"] == staging_topic and cursor["offsets"] == ends


def test_the_status_of_a_run_that_does_not_exist_fails_with_one_line(kafka_bootstrap: str) -> None:
    shown = tokcap(
        "staging", "status", "--bootstrap", kafka_bootstrap, "--run", "no-such-run-h7", "--timeout", "5"
    )
    assert shown.returncode == 1
    assert shown.stderr.count("\n") == 1 and shown.stderr.startswith("tokcap: error:")
