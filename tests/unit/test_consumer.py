"""trajectories_from_source masks malformed rollouts instead of raising, and the mask-fraction guard."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.factories import make_entry
from tests.unit.agent_rollouts import AgentRollout
from tokcap.consumer import MaskFractionGuard, MaskReason, TrajectoryResult, trajectories_from_source
from tokcap.errors import MaskFractionExceededError, UndeliverableBuilderError, UnknownBuilderError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from tokcap.protocols import TokenCaptureSnapshot

T = TypeVar("T")


def run(awaitable: Awaitable[T]) -> T:
    async def wrapper() -> T:
        return await awaitable

    return asyncio.run(wrapper())


def store_with(tmp_path: Path, entries: list[TokenEntry]) -> TokenCaptureStore:
    store = TokenCaptureStore(tmp_path)
    for entry in entries:
        store.append(entry)
    return store


def three_turns() -> AgentRollout:
    agent = AgentRollout("r", [1, 2, 3])
    agent.turn("c1", [10], then=[90])
    agent.turn("c2", [11], then=[91])
    agent.turn("c3", [12])
    return agent


class FixedSource:
    """A source that returns a snapshot it was given, or fails to freeze."""

    def __init__(self, snapshot: TokenCaptureSnapshot | None) -> None:
        self.snapshot = snapshot

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        if self.snapshot is None:
            raise ConnectionError("broker unreachable")
        return self.snapshot

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        return False

    async def close(self) -> None:
        return None


def test_a_complete_rollout_yields_its_response_and_the_frozen_snapshot_identity(tmp_path: Path) -> None:
    store = store_with(tmp_path, three_turns().entries)
    result = run(trajectories_from_source("r", store))
    assert not result.masked
    assert result.mask_reasons == ()
    assert result.response is not None
    assert result.response["metadata"]["tokcap_chain_id"] == "c3"
    state = store.read_state("r")
    assert (result.snapshot_id, result.version) == (state.snapshot_id, state.version)
    assert result.metrics["roots"] == 1
    assert result.metrics["delivered_fraction"] == 1.0
    assert result.metrics["masked"] is False


def test_a_lost_middle_call_is_masked_through_its_incomplete_mark(tmp_path: Path) -> None:
    store = store_with(tmp_path, three_turns().without("c2"))
    store.mark_incomplete_now("r", "c2", "put failed")
    result = run(trajectories_from_source("r", store))
    assert result.masked
    assert result.mask_reasons == (MaskReason.INCOMPLETE,)
    assert result.response is None
    assert result.build is not None


def test_a_lost_final_call_leaves_an_unresolved_retry_and_is_masked(tmp_path: Path) -> None:
    agent = three_turns()
    agent.attempt("c4-first", [13])
    agent.attempt("c4-second", [14])
    result = run(trajectories_from_source("r", store_with(tmp_path, agent.entries)))
    assert result.masked
    assert MaskReason.UNRESOLVED_RETRIES in result.mask_reasons
    assert result.metrics["unresolved_retries"] == [["c4-first", "c4-second"]]


def test_compaction_is_masked_as_more_than_one_root_and_chain(tmp_path: Path) -> None:
    agent = three_turns()
    agent.compact([5, 5, 5, 5, 5, 5, 5, 5, 5])
    agent.turn("c4", [13])
    result = run(trajectories_from_source("r", store_with(tmp_path, agent.entries)))
    assert result.masked
    assert set(result.mask_reasons) == {MaskReason.MULTIPLE_ROOTS, MaskReason.MULTIPLE_CHAINS}
    assert result.metrics["branch_chain_ids"] == ["c4"]


def test_quarantined_calls_mask_the_rollout(tmp_path: Path) -> None:
    entries = [
        make_entry("r", "a", [1], [2]),
        make_entry("r", "b", [1], [2]),
        make_entry("r", "child", [1, 2, 3], [4]),
    ]
    result = run(trajectories_from_source("r", store_with(tmp_path, entries)))
    assert result.masked
    assert MaskReason.QUARANTINED_CALLS in result.mask_reasons


def test_an_empty_snapshot_is_masked(tmp_path: Path) -> None:
    result = run(trajectories_from_source("nothing-captured", TokenCaptureStore(tmp_path)))
    assert result.masked
    assert result.mask_reasons == (MaskReason.EMPTY,)
    assert result.snapshot_id is not None


def test_only_empty_generations_leave_no_main_chain_and_are_masked(tmp_path: Path) -> None:
    result = run(trajectories_from_source("r", store_with(tmp_path, [make_entry("r", "c1", [1], [])])))
    assert result.masked
    assert result.mask_reasons == (MaskReason.NO_MAIN_CHAIN,)
    assert result.metrics["empty_generation_calls"] == ["c1"]


def test_a_build_that_raises_masks_the_rollout_instead_of_raising() -> None:
    conflicting = (make_entry("r", "c1", [1], [2]), make_entry("r", "c1", [1], [3]))
    source = FixedSource(TokenCaptureSnapshot("r", conflicting, False, "snap", 1))
    result = run(trajectories_from_source("r", source))
    assert result.masked
    assert result.mask_reasons == (MaskReason.BUILD_FAILED,)
    assert "appears twice" in result.metrics["errors"][0]
    assert (result.snapshot_id, result.version) == ("snap", 1)


def test_a_failed_freeze_masks_the_rollout_without_a_snapshot_identity() -> None:
    result = run(trajectories_from_source("r", FixedSource(None)))
    assert result.masked
    assert result.mask_reasons == (MaskReason.FREEZE_FAILED,)
    assert (result.snapshot_id, result.version) == (None, None)


def test_per_request_is_refused_for_single_response_delivery_before_freezing(tmp_path: Path) -> None:
    store = store_with(tmp_path, three_turns().entries)
    with pytest.raises(UndeliverableBuilderError, match="prefix_merging"):
        run(trajectories_from_source("r", store, builder="per_request"))
    with pytest.raises(UnknownBuilderError):
        run(trajectories_from_source("r", store, builder="nope"))
    assert store.read_state("r").is_open


def result(masked: bool) -> TrajectoryResult:
    return TrajectoryResult("r", None, masked, ("incomplete",) if masked else (), "s", 1)


def test_the_guard_waits_for_the_minimum_samples_before_judging() -> None:
    guard = MaskFractionGuard(max_mask_fraction=0.2, min_samples=4)
    for _ in range(3):
        guard.record(result(masked=True))
    with pytest.raises(MaskFractionExceededError) as raised:
        guard.record(result(masked=True))
    message = str(raised.value)
    assert "1.0000" in message
    assert "max_mask_fraction=0.2" in message
    assert "mask_fraction_min_samples=4" in message


def test_the_guard_allows_a_fraction_at_the_limit() -> None:
    guard = MaskFractionGuard(max_mask_fraction=0.5, min_samples=2)
    guard.record(False)
    guard.record(True)
    assert guard.masked_fraction == 0.5
    with pytest.raises(MaskFractionExceededError):
        guard.record(True)


def test_a_guard_without_a_limit_never_raises() -> None:
    guard = MaskFractionGuard(max_mask_fraction=None, min_samples=1)
    for _ in range(10):
        guard.record(True)
    assert guard.masked_fraction == 1.0
