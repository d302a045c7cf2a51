"""tokcap's lineage against Gym 0.7.0's: the same hashes, the same parent decisions, in both directions."""

from __future__ import annotations

import asyncio
import copy
import importlib
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import Rollout, drive, tool_use_rollout
from gym_wheel import GymModules

from tokcap import fingerprint, sink
from tokcap.lineage import FileLineageResolver, LineageIndex, LineageNode
from tokcap.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.store import TokenCaptureStore

# Chat, Responses and Anthropic shapes, tool calls with reserialized arguments, non-JSON arguments,
# non-text blocks, namespaces, reasoning items and non-ASCII text.
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [],
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c2", "function": {"name": "g"}}]},
    ],
    [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "x", "name": "n", "namespace": "ns", "arguments": "not json "},
        {"type": "function_call_output", "call_id": "x", "output": {"k": [1, 2.5]}},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "été"}]},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": {"b": 2, "a": 1}},
                "plain",
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t", "name": "nm", "input": {"z": 1.5, "a": None}},
            ],
        },
    ],
]


def _gym_fingerprint(gym: GymModules) -> Any:
    return importlib.import_module("nemo_gym.token_id_capture.fingerprint")


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_tokcaps_fingerprint_and_context_digest_equal_gyms_for_every_dialect(
    gym: GymModules, conversation: list[dict[str, Any]]
) -> None:
    theirs = _gym_fingerprint(gym)
    assert fingerprint.assistant_fingerprint(conversation) == theirs.assistant_fingerprint(conversation)
    for end in range(len(conversation) + 1):
        prefix = conversation[:end]
        assert fingerprint.conversation_digest(prefix) == theirs.conversation_digest(prefix)


@pytest.mark.parametrize(
    "arguments",
    [None, "", ' {"b":1, "a":2} ', "not json", " not json either ", {"z": [1, {"y": 2}]}, "[1,2]"],
)
def test_tool_arguments_are_canonicalized_as_gym_does(gym: GymModules, arguments: Any) -> None:
    theirs = _gym_fingerprint(gym)
    assert fingerprint.canonicalize_tool_arguments(arguments) == theirs.canonicalize_tool_arguments(arguments)
    assert fingerprint.FINGERPRINT_VERSION == theirs.FINGERPRINT_VERSION


async def drive_with_tokcap(
    rollout: Rollout, token_sink: Any, lineage: Any, *, delta_records: bool = False
) -> None:
    """Run every call through tokcap's own capture path (no Gym code), as a model server would."""
    for call in rollout.calls:
        context = sink.CaptureContext(
            rollout_id=rollout.rollout_id,
            model_call_id=call.call_id,
            token_sink=token_sink,
            lineage_store=lineage,
            model="policy",
            delta_records=delta_records,
        )
        token = sink.set_token_sink(context)
        try:
            await sink.register_call_intent()
            await sink.resolve_parent(copy.deepcopy(call.request))
            await sink.capture_tokens(copy.deepcopy(call.response), copy.deepcopy(call.request))
        finally:
            sink.reset_token_sink(token)


EXPECTED_PARENTS = {"call-1": None, "call-2": "call-1", "call-3": "call-2", "call-4": "call-2"}


def _parents(store: TokenCaptureStore, rollout_id: str) -> dict[str, tuple[str | None, str | None]]:
    return {
        entry.model_call_id: (entry.parent_call_id, entry.parent_resolution)
        for entry in store.read_entries(rollout_id)
    }


def _expected() -> dict[str, tuple[str | None, str | None]]:
    return {call: (parent, "resolved" if parent else "root") for call, parent in EXPECTED_PARENTS.items()}


def test_gyms_middleware_with_tokcaps_file_resolver_links_every_call_of_a_tool_use_rollout(
    gym: GymModules, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path)
    asyncio.run(drive(gym, tool_use_rollout("r-gym"), store, FileLineageResolver(tmp_path)))
    assert _parents(store, "r-gym") == _expected()


def test_entries_stamped_by_tokcaps_capture_path_resolve_through_gyms_file_lineage_store(
    gym: GymModules, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path)
    asyncio.run(drive_with_tokcap(tool_use_rollout("r-gym"), store, gym.lineage.FileLineageStore(tmp_path)))
    assert _parents(store, "r-gym") == _expected()


