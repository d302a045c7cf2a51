"""A restage hands the inner store Gym's own ``StagedCallRecord``, the type Gym's capture first staged, exactly.

The journal is tokcap's file store, or a run topic made as ``tokcap topic create`` makes it, whose staged
payloads lie on a topic of their own: there a restage reads each call back from its pieces.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gym_wheel import GymModules
from memory_staging_store import MemoryStagingStore
from staged_layout import keys_staged_apart
from staging_calls import conversation

from tokcap.staging import FileStagingSink, FileStagingSource, JournaledStagingSink, restage
from tokcap.staging.records import staging_key


@dataclass
class _Journal:
    """A journal sink and a way to read it back; ``topic`` is the run topic of a Kafka journal."""

    sink: Any
    source: Any
    bootstrap: str | None = None
    topic: str | None = None


@pytest.fixture(params=["file", "kafka"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Journal]:
    if request.param == "file":
        yield _Journal(FileStagingSink(tmp_path), FileStagingSource(tmp_path))
        return
    from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

    factory = request.getfixturevalue("kafka_topic_factory")
    topic = factory.staged_apart()
    where = {"bootstrap_servers": factory.bootstrap, "topic": topic}
    sink = KafkaStagingSink(**where)
    source = KafkaStagingSource(**where, store_dir=tmp_path / "projection")
    try:
        yield _Journal(sink, source, factory.bootstrap, topic)
    finally:
        sink.close()
        source.close()


def test_restage_gives_the_inner_store_gyms_staged_call_record_byte_for_byte(
    gym: GymModules, journal: _Journal
) -> None:
    gym_records = importlib.import_module("nemo_gym.token_id_capture.staging.records")
    gym_protocols = importlib.import_module("nemo_gym.token_id_capture.staging.protocols")
    first = MemoryStagingStore()
    assert isinstance(first, gym_protocols.StagingSink)
    sink = JournaledStagingSink(first, journal.sink)
    calls = [
        gym_records.StagedCallRecord.model_validate(turn.call.model_dump())
        for turn in conversation("gym-r", 3, extras=True)
    ]
    for number, call in enumerate(calls):
        result = sink.stage(call, attachments={"pixels": bytes([number]) * 7, "none": b""})
        assert isinstance(result, gym_records.StageResult) and result.ok
    fresh = MemoryStagingStore()
    report = restage(journal.source, fresh)
    assert report.restaged == 3
    assert [given.record_class for given in fresh.given] == [gym_records.StagedCallRecord] * 3
    assert fresh.given == first.given
    assert [given.record_json for given in fresh.given] == [call.model_dump_json() for call in calls]
    if journal.topic is not None and journal.bootstrap is not None:
        assert keys_staged_apart(journal.bootstrap, journal.topic) == {
            staging_key(call.rollout_id, call.model_call_id) for call in calls
        }
