"""tokcap's own builder and projection read Gym-made records, and their output has Gym's shape."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import drive, tool_use_rollout
from gym_wheel import GymModules

from tokcap.builder import run_builder
from tokcap.consumer import trajectories_from_source
from tokcap.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.response_items import assert_prefix_contiguity, project_main_chain_response
from tokcap.store import TokenCaptureStore


def _token_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    names = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    return [{n: item[n] for n in names} for item in response["output"] if item.get("generation_token_ids")]


@pytest.mark.parametrize("delta_records", [False, True], ids=["full-prompts", "delta-records"])
def test_tokcaps_consumer_projects_gym_made_records_in_gyms_cumulative_format(
    gym: GymModules, tmp_path: Path, delta_records: bool
) -> None:
    rollout = tool_use_rollout("shapes-1", retry_last=False)

    async def run() -> tuple[Any, dict[str, Any]]:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage, delta_records=delta_records)
            ours = await trajectories_from_source(rollout.rollout_id, store)
            theirs = await gym.consumer.trajectories_from_source(
                rollout.rollout_id, store, verified_response=rollout.final_response
            )
            return ours, theirs
        finally:
            await lineage.close()
            await store.close()

    ours, theirs = asyncio.run(run())
    assert not ours.masked, ours.mask_reasons
    assert theirs["mask_sample"] is False
    gym.builder.assert_prefix_contiguity(ours.response)
    assert _token_items(ours.response) == _token_items(theirs["rebuilt_response"])
    assert assert_prefix_contiguity(theirs["rebuilt_response"]) == [
        *ours.response["output"][-1]["prompt_token_ids"],
        *ours.response["output"][-1]["generation_token_ids"],
    ]
    assert set(theirs["rebuilt_response"]) <= set(project_main_chain_response("shapes-1", ours.build))


def _entry(call_id: str, prompt: list[int], generation: list[int], **fields: Any) -> TokenEntry:
    return TokenEntry(
        rollout_id="shapes-2",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=[-0.5] * len(generation),
        **fields,
    )


def _delta_child(root_prompt: list[int], root_generation: list[int]) -> TokenEntry:
    child = _entry(
        "child", [7, 8], [9], parent_call_id="root", parent_resolution="resolved", prompt_is_delta=True
    )
    stamp_lineage(
        child,
        "root",
        parent_resolution=ParentResolutionStatus.RESOLVED,
        cumulative=[*root_prompt, *root_generation, 7, 8, 9],
    )
    return child


def test_a_delta_child_of_an_empty_root_keeps_the_roots_whole_prompt() -> None:
    root_prompt = list(range(100, 140))
    root = stamp_lineage(_entry("root", root_prompt, []), None, parent_resolution=ParentResolutionStatus.ROOT)
    build = run_builder([root, _delta_child(root_prompt, [])])
    assert build.main_chain is not None
    assert build.main_chain.root_prompt_token_ids == (*root_prompt, 7, 8)
    assert build.notes.empty_generation_calls == ("root",)


def test_a_delta_child_whose_parent_is_missing_is_in_no_chain_and_is_named() -> None:
    build = run_builder([_delta_child([1, 2], [3])])
    assert build.chains == ()
    assert build.notes.unresolved_parent_calls == ("child",)
    assert build.notes.parent_link_failures == {"delta_chain_unreconstructable": 1}


def test_a_record_whose_tokens_disagree_with_its_digest_is_in_no_chain_nor_is_its_delta_child() -> None:
    root = stamp_lineage(_entry("root", [1, 2], [3]), None, parent_resolution=ParentResolutionStatus.ROOT)
    tampered = root.model_copy(update={"generation_token_ids": [4]})
    build = run_builder([tampered, _delta_child([1, 2], [3])])
    assert build.chains == ()
    assert build.notes.parent_link_failures == {"digest_mismatch": 1, "delta_chain_unreconstructable": 1}


def test_tokcaps_delivery_reads_a_gym_record_and_its_result_reads_as_gyms_build(
    gym: GymModules, tmp_path: Path
) -> None:
    from tokcap.delivery import finalize_rollout_token_capture, retire_rollout_token_capture

    rollout = tool_use_rollout("shapes-3")
    record = rollout.result()

    async def run() -> tuple[Any, bool, bool]:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
            built = await finalize_rollout_token_capture(record, store)
            # Gym's own gate and retirement take tokcap's result as they take Gym's dict.
            can_retire = gym.delivery.capture_build_can_retire(built)
            retired = await retire_rollout_token_capture(rollout.rollout_id, store, built)
            return built, can_retire, retired
        finally:
            await lineage.close()
            await store.close()

    built, can_retire, retired = asyncio.run(run())
    assert built["mask_sample"] is False, built["metrics"]
    assert built["rebuilt_response"]["output"] == record["response"]["output"]
    assert set(built["_capture_snapshot"]) == {"snapshot_id", "version"}
    assert "mask_sample" not in record
    assert record["_ng_token_capture"]["terminal_chain"] == "delivered"
    generated = [
        item["generation_token_ids"]
        for item in record["response"]["output"]
        if "generation_token_ids" in item
    ]
    # The retried answer the harness kept (resp_4, matched by response id), not the abandoned one.
    assert generated == [[101, 102, 103], [104, 105], [109, 110]]
    gym.builder.assert_prefix_contiguity(record["response"])
    assert can_retire is True
    assert retired is True


def test_a_declared_terminal_that_no_call_served_masks_the_rollout(gym: GymModules, tmp_path: Path) -> None:
    from tokcap.delivery import finalize_rollout_token_capture

    rollout = tool_use_rollout("shapes-4")
    record = {**rollout.result(), "terminal_response_id": "resp_never_served"}

    async def run() -> Any:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
            return await finalize_rollout_token_capture(record, store)
        finally:
            await lineage.close()
            await store.close()

    built = asyncio.run(run())
    assert built["mask_sample"] is True
    assert record["mask_sample"] is True
    assert "terminal-not-attributed" in record["_ng_token_capture"]["mask_reasons"]


@pytest.mark.parametrize(
    "config",
    [
        {"token_id_capture": {"enabled": True, "dir": "/var/tokcap"}},
        {"token_id_capture": {"enabled": True}, "model_call_capture_dir": "/var/tokcap"},
        {"token_id_capture": {"enabled": False, "dir": "/var/tokcap"}},
        {
            "token_id_capture": {
                "enabled": True,
                "sink": "a.b:C",
                "lineage_store": "a.b:L",
                "dir": "/var/tokcap",
            }
        },
    ],
)
def test_the_capture_dirs_of_a_config_are_the_ones_gym_reads(gym: GymModules, config: dict[str, Any]) -> None:
    from tokcap.consumer import token_id_capture_dirs_from_config

    assert token_id_capture_dirs_from_config(config) == gym.consumer.token_id_capture_dirs_from_config(config)


def test_the_synchronous_file_store_helpers_build_and_clear_like_gyms(
    gym: GymModules, tmp_path: Path
) -> None:
    from tokcap.consumer import clear_token_captures_for_rollouts, trajectories_for_rollout

    rollout = tool_use_rollout("shapes-5")

    async def capture() -> None:
        store = TokenCaptureStore(tmp_path)
        lineage = gym.lineage.FileLineageStore(tmp_path)
        try:
            await drive(gym, rollout, store, lineage)
        finally:
            await lineage.close()
            await store.close()

    asyncio.run(capture())
    assert trajectories_for_rollout(rollout.rollout_id, []) is None
    built = trajectories_for_rollout(rollout.rollout_id, [tmp_path], verified_response=rollout.final_response)
    assert built is not None
    assert built["mask_sample"] is False
    gym.builder.assert_prefix_contiguity(built["rebuilt_response"])
    clear_token_captures_for_rollouts([rollout.result()], [tmp_path])
    assert not TokenCaptureStore(tmp_path).read_entries(rollout.rollout_id)