def test_tokcaps_capture_path_with_tokcaps_resolver_stamps_the_same_lines_as_gyms_middleware(
    gym: GymModules, tmp_path: Path
) -> None:
    gym_dir, tokcap_dir = tmp_path / "gym", tmp_path / "tokcap"
    rollout = tool_use_rollout("r-same")
    asyncio.run(
        drive(gym, rollout, gym.store.TokenCaptureStore(gym_dir), gym.lineage.FileLineageStore(gym_dir))
    )
    asyncio.run(drive_with_tokcap(rollout, TokenCaptureStore(tokcap_dir), FileLineageResolver(tokcap_dir)))

    def lines(directory: Path) -> list[dict[str, Any]]:
        entries = [
            TokenEntry.from_json(line)
            for line in (directory / "r-same.tokens.jsonl").read_bytes().splitlines()
        ]
        return [entry.model_dump(mode="json", exclude={"created_at"}) for entry in entries]

    assert lines(tokcap_dir) == lines(gym_dir)


def test_gym_and_tokcap_resolvers_give_the_same_decision_on_the_same_directory(
    gym: GymModules, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-both")
    asyncio.run(drive(gym, rollout, TokenCaptureStore(tmp_path), gym.lineage.FileLineageStore(tmp_path)))
    final_request = rollout.calls[-1].request
    requests = [
        *(call.request for call in rollout.calls),
        [*final_request, rollout.calls[-1].response["output"][0], {"role": "user", "content": "thanks"}],
        [{"role": "user", "content": "REWRITTEN"}, *final_request[1:]],
    ]

    async def decisions(resolver: Any) -> list[tuple[str, str | None, tuple[int, ...], str]]:
        out = []
        for request in requests:
            resolution = await resolver.resolve("r-both", copy.deepcopy(request))
            match = resolution.match
            out.append(
                (
                    str(resolution.status.value),
                    match.model_call_id if match else None,
                    tuple(match.cumulative_token_ids) if match else (),
                    resolution.reason,
                )
            )
        return out

    ours = asyncio.run(decisions(FileLineageResolver(tmp_path)))
    theirs = asyncio.run(decisions(gym.lineage.FileLineageStore(tmp_path)))
    assert ours == theirs
    assert [decision[0] for decision in ours] == [
        "root",
        "resolved",
        "resolved",
        "resolved",
        "resolved",
        "unresolved",
    ]


def _entry(call_id: str, request: list[dict[str, Any]], output: str, prompt: list[int]) -> TokenEntry:
    entry = TokenEntry(
        rollout_id="r",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=[9],
        generation_log_probs=[-0.5],
        output_items=[{"role": "assistant", "content": output}],
    )
    stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    return sink.stamp_continuation(entry, request)  # type: ignore[no-any-return]


REQUEST = [{"role": "user", "content": "hi"}]
NEXT = [*REQUEST, {"role": "assistant", "content": "same"}, {"role": "user", "content": "more"}]


def _index(*entries: TokenEntry) -> LineageIndex:
    index = LineageIndex()
    for entry in entries:
        node = LineageNode.of_entry(entry)
        assert node is not None
        index.add(node)
    return index


def test_a_call_id_recorded_with_two_payloads_counts_as_no_candidate() -> None:
    index = _index(_entry("a", REQUEST, "same", [1]), _entry("a", REQUEST, "same", [2]))
    assert index.decide(NEXT) == (ParentResolutionStatus.UNRESOLVED, None, "no_match")


def test_two_proven_calls_with_different_tokens_stay_unresolved_as_ambiguous() -> None:
    index = _index(_entry("a", REQUEST, "same", [1]), _entry("b", REQUEST, "same", [2]))
    assert index.decide(NEXT) == (ParentResolutionStatus.UNRESOLVED, None, "ambiguous")


def test_two_proven_calls_with_identical_tokens_resolve_to_the_smallest_call_id() -> None:
    index = _index(_entry("b", REQUEST, "same", [1]), _entry("a", REQUEST, "same", [1]))
    status, node, _ = index.decide(NEXT)
    assert status == ParentResolutionStatus.RESOLVED and node is not None and node.call_id == "a"


def test_an_entry_stamped_with_another_fingerprint_version_is_never_a_candidate() -> None:
    entry = _entry("a", REQUEST, "same", [1])
    entry.fingerprint_version = 1
    assert LineageNode.of_entry(entry) is None


def test_without_a_resolver_tokcaps_capture_path_records_continuations_as_unresolved(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    asyncio.run(drive_with_tokcap(tool_use_rollout("r-none"), store, None))
    parents = _parents(store, "r-none")
    assert parents["call-1"] == (None, "root")
    assert {parents[call] for call in ("call-2", "call-3", "call-4")} == {(None, "unresolved")}
    assert {entry.parent_resolution_reason for entry in store.read_entries("r-none")} == {
        "",
        "resolver_unavailable",
    }
