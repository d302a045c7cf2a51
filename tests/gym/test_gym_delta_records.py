"""Delta records (Gym's ``prompt_is_delta``) read by tokcap's builder and consumer, against Gym 0.7.0's own.

Gym's middleware writes each rollout into tokcap's file store with ``delta_records`` on; tokcap's
consumer must then deliver what Gym's consumer delivers from the same snapshot, and mask what it masks.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

from gym_rollouts import USER, Call, Rollout, drive, tool_use_rollout
from gym_wheel import GymModules
from test_gym_lineage import drive_with_tokcap

from tokcap.builder import run_builder
from tokcap.consumer import trajectories_from_source
from tokcap.lineage import FileLineageResolver
from tokcap.records import TokenEntry
from tokcap.store import TokenCaptureStore


def _written_by_gym(
    gym: GymModules, rollout: Rollout, root: Path, *, delta_records: bool = True
) -> TokenCaptureStore:
    store = TokenCaptureStore(root)
    asyncio.run(drive(gym, rollout, store, FileLineageResolver(root), delta_records=delta_records))
    return store


def _both_consumers(
    gym: GymModules, store: TokenCaptureStore, rollout: Rollout, verified: dict[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    async def run() -> tuple[Any, dict[str, Any]]:
        ours = await trajectories_from_source(
            rollout.rollout_id, store, model="policy", verified_response=verified
        )
        theirs: dict[str, Any] = await gym.consumer.trajectories_from_source(
            rollout.rollout_id, store, model="policy", verified_response=verified
        )
        return ours, theirs

    return asyncio.run(run())


def _entries(store: TokenCaptureStore, rollout_id: str) -> list[TokenEntry]:
    return list(store.read_entries(rollout_id))


def test_a_three_call_tool_use_rollout_written_with_delta_records_builds_one_root_and_one_chain(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-delta", retry_last=False)
    store = _written_by_gym(gym, rollout, tmp_path)
    entries = _entries(store, "r-delta")
    assert [entry.prompt_is_delta for entry in sorted(entries, key=lambda e: e.model_call_id)] == [
        False,
        True,
        True,
    ]
    build = run_builder(entries)
    assert (build.notes.roots, build.notes.chains) == (1, 1)
    main = build.main_chain
    assert main is not None
    assert main.call_ids == ("call-1", "call-2", "call-3")


def test_a_delta_rollout_is_delivered_by_tokcap_exactly_as_gym_delivers_it(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-delta", retry_last=False)
    store = _written_by_gym(gym, rollout, tmp_path)
    for verified in (None, rollout.final_response):
        ours, theirs = _both_consumers(gym, store, rollout, verified)
        assert theirs["mask_sample"] is False
        assert ours.masked is False, ours.mask_reasons
        assert ours.response is not None
        assert ours.response["output"] == theirs["rebuilt_response"]["output"]


def _empty_root_then_delta_child(rollout_id: str) -> Rollout:
    """A root call with a 40-token prompt that generated nothing, then a call continuing it."""
    root_prompt = list(range(1000, 1040))
    empty_answer = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "(cut off)", "annotations": []}],
    }
    first = Call(
        "call-1",
        [dict(USER)],
        {
            "id": "resp_1",
            "object": "response",
            "model": "policy",
            "output": [
                {
                    **empty_answer,
                    "prompt_token_ids": root_prompt,
                    "generation_token_ids": [],
                    "generation_log_probs": [],
                }
            ],
        },
    )
    answer = {
        **empty_answer,
        "id": "msg_2",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
    }
    second = Call(
        "call-2",
        [dict(USER), copy.deepcopy(empty_answer), {"role": "user", "content": "go on"}],
        {
            "id": "resp_2",
            "object": "response",
            "model": "policy",
            "output": [
                {
                    **answer,
                    "prompt_token_ids": [*root_prompt, 7, 8],
                    "generation_token_ids": [200, 201],
                    "generation_log_probs": [-0.5, -0.25],
                }
            ],
        },
    )
    return Rollout(rollout_id, [first, second])


def test_a_delta_child_of_a_root_that_generated_nothing_is_masked_as_gym_masks_it(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = _empty_root_then_delta_child("r-empty-root")
    store = _written_by_gym(gym, rollout, tmp_path)
    child = next(entry for entry in _entries(store, "r-empty-root") if entry.model_call_id == "call-2")
    assert child.prompt_is_delta and child.prompt_token_ids == [7, 8]
    ours, theirs = _both_consumers(gym, store, rollout, None)
    assert theirs["mask_sample"] is True
    assert ours.masked is True
    assert ours.response is None
    assert "missing-parent" in ours.mask_reasons


def _lines(directory: Path, rollout_id: str) -> list[dict[str, Any]]:
    entries = [
        TokenEntry.from_json(line)
        for line in (directory / f"{rollout_id}.tokens.jsonl").read_bytes().splitlines()
    ]
    return [entry.model_dump(mode="json", exclude={"created_at"}) for entry in entries]


def test_tokcaps_capture_path_with_delta_records_writes_the_lines_gyms_middleware_writes(
    gym: GymModules, tmp_path: Path
) -> None:
    gym_dir, tokcap_dir = tmp_path / "gym", tmp_path / "tokcap"
    rollout = tool_use_rollout("r-lines")
    asyncio.run(
        drive(
            gym,
            rollout,
            gym.store.TokenCaptureStore(gym_dir),
            gym.lineage.FileLineageStore(gym_dir),
            delta_records=True,
        )
    )
    asyncio.run(
        drive_with_tokcap(
            rollout, TokenCaptureStore(tokcap_dir), FileLineageResolver(tokcap_dir), delta_records=True
        )
    )
    ours = _lines(tokcap_dir, "r-lines")
    assert [line["prompt_is_delta"] for line in ours] == [False, True, True, True]
    assert ours == _lines(gym_dir, "r-lines")


def test_a_rollout_captured_with_delta_records_is_delivered_as_the_same_rollout_captured_full(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-same")

    def delivered(directory: Path, delta_records: bool) -> dict[str, Any]:
        store = TokenCaptureStore(directory)
        asyncio.run(
            drive_with_tokcap(rollout, store, FileLineageResolver(directory), delta_records=delta_records)
        )
        built = asyncio.run(
            trajectories_from_source(rollout.rollout_id, store, verified_response=rollout.final_response)
        )
        assert built.masked is False, built.mask_reasons
        assert built.response is not None
        return built.response

    assert delivered(tmp_path / "delta", True) == delivered(tmp_path / "full", False)
