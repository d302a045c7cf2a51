"""Rollouts driven through Gym 0.7.0's own capture middleware, for any sink and lineage store.

A rollout is a list of model calls as a harness makes them: each call's request items (what the
harness sends, echoing earlier outputs without token arrays) and the served response (one output
item carries the token arrays). ``drive`` runs each call through Gym's ``register_call_intent``,
``resolve_parent`` and ``capture_tokens``, exactly as Gym's model server does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from gym_wheel import GymModules

USER = {"role": "user", "content": "What is the weather in Paris, and should I take an umbrella?"}


@dataclass(frozen=True)
class Call:
    call_id: str
    request: list[dict[str, Any]]
    response: dict[str, Any]


@dataclass
class Rollout:
    rollout_id: str
    calls: list[Call] = field(default_factory=list)

    @property
    def final_response(self) -> dict[str, Any]:
        """What the harness kept and the verifier scored: the last call's response."""
        return copy.deepcopy(self.calls[-1].response)

    def result(self) -> dict[str, Any]:
        """The finished rollout record as Gym's delivery receives it (token-free response, correlation key)."""
        response = self.final_response
        for item in response["output"]:
            for name in (
                "prompt_token_ids",
                "generation_token_ids",
                "generation_log_probs",
                "routed_experts",
            ):
                item.pop(name, None)
        return {"_ng_rollout_id": self.rollout_id, "response": response, "reward": 1.0}


def _tokens(prompt: list[int], generation: list[int]) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-(token % 7 + 1) / 8 for token in generation],
    }


def _function_call(number: int, city: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_item_{number}",
        "call_id": f"fc_{number}",
        "name": "get_weather",
        "arguments": f'{{"city": "{city}", "day": {number}}}',
        "status": "completed",
    }


def _message(text: str, number: int) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{number}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _response(number: int, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"resp_{number}", "object": "response", "model": "policy", "output": items}


def tool_use_rollout(rollout_id: str, *, retry_last: bool = True) -> Rollout:
    """Two tool calls, then the answer; with ``retry_last`` the answer is generated twice and the second kept.

    Token arrays: each prompt is the previous prompt + generation + the tool result's tokens, so the
    calls form one chain; the retried answer repeats the same request with a different generation.
    """
    rollout = Rollout(rollout_id)
    prompt = [40, 41, 42, 43, 44]
    request: list[dict[str, Any]] = [dict(USER)]
    steps = [(1, [101, 102, 103], "Paris"), (2, [104, 105], "Paris")]
    for number, generation, city in steps:
        item = _function_call(number, city)
        rollout.calls.append(
            Call(
                f"call-{number}",
                copy.deepcopy(request),
                _response(number, [{**item, **_tokens(prompt, generation)}]),
            )
        )
        tool_tokens = [60 + number, 70 + number]
        request = [
            *request,
            item,
            {"type": "function_call_output", "call_id": f"fc_{number}", "output": f"sunny, day {number}"},
        ]
        prompt = [*prompt, *generation, *tool_tokens]
    answers = [(3, [106, 107, 108], "Sunny: no umbrella.")]
    if retry_last:
        answers.append((4, [109, 110], "It is sunny; leave the umbrella."))
    for number, generation, text in answers:
        rollout.calls.append(
            Call(
                f"call-{number}",
                copy.deepcopy(request),
                _response(number, [{**_message(text, number), **_tokens(prompt, generation)}]),
            )
        )
    return rollout


def with_lost_call(rollout: Rollout, call_id: str) -> Rollout:
    """The same rollout where one call's response reached Gym without token ids (so Gym cannot capture it)."""
    calls = []
    for call in rollout.calls:
        if call.call_id == call_id:
            response = copy.deepcopy(call.response)
            for item in response["output"]:
                for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
                    item.pop(name, None)
            call = Call(call.call_id, call.request, response)
        calls.append(call)
    return Rollout(rollout.rollout_id, calls)


async def drive(
    gym: GymModules, rollout: Rollout, sink: Any, lineage: Any, *, delta_records: bool = False
) -> None:
    """Run every call of the rollout through Gym's capture middleware into ``sink``."""
    for call in rollout.calls:
        context = gym.sink.CaptureContext(
            rollout_id=rollout.rollout_id,
            model_call_id=call.call_id,
            token_sink=sink,
            lineage_store=lineage,
            model="policy",
            delta_records=delta_records,
        )
        token = gym.sink.set_token_sink(context)
        try:
            await gym.sink.register_call_intent()
            await gym.sink.resolve_parent(copy.deepcopy(call.request))
            await gym.sink.capture_tokens(copy.deepcopy(call.response), copy.deepcopy(call.request))
        finally:
            gym.sink.reset_token_sink(token)


def without_snapshot_identity(built: dict[str, Any]) -> dict[str, Any]:
    """A build without its snapshot id and version, which differ between any two stores by design."""
    return {key: value for key, value in built.items() if key != "_capture_snapshot"}
