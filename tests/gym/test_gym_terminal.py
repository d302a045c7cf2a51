"""Terminal attribution: the chain the verifier scored is delivered even when the rollout also holds
auxiliary calls, a sub-agent's calls or retries, exactly as Gym 0.7.0's consumer delivers it.

Gym's middleware writes each rollout into tokcap's file store (full and delta records); tokcap's consumer
and delivery are compared with Gym's on the same snapshot.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import Call, Rollout, drive, tool_use_rollout
from gym_wheel import GymModules

from tokcap.consumer import TrajectoryResult, trajectories_from_source
from tokcap.delivery import finalize_rollout_token_capture
from tokcap.lineage import FileLineageResolver
from tokcap.store import TokenCaptureStore


def _side_call(
    call_id: str, text: str, request: list[dict[str, Any]], prompt: list[int], generation: list[int]
) -> Call:
    item = {
        "type": "message",
        "id": f"msg_{call_id}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.25] * len(generation),
    }
    return Call(
        call_id, request, {"id": f"resp_{call_id}", "object": "response", "model": "policy", "output": [item]}
    )


def _with_auxiliary_call(rollout_id: str) -> Rollout:
    """A short title call that finishes before the task's first call (so it would be picked as the root)."""
    main = tool_use_rollout(rollout_id, retry_last=False)
    title = _side_call(
        "aux-title", "Paris weather", [{"role": "user", "content": "Title this chat."}], [900, 901], [902]
    )
    return Rollout(rollout_id, [title, *main.calls])


def _with_sub_agent(rollout_id: str) -> Rollout:
    """A sub-agent's two-turn conversation interleaved with the main agent's calls."""
    main = tool_use_rollout(rollout_id, retry_last=False)
    ask = [{"role": "user", "content": "Sub-task: find the forecast source."}]
    first = _side_call("sub-1", "Looking.", ask, [800, 801], [802, 803])
    answer = first.response["output"][0]
    echoed = {key: value for key, value in answer.items() if not key.endswith(("_token_ids", "_log_probs"))}
    second = _side_call(
        "sub-2",
        "Meteo-France.",
        [*copy.deepcopy(ask), echoed, {"role": "user", "content": "and?"}],
        [800, 801, 802, 803, 804],
        [805],
    )
    calls = list(main.calls)
    return Rollout(rollout_id, [calls[0], first, calls[1], second, *calls[2:]])


SHAPES = {
    "final-call-retried": lambda rid: tool_use_rollout(rid, retry_last=True),
    "auxiliary-call": _with_auxiliary_call,
    "sub-agent": _with_sub_agent,
}
MAIN_CHAINS = {
    "final-call-retried": ("call-1", "call-2", "call-4"),
    "auxiliary-call": ("call-1", "call-2", "call-3"),
    "sub-agent": ("call-1", "call-2", "call-3"),
}


def _captured(gym: GymModules, rollout: Rollout, root: Path, delta_records: bool) -> TokenCaptureStore:
    store = TokenCaptureStore(root)
    asyncio.run(drive(gym, rollout, store, FileLineageResolver(root), delta_records=delta_records))
    return store


def _both(
    gym: GymModules, store: TokenCaptureStore, rollout_id: str, **kwargs: Any
) -> tuple[TrajectoryResult, dict[str, Any]]:
    async def run() -> tuple[TrajectoryResult, dict[str, Any]]:
        ours = await trajectories_from_source(rollout_id, store, model="policy", **kwargs)
        theirs: dict[str, Any] = await gym.consumer.trajectories_from_source(
            rollout_id, store, model="policy", **kwargs
        )
        return ours, theirs

    return asyncio.run(run())


@pytest.mark.parametrize("delta_records", [False, True], ids=["full-records", "delta-records"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_scored_chain_is_delivered_past_auxiliary_calls_sub_agents_and_retries_as_gym_delivers_it(
    gym: GymModules, tmp_path: Path, shape: str, delta_records: bool
) -> None:
    rollout = SHAPES[shape](f"r-{shape}")
    store = _captured(gym, rollout, tmp_path, delta_records)
    ours, theirs = _both(gym, store, rollout.rollout_id, verified_response=rollout.result()["response"])
    assert theirs["mask_sample"] is False
    assert ours.masked is False, ours.mask_reasons
    assert ours.build is not None and ours.build.main_chain is not None
    assert ours.build.main_chain.call_ids == MAIN_CHAINS[shape]
    assert ours.response is not None
    assert ours.response["output"] == theirs["rebuilt_response"]["output"]
    assert ours.metrics["terminal_attribution"]["chain"] == "delivered"
    assert (
        ours.metrics["terminal_attribution"]["method"] == theirs["metrics"]["terminal_attribution"]["method"]
    )


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_without_a_scored_response_the_same_rollouts_are_masked_as_gym_masks_them(
    gym: GymModules, tmp_path: Path, shape: str
) -> None:
    rollout = SHAPES[shape](f"r-{shape}")
    store = _captured(gym, rollout, tmp_path, True)
    ours, theirs = _both(gym, store, rollout.rollout_id)
    assert theirs["mask_sample"] is True
    assert ours.masked is True and ours.response is None


def test_a_declared_response_id_names_the_kept_retry_and_delivery_rebuilds_that_chain(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-declared", retry_last=True)
    store = _captured(gym, rollout, tmp_path, True)
    record = {
        "_ng_rollout_id": rollout.rollout_id,
        "response": {"output": []},
        "terminal_response_id": "resp_3",
    }
    built = asyncio.run(finalize_rollout_token_capture(record, store))
    assert built.masked is False, built.mask_reasons
    assert built.build is not None and built.build.main_chain is not None
    assert built.build.main_chain.call_ids == ("call-1", "call-2", "call-3")
    assert record["_ng_token_capture"]["terminal_attribution"]["method"] == "declared"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tokcaps_delivery_rebuilds_the_record_gyms_delivery_rebuilds(
    gym: GymModules, tmp_path: Path, shape: str
) -> None:
    rollout = SHAPES[shape](f"r-{shape}")
    store = _captured(gym, rollout, tmp_path, True)
    ours_record, gym_record = rollout.result(), rollout.result()

    async def run() -> tuple[Any, Any]:
        ours = await finalize_rollout_token_capture(ours_record, store)
        theirs = await gym.delivery.finalize_rollout_token_capture(gym_record, store)
        return ours, theirs

    ours, theirs = asyncio.run(run())
    assert ours.masked is theirs["mask_sample"] is False
    assert ours_record["response"] == gym_record["response"]
    assert (
        ours.response is not None
        and ours.response["model"] == theirs["rebuilt_response"]["model"] == "policy"
    )
