"""tokcap's record is Gym 0.7.0's record: same fields, checks, digests and stored bytes (vectors from Gym's code)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
from gym_wheel import GymModules
from pydantic import ValidationError

from tokcap import records
from tokcap.store import TokenCaptureStore

_ITEM = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "héllo ☃"}]}


def _kwargs(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "r-1",
        "model_call_id": "c-1",
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -0.125],
        "output_items": [copy.deepcopy(_ITEM)],
        "token_item_index": 0,
        "created_at": 1700000000.25,
    }
    base.update(overrides)
    return base


VALID_CASES: dict[str, dict[str, Any]] = {
    "defaults": {
        "rollout_id": "r",
        "model_call_id": "c",
        "prompt_token_ids": [],
        "generation_token_ids": [],
        "generation_log_probs": [],
    },
    "root": _kwargs(parent_resolution="root", cum_len=5, digest="ab"),
    "resolved delta": _kwargs(
        parent_call_id="c-0", parent_resolution="resolved", prompt_is_delta=True, response_id="resp_1"
    ),
    "unresolved with reason": _kwargs(
        parent_resolution="unresolved", parent_resolution_reason="lookup_error"
    ),
    "continuation fields": _kwargs(
        continuation_fingerprint="f" * 64,
        continuation_context_len=3,
        continuation_context_digest="d" * 64,
        fingerprint_version=2,
        prefix_requested=True,
        prefix_supplied=True,
    ),
    "routed experts and extras": _kwargs(routed_experts=[[0, 1], [2, 3]], zeta_extra={"b": 1, "a": [2.5]}),
    "coerced ints": _kwargs(prompt_token_ids=["7", 8.0], schema_version="1"),
}

INVALID_CASES: dict[str, dict[str, Any]] = {
    "newer schema": _kwargs(schema_version=2),
    "older schema": _kwargs(schema_version=0),
    "log probs length": _kwargs(generation_log_probs=[-0.5]),
    "token item index outside": _kwargs(token_item_index=1),
    "negative token item index": _kwargs(token_item_index=-1),
    "resolved without parent": _kwargs(parent_resolution="resolved"),
    "root with parent": _kwargs(parent_resolution="root", parent_call_id="c-0"),
    "unresolved with parent": _kwargs(parent_resolution="unresolved", parent_call_id="c-0"),
    "delta without resolution": _kwargs(prompt_is_delta=True, parent_call_id="c-0"),
    "delta without parent": _kwargs(prompt_is_delta=True, parent_resolution="resolved"),
    "unknown resolution": _kwargs(parent_resolution="maybe"),
    "fractional token id": _kwargs(prompt_token_ids=[1.5]),
    "missing rollout id": {k: v for k, v in _kwargs().items() if k != "rollout_id"},
}


def test_every_gym_field_exists_in_tokcap_with_the_same_default(gym: GymModules) -> None:
    gym_fields = gym.records.TokenEntry.model_fields
    ours = records.TokenEntry.model_fields
    assert list(ours) == list(gym_fields)
    for name, field in gym_fields.items():
        assert ours[name].is_required() == field.is_required(), name
        assert ours[name].get_default(call_default_factory=True) == field.get_default(
            call_default_factory=True
        ), name


def test_the_schema_constants_and_resolution_values_are_gyms(gym: GymModules) -> None:
    assert records.TOKEN_ENTRY_RECORD_SCHEMA_VERSION == gym.records.TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    assert records.TOKEN_ENTRY_MIN_SCHEMA_VERSION == gym.records.TOKEN_ENTRY_MIN_SCHEMA_VERSION
    assert records.DIGEST_VERSION == gym.records.DIGEST_VERSION
    assert records.TOKEN_FIELDS == gym.records.TOKEN_FIELDS
    assert [s.value for s in records.ParentResolutionStatus] == [
        s.value for s in gym.records.ParentResolutionStatus
    ]


@pytest.mark.parametrize("case", sorted(VALID_CASES))
def test_an_entry_gym_accepts_is_accepted_and_stored_as_the_line_gym_stores(
    gym: GymModules, case: str, tmp_path: Path
) -> None:
    theirs = gym.records.TokenEntry(**copy.deepcopy(VALID_CASES[case]))
    ours = records.TokenEntry(**copy.deepcopy(VALID_CASES[case]))
    gym_store = gym.store.TokenCaptureStore(tmp_path / "gym")
    gym_store.append(theirs)
    gym_line = gym_store.path_for(theirs.rollout_id).read_bytes()
    assert ours.canonical_json() + b"\n" == gym_line
    store = TokenCaptureStore(tmp_path / "tokcap")
    try:
        store.append(theirs)
        assert store.path_for(theirs.rollout_id).read_bytes() == gym_line
    finally:
        asyncio.run(store.close())


@pytest.mark.parametrize("case", sorted(INVALID_CASES))
def test_an_entry_gym_refuses_is_refused(gym: GymModules, case: str) -> None:
    with pytest.raises(ValidationError):
        gym.records.TokenEntry(**copy.deepcopy(INVALID_CASES[case]))
    with pytest.raises(ValidationError):
        records.TokenEntry(**copy.deepcopy(INVALID_CASES[case]))


SEQUENCES = [[], [0], [1, 2, 3], [2**63 - 1, 2**64 - 1], list(range(1000)), [7] * 3]


@pytest.mark.parametrize("tokens", SEQUENCES, ids=lambda s: f"len{len(s)}")
def test_compute_digest_and_the_token_encoding_give_gyms_values(gym: GymModules, tokens: list[int]) -> None:
    assert records.compute_digest(tokens) == gym.records.compute_digest(tokens)
    assert records.encode_token_ids(tokens) == gym.records.encode_token_ids(tokens)


def test_a_negative_token_id_is_refused_as_a_value_error_as_gym_does(gym: GymModules) -> None:
    with pytest.raises(ValueError):
        gym.records.compute_digest([3, -1])
    with pytest.raises(ValueError):
        records.compute_digest([3, -1])


def test_a_token_id_beyond_64_bits_is_refused_as_a_value_error() -> None:
    # Gym 0.7.0 raises StopIteration here (its error path looks only for a negative id).
    with pytest.raises(ValueError, match="64-bit"):
        records.compute_digest([1, 2**64])


STAMPS: list[tuple[dict[str, Any], str | None, str | None, list[int] | None]] = [
    (_kwargs(), None, None, None),
    (_kwargs(), None, "root", None),
    (_kwargs(), "c-0", "resolved", None),
    (_kwargs(), None, "unresolved", [1, 2, 3, 4, 5]),
    (_kwargs(prompt_token_ids=[3]), "c-0", "resolved", [1, 2, 3, 4, 5]),
    (_kwargs(), None, "resolved", None),
    (_kwargs(), "c-0", "root", None),
    (_kwargs(), None, "root", [9, 9]),
]


@pytest.mark.parametrize(("fields", "parent", "resolution", "cumulative"), STAMPS)
def test_stamp_lineage_sets_and_refuses_what_gym_does(
    gym: GymModules,
    fields: dict[str, Any],
    parent: str | None,
    resolution: str | None,
    cumulative: list[int] | None,
) -> None:
    def stamp(module: Any) -> tuple[str, Any]:
        entry = module.TokenEntry(**copy.deepcopy(fields))
        status = module.ParentResolutionStatus(resolution) if resolution else None
        try:
            module.stamp_lineage(entry, parent, parent_resolution=status, cumulative=cumulative)
        except ValueError:
            return "refused", entry.model_dump(mode="json")
        return "stamped", entry.model_dump(mode="json")

    assert stamp(records) == stamp(gym.records)


def test_cumulative_tokens_match_gyms_and_a_delta_entry_is_refused(gym: GymModules) -> None:
    full = _kwargs()
    assert records.cumulative_tokens(records.TokenEntry(**full)) == gym.records.cumulative_tokens(
        gym.records.TokenEntry(**full)
    )
    delta = _kwargs(parent_call_id="c-0", parent_resolution="resolved", prompt_is_delta=True)
    with pytest.raises(ValueError):
        gym.records.cumulative_tokens(gym.records.TokenEntry(**delta))
    with pytest.raises(ValueError):
        records.cumulative_tokens(records.TokenEntry(**delta))


def _arrays(prompt: list[int], generation: list[int]) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.25] * len(generation),
    }


RESPONSES: dict[str, dict[str, Any]] = {
    "responses item": {"output": [{"type": "reasoning"}, {**_ITEM, **_arrays([1], [2, 3])}]},
    "routed experts": {"output": [{**_ITEM, **_arrays([1], [2]), "routed_experts": [[4]]}]},
    "chat message": {"choices": [{"message": {"role": "assistant", "content": "x", **_arrays([5], [6])}}]},
    "no tokens": {"output": [_ITEM]},
    "nothing": {"id": "resp_0"},
    "null arrays": {"output": [{**_ITEM, "prompt_token_ids": None, "generation_token_ids": None}]},
    "two items": {"output": [{**_ITEM, **_arrays([1], [2])}, {**_ITEM, **_arrays([1], [3])}]},
    "output and chat": {
        "output": [{**_ITEM, **_arrays([1], [2])}],
        "choices": [{"message": {"role": "assistant", **_arrays([1], [2])}}],
    },
    "partial": {"output": [{**_ITEM, "prompt_token_ids": [1], "generation_token_ids": [2]}]},
}


@pytest.mark.parametrize("case", sorted(RESPONSES))
def test_extract_token_fields_returns_gyms_dict_or_none_or_refuses_as_gym_does(
    gym: GymModules, case: str
) -> None:
    def extract(module: Any) -> Any:
        try:
            return module.extract_token_fields(copy.deepcopy(RESPONSES[case]))
        except ValueError:
            return "refused"

    assert extract(records) == extract(gym.records)


@pytest.mark.parametrize("case", ["responses item", "routed experts", "no tokens", "two items"])
def test_strip_token_fields_returns_gyms_items_and_index(gym: GymModules, case: str) -> None:
    def strip(module: Any) -> Any:
        try:
            return module.strip_token_fields(copy.deepcopy(RESPONSES[case]["output"]))
        except ValueError:
            return "refused"

    assert strip(records) == strip(gym.records)


def test_a_gym_entry_put_into_the_file_store_comes_back_with_gyms_digest_field(
    gym: GymModules, tmp_path: Path
) -> None:
    entry = gym.records.TokenEntry(**_kwargs())
    gym.records.stamp_lineage(entry, None, parent_resolution=gym.records.ParentResolutionStatus.ROOT)

    async def scenario() -> Any:
        store = TokenCaptureStore(tmp_path)
        try:
            await store.put(entry)
            return await store.freeze("r-1")
        finally:
            await store.close()

    snapshot = asyncio.run(scenario())
    (stored,) = snapshot.entries
    assert stored.digest == entry.digest == gym.records.compute_digest([1, 2, 3, 4, 5])
    assert stored.model_dump(mode="json") == entry.model_dump(mode="json")
