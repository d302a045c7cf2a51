"""Gym 0.7.0's own middleware writes through tokcap's file store; Gym's builder and delivery read it back.

The reference is the same rollout run through Gym's own file store: the trajectory Gym builds from
tokcap's snapshot must be the one it builds from its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import Rollout, drive, tool_use_rollout, with_lost_call, without_snapshot_identity
from gym_wheel import GymModules

from tokcap.store import TokenCaptureStore


async def _build_over(gym: GymModules, rollout: Rollout, source: Any) -> dict[str, Any]:
    built: dict[str, Any] = await gym.consumer.trajectories_from_source(
        rollout.rollout_id, source, model="policy", verified_response=rollout.final_response
    )
    return built


def _gym_reference(gym: GymModules, rollout: Rollout, root: Path, *, delta_records: bool) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        store = gym.store.TokenCaptureStore(root)
        lineage = gym.lineage.FileLineageStore(root)
        await drive(gym, rollout, store, lineage, delta_records=delta_records)
        await lineage.close()
        return await _build_over(gym, rollout, store)

    return asyncio.run(run())


@pytest.mark.parametrize("delta_records", [False, True], ids=["full-prompts", "delta-records"])
def test_gym_builds_the_same_trajectory_from_tokcaps_file_store_as_from_its_own(
    gym: GymModules, tmp_path: Path, delta_records: bool
) -> None:
    rollout = tool_use_rollout("tool-use-1")
    reference = _gym_reference(gym, rollout, tmp_path / "gym", delta_records=delta_records)

    async def run() -> tuple[dict[str, Any], list[Any]]:
        store = TokenCaptureStore(tmp_path / "tokcap")
        lineage = gym.lineage.FileLineageStore(tmp_path / "tokcap")
        try:
            await drive(gym, rollout, store, lineage, delta_records=delta_records)
            built = await _build_over(gym, rollout, store)
            snapshot = await store.freeze(rollout.rollout_id)
            return built, list(snapshot.entries)
        finally:
            await lineage.close()
            await store.close()

    built, entries = asyncio.run(run())
    assert built["mask_sample"] is False, built.get("metrics")
    assert without_snapshot_identity(built) == without_snapshot_identity(reference)
    gym.builder.assert_prefix_contiguity(built["rebuilt_response"])
    by_call = {entry.model_call_id: entry for entry in entries}
    assert sorted(by_call) == ["call-1", "call-2", "call-3", "call-4"]
    assert by_call["call-1"].parent_resolution == "root"
    assert by_call["call-2"].parent_resolution == "resolved"
    assert by_call["call-2"].parent_call_id == "call-1"
    assert by_call["call-4"].parent_call_id == "call-2"
    assert by_call["call-2"].prompt_is_delta is delta_records


def test_gyms_delivery_rebuilds_a_tokcap_rollout_and_retires_exactly_the_consumed_snapshot(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("tool-use-2")
    result = rollout.result()

    async def run() -> tuple[dict[str, Any], bool, bool]:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
            built = await gym.delivery.finalize_rollout_token_capture(result, store)
            stale = dict(built, _capture_snapshot={**built["_capture_snapshot"], "version": -1})
            stale_retired = await gym.delivery.retire_rollout_token_capture(rollout.rollout_id, store, stale)
            retired = await gym.delivery.retire_rollout_token_capture(rollout.rollout_id, store, built)
            return built, stale_retired, retired
        finally:
            await lineage.close()
            await store.close()

    built, stale_retired, retired = asyncio.run(run())
    assert built["mask_sample"] is False
    assert "mask_sample" not in result
    assert result["_ng_token_capture"]["n_calls"] == 4
    generated = [
        item["generation_token_ids"]
        for item in result["response"]["output"]
        if "generation_token_ids" in item
    ]
    # The kept answer is the retry (call-4); the abandoned first answer is not delivered.
    assert generated == [[101, 102, 103], [104, 105], [109, 110]]
    assert result["response"]["output"][-1]["prompt_token_ids"] == [
        *[40, 41, 42, 43, 44],
        *[101, 102, 103, 61, 71],
        *[104, 105, 62, 72],
    ]
    assert stale_retired is False
    assert retired is True


def test_a_call_gym_could_not_capture_masks_the_rollout_read_from_tokcap(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = with_lost_call(tool_use_rollout("tool-use-3"), "call-2")
    result = rollout.result()

    async def run() -> tuple[dict[str, Any], bool]:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
            with pytest.warns(UserWarning, match="masking"):
                built = await gym.delivery.finalize_rollout_token_capture(result, store)
            retired = await gym.delivery.retire_rollout_token_capture(rollout.rollout_id, store, built)
            return built, retired
        finally:
            await lineage.close()
            await store.close()

    built, retired = asyncio.run(run())
    assert built["mask_sample"] is True
    assert result["mask_sample"] is True
    assert result["_ng_token_capture"]["capture_incomplete"] is True
    assert retired is False, "a masked build keeps its evidence"


def test_a_call_whose_entry_never_arrived_after_its_intent_masks_the_rollout(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("tool-use-4", retry_last=False)
    last = rollout.calls.pop()

    async def run() -> dict[str, Any]:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
            # The model server registered the last call's intent, then died before its entry was written.
            context = gym.sink.CaptureContext(rollout.rollout_id, last.call_id, store, lineage)
            token = gym.sink.set_token_sink(context)
            try:
                await gym.sink.register_call_intent()
            finally:
                gym.sink.reset_token_sink(token)
            return await _build_over(gym, rollout, store)
        finally:
            await lineage.close()
            await store.close()

    built = asyncio.run(run())
    assert built["mask_sample"] is True
    assert built["metrics"]["capture_incomplete"] is True
