"""A restage hands the inner store Gym's own ``StagedCallRecord``, the type Gym's capture first staged, exactly."""

from __future__ import annotations

import importlib
from pathlib import Path

from gym_wheel import GymModules
from memory_staging_store import MemoryStagingStore
from staging_calls import conversation

from tokcap.staging import FileStagingSink, FileStagingSource, JournaledStagingSink, restage


def test_restage_gives_the_inner_store_gyms_staged_call_record_byte_for_byte(
    gym: GymModules, tmp_path: Path
) -> None:
    gym_records = importlib.import_module("nemo_gym.token_id_capture.staging.records")
    gym_protocols = importlib.import_module("nemo_gym.token_id_capture.staging.protocols")
    first = MemoryStagingStore()
    assert isinstance(first, gym_protocols.StagingSink)
    sink = JournaledStagingSink(first, FileStagingSink(tmp_path))
    calls = [
        gym_records.StagedCallRecord.model_validate(turn.call.model_dump())
        for turn in conversation("gym-r", 3, extras=True)
    ]
    for number, call in enumerate(calls):
        result = sink.stage(call, attachments={"pixels": bytes([number]) * 7, "none": b""})
        assert isinstance(result, gym_records.StageResult) and result.ok
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh)
    assert report.restaged == 3
    assert [given.record_class for given in fresh.given] == [gym_records.StagedCallRecord] * 3
    assert fresh.given == first.given
    assert [given.record_json for given in fresh.given] == [call.model_dump_json() for call in calls]
