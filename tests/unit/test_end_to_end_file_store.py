"""The whole path through the real file store: capture, freeze, rebuild, retire, and each capture failure."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.factories import assistant_message_item, responses_payload, token_fields
from tests.unit.capture_fakes import FlakySink, InjectedSinkFailure
from tokcap.consumer import MaskReason
from tokcap.delivery import MASK_SAMPLE_KEY, finalize_rollout_token_capture, retire_rollout_token_capture
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver
from tokcap.protocols import LineageResolver, TokenSink
from tokcap.sink import (
    CaptureContext,
    capture_tokens,
    register_call_intent,
    reset_token_sink,
    resolve_parent,
    set_token_sink,
)


@dataclass
class SimulatedAgent:
    """An agent whose model calls go through the capture middleware, as a model server would run them.

    It keeps its request (the messages it sends, echoing each kept answer and a tool result), so the
    capture path resolves each call's parent through ``lineage`` as a model server does.
    """

    rollout_id: str
    sink: TokenSink
    lineage: LineageResolver
    context: list[int] = field(default_factory=lambda: [1, 2, 3])
    request: list[dict[str, Any]] = field(default_factory=lambda: [{"role": "user", "content": "solve it"}])
    turns: int = 0

    async def model_call(self, call_id: str, generation: list[int], then: list[int]) -> dict[str, Any]:
        context = CaptureContext(
            self.rollout_id, call_id, self.sink, model="policy", lineage_store=self.lineage
        )
        token = set_token_sink(context)
        answer = assistant_message_item(f"{call_id} answers turn {self.turns}")
        try:
            await register_call_intent()
            await resolve_parent(copy.deepcopy(self.request))
            response = responses_payload({**answer, **token_fields(self.context, generation)})
            await capture_tokens(response, copy.deepcopy(self.request))
        finally:
            reset_token_sink(token)
        self.context = [*self.context, *generation, *then]
        self.request = [*self.request, answer, {"role": "user", "content": f"tool result {then}"}]
        self.turns += 1
        return response


async def play(agent: SimulatedAgent, calls: int) -> None:
    for index in range(calls):
        await agent.model_call(f"call-{index}", [10 + index, 20 + index], then=[90 + index])


def rollout_record(rollout_id: str) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "reward": 1.0,
        "response": {"output": [{"type": "message", "content": "x"}]},
    }


def test_a_captured_rollout_is_rebuilt_and_then_retired(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = TokenCaptureStore(tmp_path)
        agent = SimulatedAgent("rollout-ok", store, FileLineageResolver(tmp_path))
        await play(agent, 3)
        record = rollout_record("rollout-ok")
        result = await finalize_rollout_token_capture(record, store)
        assert not result.masked
        output = record["response"]["output"]
        assert [item["generation_token_ids"] for item in output] == [[10, 20], [11, 21], [12, 22]]
        # Cumulative prompts (Gym's format): each extends the previous prompt and generation.
        assert [item["prompt_token_ids"] for item in output] == [
            [1, 2, 3],
            [1, 2, 3, 10, 20, 90],
            [1, 2, 3, 10, 20, 90, 11, 21, 91],
        ]
        assert record["reward"] == 1.0
        assert await retire_rollout_token_capture("rollout-ok", store, result)
        assert store.read_state("rollout-ok").retired

    asyncio.run(scenario())


def test_a_failed_intent_fails_the_call_before_generation_and_nothing_is_lost(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = TokenCaptureStore(tmp_path)
        sink = FlakySink(store)
        agent = SimulatedAgent("rollout-begin", sink, FileLineageResolver(tmp_path))
        await agent.model_call("call-0", [10], then=[90])
        sink.fail_begin = True
        with pytest.raises(InjectedSinkFailure):
            await agent.model_call("call-1", [11], then=[91])
        assert agent.turns == 1
        sink.fail_begin = False
        await agent.model_call("call-1-again", [11], then=[91])
        result = await finalize_rollout_token_capture(rollout_record("rollout-begin"), store)
        assert not result.masked
        assert result.build is not None
        assert result.build.main_chain_id == "call-1-again"

    asyncio.run(scenario())


def test_a_failed_put_lets_the_call_succeed_and_masks_the_rollout(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = TokenCaptureStore(tmp_path)
        sink = FlakySink(store)
        agent = SimulatedAgent("rollout-put", sink, FileLineageResolver(tmp_path))
        await play(agent, 1)
        sink.fail_put = True
        response = await agent.model_call("call-1", [11], then=[91])
        assert response["output"][0]["generation_token_ids"] == [11]
        sink.fail_put = False
        await agent.model_call("call-2", [12], then=[])
        record = rollout_record("rollout-put")
        result = await finalize_rollout_token_capture(record, store)
        assert result.masked
        # The call after the lost one cannot find its parent either, so its link is unproven too.
        assert result.mask_reasons[0] == MaskReason.INCOMPLETE
        assert record[MASK_SAMPLE_KEY] is True
        assert not await retire_rollout_token_capture("rollout-put", store, result)
        assert len(store.read_entries("rollout-put")) == 2

    asyncio.run(scenario())


def test_when_marking_fails_too_the_dangling_intent_masks_the_rollout(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = TokenCaptureStore(tmp_path)
        sink = FlakySink(store)
        agent = SimulatedAgent("rollout-mark", sink, FileLineageResolver(tmp_path))
        await play(agent, 1)
        sink.fail_put = sink.fail_mark = True
        await agent.model_call("call-1", [11], then=[91])
        sink.fail_put = sink.fail_mark = False
        await agent.model_call("call-2", [12], then=[])
        assert not store.is_incomplete("rollout-mark")
        record = rollout_record("rollout-mark")
        result = await finalize_rollout_token_capture(record, store)
        assert result.masked
        assert MaskReason.INCOMPLETE in result.mask_reasons
        assert store.read_state("rollout-mark").dangling_intents == ("call-1",)
        assert record[MASK_SAMPLE_KEY] is True

    asyncio.run(scenario())


def test_a_lost_final_call_that_was_retried_is_masked(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = TokenCaptureStore(tmp_path)
        agent = SimulatedAgent("rollout-retry", store, FileLineageResolver(tmp_path))
        await play(agent, 2)
        context, request = list(agent.context), list(agent.request)
        await agent.model_call("call-2-first", [12], then=[])
        agent.context, agent.request = context, request
        await agent.model_call("call-2-second", [13], then=[])
        result = await finalize_rollout_token_capture(rollout_record("rollout-retry"), store)
        assert result.masked
        assert result.mask_reasons == (MaskReason.UNRESOLVED_RETRIES,)

    asyncio.run(scenario())
