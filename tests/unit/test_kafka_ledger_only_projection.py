"""A ledger-only projection applies a topic exactly as a whole one does, minus the staged calls it passes over
by their type header: the same ledger rows, failures, fences and manifests, and no staged byte on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from kafka_topic_double import MemoryTopic
from staging_calls import commit_for, conversation

from tokcap.errors import ConfigError
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import FileCaptureLedger, ledger_event, ledger_failure_event
from tokcap.log.events import RetireEvent, StagedBlob, StageEvent
from transports.kafka.materializer import Materializer
from transports.kafka.private_projection import LEDGER_SKIPPED_TYPES
from transports.kafka.wire.codec import type_header


def _stage(turn: object, image: bytes) -> StageEvent:
    call = turn.call  # type: ignore[attr-defined]
    sha = hashlib.sha256(image).hexdigest()
    return StageEvent(
        rollout_id=call.rollout_id,
        staging_key=f"{call.rollout_id}/{call.model_call_id}",
        model_call_id=call.model_call_id,
        row=call.model_dump(mode="json", exclude={"extras"}),
        attachments={"image": StagedBlob(sha256=sha, size=len(image))},
    ).with_blob_bytes({sha: image})


@pytest.fixture
def topic() -> MemoryTopic:
    """Two rollouts staged and recorded (one stage chunked, one whole), a failure row, one rollout retired."""
    topic = MemoryTopic("tokcap.ledger-only")
    for rollout_id in ("kept", "retired"):
        for number, turn in enumerate(conversation(rollout_id, 3)):
            image = bytes([number]) * (50_000 if number == 1 else 300)
            topic.publish(_stage(turn, image), chunk_bytes=16_384)
            topic.publish(ledger_event(commit_for(turn)))
    topic.publish(ledger_failure_event("kept", "call-9", "worker_capture_failed"))
    topic.publish(RetireEvent(rollout_id="retired"))
    return topic


def _materialized(topic: MemoryTopic, directory: Path, skipped: frozenset[str]) -> TokenCaptureStore:
    materializer = Materializer(
        "memory",
        topic.name,
        directory,
        consumer_factory=topic.consumer,
        topic_id_reader=topic.topic_id,
        skipped_types=skipped,
    )
    materializer.start()
    try:
        assert materializer.wait_until_caught_up(60)
    finally:
        materializer.request_stop()
        topic.wake_consumers()
        materializer.stop()
    return TokenCaptureStore(directory)


def test_a_ledger_only_projection_holds_the_same_ledger_as_a_whole_one_and_no_staged_byte(
    topic: MemoryTopic, tmp_path: Path
) -> None:
    whole = _materialized(topic, tmp_path / "whole", frozenset())
    ledger_only = _materialized(topic, tmp_path / "ledger-only", LEDGER_SKIPPED_TYPES)
    for rollout_id in ("kept", "retired"):
        theirs, ours = whole.read_state(rollout_id), ledger_only.read_state(rollout_id)
        assert (ours.ledger, ours.ledger_failures, ours.retired) == (
            theirs.ledger,
            theirs.ledger_failures,
            theirs.retired,
        )
        assert not ours.staged
        assert FileCaptureLedger(ledger_only.root).manifest_now(rollout_id) == FileCaptureLedger(
            whole.root
        ).manifest_now(rollout_id)
    assert whole.read_state("kept").staged
    kept = FileCaptureLedger(ledger_only.root).manifest_now("kept")
    assert [row["model_call_id"] for row in kept["records"]] == ["call-0", "call-1", "call-2"]
    assert [path.name for path in ledger_only.root.glob("*.tokens.staged")] == []
    assert [path.name for path in ledger_only.root.glob("*.tokens.blobs")] == []
    assert list((tmp_path / "whole").glob("*.tokens.blobs"))


def test_a_projection_that_skips_events_starts_from_an_empty_directory_only(
    topic: MemoryTopic, tmp_path: Path
) -> None:
    _materialized(topic, tmp_path, frozenset())
    with pytest.raises(ConfigError, match="starts from an empty directory only"):
        Materializer(
            "memory",
            topic.name,
            tmp_path,
            consumer_factory=topic.consumer,
            topic_id_reader=topic.topic_id,
            skipped_types=LEDGER_SKIPPED_TYPES,
        )


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("tokcap.type", b"stage"), ("tokcap.encoding", b"staged")], "stage"),
        ([("tokcap.encoding", b"json"), ("tokcap.type", "ledger")], "ledger"),
        ([("tokcap.encoding", b"json")], None),
        ([("tokcap.type", b"\xff\xfe")], None),
        ([("tokcap.type", None)], ""),
    ],
)
def test_the_type_header_is_read_alone_and_never_raises(
    headers: list[tuple[str, str | bytes | None]], expected: str | None
) -> None:
    assert type_header(headers) == expected
