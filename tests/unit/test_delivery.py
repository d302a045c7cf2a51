"""finalize_rollout_token_capture rewrites records in place and never raises; retire drops only what was consumed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.factories import make_entry
from tests.unit.agent_rollouts import AgentRollout
from tokcap.consumer import MaskReason
from tokcap.delivery import (
    MASK_SAMPLE_KEY,
    TOKEN_CAPTURE_METRICS_KEY,
    capture_build_can_retire,
    finalize_rollout_token_capture,
    retire_rollout_token_capture,
)
from tokcap.errors import InvalidInputError, RolloutFrozenError, UndeliverableBuilderError
from tokcap.files.store import TokenCaptureStore

T = TypeVar("T")


def run(awaitable: Awaitable[T]) -> T:
    async def wrapper() -> T:
        return await awaitable

    return asyncio.run(wrapper())


def captured_store(tmp_path: Path, rollout_id: str = "r") -> TokenCaptureStore:
    agent = AgentRollout(rollout_id, [1, 2, 3])
    agent.turn("c1", [10], then=[90])
    agent.turn("c2", [11])
    store = TokenCaptureStore(tmp_path)
    for entry in agent.entries:
        store.append(entry)
    return store


def record(rollout_id: Any = "r") -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "reward": 0.75,
        "task": {"prompt": "hi"},
        "response": {"id": "resp_agent", "output": [{"type": "message", "content": "text only"}]},
    }


def test_finalize_rebuilds_the_output_in_place_and_keeps_every_other_field(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    rec = record()
    result = run(finalize_rollout_token_capture(rec, store))
    assert not result.masked
    assert rec["reward"] == 0.75
    assert rec["task"] == {"prompt": "hi"}
    assert rec["response"]["id"] == "resp_agent"
    assert [item.get("generation_token_ids") for item in rec["response"]["output"]] == [[10], [11]]
    assert MASK_SAMPLE_KEY not in rec
    assert rec[TOKEN_CAPTURE_METRICS_KEY]["mask_reasons"] == []


def test_finalize_freezes_but_never_retires(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    run(finalize_rollout_token_capture(record(), store))
    state = store.read_state("r")
    assert not state.is_open
    assert not state.retired
    assert len(store.read_entries("r")) == 2


def test_a_masked_rollout_keeps_its_output_and_gets_mask_sample_with_reasons(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    store.mark_incomplete_now("r", "c3", "lost")
    rec = record()
    result = run(finalize_rollout_token_capture(rec, store))
    assert result.masked
    assert rec[MASK_SAMPLE_KEY] is True
    assert rec[TOKEN_CAPTURE_METRICS_KEY]["mask_reasons"] == [MaskReason.INCOMPLETE]
    assert rec["response"]["output"] == [{"type": "message", "content": "text only"}]


@pytest.mark.parametrize("rollout_id", [None, "", 7])
def test_a_record_without_a_rollout_id_is_masked_not_raised(tmp_path: Path, rollout_id: Any) -> None:
    rec = record(rollout_id)
    result = run(finalize_rollout_token_capture(rec, TokenCaptureStore(tmp_path)))
    assert result.masked
    assert rec[MASK_SAMPLE_KEY] is True
    assert rec[TOKEN_CAPTURE_METRICS_KEY]["mask_reasons"] == [MaskReason.NO_ROLLOUT_ID]


def test_a_failing_rollout_id_locator_masks_the_record(tmp_path: Path) -> None:
    def broken(_: Mapping[str, Any]) -> str | None:
        raise KeyError("meta")

    rec = record()
    result = run(finalize_rollout_token_capture(rec, TokenCaptureStore(tmp_path), rollout_id_of=broken))
    assert result.masked
    assert "KeyError" in rec[TOKEN_CAPTURE_METRICS_KEY]["errors"][0]


def test_a_custom_locator_finds_the_rollout_id_elsewhere(tmp_path: Path) -> None:
    store = captured_store(tmp_path, "nested")
    rec = record(None)
    rec["meta"] = {"capture": "nested"}
    result = run(
        finalize_rollout_token_capture(rec, store, rollout_id_of=lambda r: str(r["meta"]["capture"]))
    )
    assert not result.masked
    assert result.rollout_id == "nested"


def test_a_record_that_already_carries_tokens_is_unchanged_but_frozen_and_retirable(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    rec = record()
    rec["response"]["output"] = [{"type": "message", "generation_token_ids": [5], "prompt_token_ids": [4]}]
    before = {key: value for key, value in rec.items()}
    result = run(finalize_rollout_token_capture(rec, store))
    assert rec["response"] == before["response"]
    assert not result.masked
    assert not store.read_state("r").is_open
    assert capture_build_can_retire(result)
    assert run(retire_rollout_token_capture("r", store, result))


def test_a_record_without_a_response_object_is_masked(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    rec = record()
    rec["response"] = None
    result = run(finalize_rollout_token_capture(rec, store))
    assert result.masked
    assert result.mask_reasons == (MaskReason.NO_RESPONSE,)
    assert not capture_build_can_retire(result)


def test_retire_drops_exactly_the_consumed_snapshot(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    result = run(finalize_rollout_token_capture(record(), store))
    assert run(retire_rollout_token_capture("r", store, result))
    assert store.read_state("r").retired
    assert store.read_entries("r") == []


def test_a_masked_build_keeps_its_evidence(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    store.mark_incomplete_now("r", "c3", "lost")
    result = run(finalize_rollout_token_capture(record(), store))
    assert not capture_build_can_retire(result)
    assert not run(retire_rollout_token_capture("r", store, result))
    assert len(store.read_entries("r")) == 2


def test_a_write_after_the_freeze_keeps_the_stale_snapshot_from_being_retired(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    result = run(finalize_rollout_token_capture(record(), store))
    with pytest.raises(RolloutFrozenError):
        store.append(make_entry("r", "late", [9], [9]))
    assert not run(retire_rollout_token_capture("r", store, result))
    assert len(store.read_entries("r")) == 2


def test_retiring_with_another_rollouts_build_is_refused(tmp_path: Path) -> None:
    store = captured_store(tmp_path)
    result = run(finalize_rollout_token_capture(record(), store))
    with pytest.raises(InvalidInputError, match="with the build of rollout"):
        run(retire_rollout_token_capture("other", store, result))
    assert not store.read_state("r").retired


def test_a_builder_that_cannot_deliver_one_response_raises_before_the_record_is_touched(
    tmp_path: Path,
) -> None:
    store = captured_store(tmp_path)
    rec = record()
    with pytest.raises(UndeliverableBuilderError):
        run(finalize_rollout_token_capture(rec, store, builder="per_request"))
    assert rec == record()
    assert store.read_state("r").is_open


class ExplodingSource:
    """A source whose freeze returns something that is not a snapshot, so the consumer itself breaks."""

    async def freeze(self, rollout_id: str) -> Any:
        return object()

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        raise AssertionError("a broken build must never drop")

    async def close(self) -> None:
        return None


def test_an_unexpected_failure_while_finalizing_masks_the_record(tmp_path: Path) -> None:
    rec = record()
    result = run(finalize_rollout_token_capture(rec, ExplodingSource()))
    assert result.masked
    assert rec[MASK_SAMPLE_KEY] is True
    assert not run(retire_rollout_token_capture("r", ExplodingSource(), result))
