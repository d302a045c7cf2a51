"""The main chain as a Responses-style dict whose token arrays concatenate to the full sequence."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.factories import assistant_message_item, make_entry
from tests.unit.agent_rollouts import AgentRollout
from tokcap.builder import BuildOutput, per_request, prefix_merging
from tokcap.errors import PrefixContiguityError, TrajectoryBuildError
from tokcap.response_items import (
    assert_prefix_contiguity,
    project_chain_to_output_items,
    project_main_chain_response,
)

TOOL_CALL = {"type": "function_call", "id": "fc_1", "call_id": "tc_1", "name": "search", "arguments": "{}"}


def two_turn_build() -> BuildOutput:
    first = make_entry(
        "r",
        "c1",
        [1, 2, 3],
        [10, 11],
        output_items=[{"type": "reasoning", "id": "rs_1", "summary": []}, TOOL_CALL],
        token_item_index=1,
        created_at=1.0,
        routed_experts=[[0, 1], [1, 0]],
    )
    second = make_entry(
        "r",
        "c2",
        [1, 2, 3, 10, 11, 90, 91],
        [12],
        output_items=[assistant_message_item("done")],
        created_at=2.0,
    )
    return prefix_merging([second, first])


def token_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if "generation_token_ids" in item]


def test_the_response_keeps_every_captured_item_in_order_with_arrays_on_the_token_items() -> None:
    response = project_main_chain_response("r", two_turn_build())
    assert response["object"] == "response"
    assert response["model"] == "test-model"
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call", "message"]
    assert "prompt_token_ids" not in response["output"][0]
    tool_item = response["output"][1]
    assert {k: v for k, v in tool_item.items() if k in TOOL_CALL} == TOOL_CALL
    assert tool_item["prompt_token_ids"] == [1, 2, 3]
    assert tool_item["generation_token_ids"] == [10, 11]
    assert tool_item["routed_experts"] == [[0, 1], [1, 0]]
    final_item = response["output"][2]
    assert final_item["content"][0]["text"] == "done"
    assert final_item["prompt_token_ids"] == [1, 2, 3, 10, 11, 90, 91]


def test_the_token_arrays_concatenate_to_the_chain_sequence_and_usage_counts_it() -> None:
    build = two_turn_build()
    response = project_main_chain_response("r", build, model="policy-v2")
    assert build.main_chain is not None
    assert assert_prefix_contiguity(response) == build.main_chain.training_tokens().token_ids
    assert response["usage"] == {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8}
    assert response["model"] == "policy-v2"
    assert response["metadata"]["tokcap_chain_id"] == "c2"


def test_generated_tokens_keep_their_log_probs() -> None:
    build = two_turn_build()
    items = token_items(project_main_chain_response("r", build))
    assert build.main_chain is not None
    assert [item["generation_log_probs"] for item in items] == [
        link.entry.generation_log_probs for link in build.main_chain.links
    ]


def test_a_call_captured_without_content_gets_one_synthetic_message() -> None:
    build = prefix_merging([make_entry("r", "c1", [1], [2])])
    assert build.main_chain is not None
    [item] = project_chain_to_output_items(build.main_chain)
    assert item["type"] == "message"
    assert item["role"] == "assistant"
    assert item["prompt_token_ids"] == [1]


def test_projection_does_not_share_state_with_the_snapshot_entries() -> None:
    build = two_turn_build()
    assert build.main_chain is not None
    before = copy.deepcopy([link.entry.output_items for link in build.main_chain.links])
    response = project_main_chain_response("r", build)
    response["output"][0]["summary"].append("changed")
    assert [link.entry.output_items for link in build.main_chain.links] == before


def test_a_build_without_a_main_chain_cannot_be_projected() -> None:
    with pytest.raises(TrajectoryBuildError, match="no main chain"):
        project_main_chain_response("r", per_request([make_entry("r", "c1")]))


def test_a_long_agent_response_is_contiguous() -> None:
    agent = AgentRollout("r", [1, 2])
    for turn in range(50):
        agent.turn(f"c{turn:02d}", [turn, turn + 1], then=[7] * (turn % 3))
    assert assert_prefix_contiguity(project_main_chain_response("r", prefix_merging(agent.entries)))


def altered(mutate: Any) -> dict[str, Any]:
    response = project_main_chain_response("r", two_turn_build())
    mutate(response)
    return response


@pytest.mark.parametrize(
    ("response", "message"),
    [
        pytest.param(altered(lambda r: r["output"].pop(1)), "usage.output_tokens", id="item-dropped"),
        pytest.param(
            altered(lambda r: r["output"][2]["prompt_token_ids"].__setitem__(0, 99)),
            "does not extend",
            id="token-changed",
        ),
        pytest.param(
            altered(lambda r: r["output"][2]["generation_token_ids"].__setitem__(0, 99)),
            "sha256",
            id="last-generation-changed",
        ),
        pytest.param(altered(lambda r: r["output"].reverse()), "does not extend", id="items-reordered"),
        pytest.param(
            altered(lambda r: r["output"][1].pop("generation_log_probs")), "not all", id="partial-arrays"
        ),
        pytest.param(
            altered(lambda r: r["output"][1]["generation_log_probs"].pop()), "log probs", id="log-probs"
        ),
        pytest.param(
            altered(lambda r: r["output"][1].__setitem__("prompt_token_ids", "1,2")), "integers", id="ints"
        ),
        pytest.param({"output": [assistant_message_item()]}, "no output item carrying", id="no-tokens"),
        pytest.param({"object": "response"}, "no output list", id="no-output"),
    ],
)
def test_a_broken_response_fails_the_contiguity_check(response: dict[str, Any], message: str) -> None:
    with pytest.raises(PrefixContiguityError, match=message):
        assert_prefix_contiguity(response)


def test_a_token_item_without_generated_tokens_fails_the_contiguity_check() -> None:
    item = {"prompt_token_ids": [1], "generation_token_ids": [], "generation_log_probs": []}
    with pytest.raises(PrefixContiguityError, match="no generated token"):
        assert_prefix_contiguity({"output": [item]})


def test_a_contiguity_failure_is_the_assertion_error_gyms_callers_catch() -> None:
    item = {"prompt_token_ids": [1], "generation_token_ids": [], "generation_log_probs": []}
    with pytest.raises(AssertionError):
        assert_prefix_contiguity({"output": [item]})
