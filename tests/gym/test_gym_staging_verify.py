"""tokcap's ``verify_and_linearize`` against Gym 0.7.0's, on generated rollouts and damaged inputs.

A rollout is a forest of staged calls (roots, continuations, branches, calls that generate nothing);
its manifest names a terminal (or lets the parent-link walk pick one), and then one thing may go wrong:
snapshots reordered, dropped or repeated, a token or a version changed, a log prob narrowed to float32,
a chain hash swapped, a manifest row pointing at a wrong parent length. Gym's verifier and tokcap's
get the same inputs (Gym's classes, and tokcap's for tokcap) and must return the same row or both raise
a ``ValueError`` with the same code. The digests must also reproduce Gym's golden vector.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import struct
from typing import Any

import pytest
from gym_wheel import GymModules
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from staging_calls import staged_call

from tokcap.staging import verify_and_linearize
from tokcap.staging.digest import compute_chain_hash, compute_extras_digest, compute_staging_digest
from tokcap.staging.finalize import receipt_from_manifest
from tokcap.staging.records import CallRecord, RolloutReceipt, StagedCallBaseSnapshot, staging_key
from tokcap.staging.terminal import select_terminal_call

ROLLOUT = "r-verify"


def gym_staging(gym: GymModules) -> Any:
    return importlib.import_module("nemo_gym.token_id_capture.staging")


def test_tokcaps_digests_reproduce_gyms_golden_vector(gym: GymModules) -> None:
    vectors = json.loads(
        (gym.source_dir / "nemo_gym/token_id_capture/staging/conformance/golden_vectors.json").read_text()
    )
    assert compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]


@st.composite
def rollouts(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 6))
    calls: list[Any] = []
    for index in range(count):
        parent = draw(st.sampled_from([None, *calls])) if calls and draw(st.booleans()) else None
        prompt = draw(st.lists(st.integers(0, 2**64 - 1), min_size=0 if parent else 1, max_size=3))
        generated = draw(st.lists(st.integers(0, 50_000), min_size=0 if prompt else 1, max_size=3))
        version = draw(st.integers(0, 3))
        calls.append(
            staged_call(ROLLOUT, f"c{index}", prompt, generated, parent=parent, weight_version=version)
        )
    terminal = draw(st.sampled_from([None, *[call.model_call_id for call in calls]]))
    damage = draw(
        st.sampled_from(
            [
                "none",
                "swap",
                "drop",
                "repeat",
                "token",
                "weight_version",
                "narrow_log_prob",
                "chain_hash",
                "unchained",
                "wrong_rollout",
                "mask_order",
                "poisoned",
            ]
        )
    )
    return {"calls": calls, "terminal": terminal, "damage": damage, "pick": draw(st.integers(0, 100))}


def _record(call: Any) -> CallRecord:
    return CallRecord(
        model_call_id=call.model_call_id,
        parent_call_id=call.parent_call_id,
        prev_len=call.prev_len,
        delta_len=call.delta_len,
        cum_len=call.cum_len,
        weight_version=call.weight_version,
        digest=call.digest,
        extras_digest=call.extras_digest,
        staging_key=staging_key(call.rollout_id, call.model_call_id),
        mode=call.mode,
        chain_hash=call.chain_hash,
        cumulative_hash=call.cumulative_hash,
        response_id=f"resp-{call.model_call_id}",
    )


def _damaged(case: dict[str, Any]) -> tuple[RolloutReceipt, list[dict[str, Any]]]:
    calls = case["calls"]
    records = [_record(call) for call in calls]
    rows = [call.model_dump(exclude={"extras"}) for call in calls]
    pick = case["pick"] % len(rows)
    damage = case["damage"]
    if damage == "swap" and len(rows) > 1:
        rows[0], rows[-1] = rows[-1], rows[0]
    elif damage == "drop":
        rows.pop(pick)
    elif damage == "repeat":
        rows[pick] = rows[(pick + 1) % len(rows)]
    elif damage == "token":
        rows[pick]["token_ids_delta"] = [*rows[pick]["token_ids_delta"][:-1], 7]
    elif damage == "weight_version":
        rows[pick]["weight_version"] += 1
    elif damage == "narrow_log_prob":
        rows[pick]["generation_log_probs_delta"] = [
            struct.unpack(">f", struct.pack(">f", value))[0]
            for value in rows[pick]["generation_log_probs_delta"]
        ]
    elif damage == "chain_hash":
        records[pick] = records[pick].model_copy(update={"chain_hash": records[0].cumulative_hash})
    elif damage == "unchained":
        # Row and manifest agree and the digest holds, but the chain hash starts afresh instead of extending
        # the parent's: only the running chain check can see it.
        row = rows[pick]
        row["chain_hash"] = compute_chain_hash(None, [*row["token_ids_delta"], 0])
        row["digest"] = compute_staging_digest(
            **{key: value for key, value in row.items() if key != "digest"}
        )
        records[pick] = records[pick].model_copy(
            update={"chain_hash": row["chain_hash"], "digest": row["digest"]}
        )
    elif damage == "wrong_rollout":
        rows[pick]["rollout_id"] = "another"
    elif damage == "mask_order":
        row = rows[pick]
        row["token_mask_delta"] = list(reversed(row["token_mask_delta"]))
        row["generation_log_probs_delta"] = [0.0] * len(row["token_mask_delta"])
        fields = {key: value for key, value in row.items() if key != "digest"}
        row["digest"] = compute_staging_digest(**fields)
    terminal = case["terminal"]
    if damage == "poisoned":
        receipt = RolloutReceipt(
            rollout_id=ROLLOUT, manifest=records, capture_poisoned=True, failure_reason="x"
        )
    elif terminal is None:
        chosen = select_terminal_call(records).terminal_model_call_id
        if chosen is None:
            receipt = RolloutReceipt(
                rollout_id=ROLLOUT, manifest=records, capture_poisoned=True, failure_reason="t"
            )
        else:
            receipt = RolloutReceipt(
                rollout_id=ROLLOUT,
                manifest=records,
                terminal_model_call_id=chosen,
                terminal_selection="heuristic",
            )
    else:
        receipt = RolloutReceipt(
            rollout_id=ROLLOUT,
            manifest=records,
            terminal_model_call_id=terminal,
            terminal_selection="declared",
        )
    return receipt, rows


def _outcome(function: Any, receipt: Any, snapshots: list[Any]) -> tuple[str, Any]:
    try:
        row = function(receipt, snapshots)
    except ValueError as exc:
        return "error", getattr(exc, "code", type(exc).__name__)
    return "row", {
        field.name: (
            [dataclasses.asdict(item) for item in value]
            if field.name in ("weight_version_spans", "extras_commitments")
            else value
        )
        for field in dataclasses.fields(row)
        for value in [getattr(row, field.name)]
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=rollouts())
def test_tokcaps_verifier_returns_gyms_row_or_raises_where_gyms_raises(
    gym: GymModules, case: dict[str, Any]
) -> None:
    staging = gym_staging(gym)
    receipt, rows = _damaged(case)
    gym_receipt = staging.RolloutReceipt.model_validate(receipt.model_dump())
    gym_snapshots = [staging.StagedCallBaseSnapshot.model_construct(**row) for row in rows]
    tokcap_snapshots = [StagedCallBaseSnapshot.model_construct(**row) for row in rows]
    expected = _outcome(staging.verify_and_linearize, gym_receipt, gym_snapshots)
    assert _outcome(verify_and_linearize, gym_receipt, gym_snapshots) == expected
    assert _outcome(verify_and_linearize, receipt, tokcap_snapshots) == expected


def test_an_undamaged_rollout_linearizes_to_its_exact_tokens_masks_and_log_probs(gym: GymModules) -> None:
    root = staged_call(ROLLOUT, "a", [1, 2, 3], [4, 5])
    child = staged_call(ROLLOUT, "b", [6], [7, 8], parent=root)
    receipt = receipt_from_manifest(
        {"rollout_id": ROLLOUT, "records": [_record(root).model_dump(), _record(child).model_dump()]}
    )
    row = verify_and_linearize(
        receipt,
        [StagedCallBaseSnapshot.model_validate(c.model_dump(exclude={"extras"})) for c in (root, child)],
    )
    assert row.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.token_mask == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert row.logprobs == [*root.generation_log_probs_delta, *child.generation_log_probs_delta]
    staging = gym_staging(gym)
    with pytest.raises(TypeError):
        staging.verify_and_linearize(receipt, [])


@pytest.mark.parametrize(
    "name",
    [
        "StagedCallBaseSnapshot",
        "StagedCallRecord",
        "StagedCallSnapshot",
        "StageResult",
        "CallRecord",
        "CaptureLedgerCommit",
        "ManifestFailure",
        "RolloutManifest",
        "RolloutReceipt",
    ],
)
def test_tokcaps_staging_records_have_gyms_fields_types_and_defaults(gym: GymModules, name: str) -> None:
    from tokcap.staging import records as ours

    theirs = importlib.import_module("nemo_gym.token_id_capture.staging.records")
    mine, gyms = getattr(ours, name).model_fields, getattr(theirs, name).model_fields
    assert list(mine) == list(gyms)
    for field_name, info in gyms.items():
        # Gym writes a bare ``dict``; tokcap spells the same type ``dict[Any, Any]`` for mypy.
        ours_type = repr(mine[field_name].annotation).replace("dict[typing.Any, typing.Any]", "dict")
        ours_type = ours_type.replace("tokcap.staging.records", "RECORDS")
        gyms_type = repr(info.annotation).replace("nemo_gym.token_id_capture.staging.records", "RECORDS")
        assert ours_type == gyms_type, field_name
        assert mine[field_name].default == info.default, field_name


_BAD_VALUES: list[Any] = [
    None,
    "",
    "x",
    -1,
    0,
    1,
    2**64,
    1.5,
    float("nan"),
    float("inf"),
    1e39,
    True,
    [],
    [0.5],
    [2**64],
    [-1],
    [1.0, 0.0],
    [0.0, -0.5],
    "text",
    "token_in",
    "0" * 64,
    "A" * 64,
    {"k": (1, 2)},
    {"k": 2**63},
    {1: 2},
]


def _digest_args(call: Any) -> dict[str, Any]:
    return {key: value for key, value in call.model_dump().items() if key not in ("digest", "extras")}


def _result(function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc).__name__


def test_tokcaps_digests_refuse_and_accept_exactly_what_gyms_do(gym: GymModules) -> None:
    """Every field of a root and a child call set, one at a time, to every value of a list of bad ones."""
    from tokcap.staging import digest as ours

    theirs = importlib.import_module("nemo_gym.token_id_capture.staging.digest")
    root = staged_call(ROLLOUT, "d0", [1, 2], [3])
    child = staged_call(ROLLOUT, "d1", [4], [5, 6], parent=root)
    differences = []
    for call in (root, child):
        for name in sorted(_digest_args(call)):
            for value in _BAD_VALUES:
                args = {**_digest_args(call), name: value}
                pair = (
                    _result(ours.compute_staging_digest, **args),
                    _result(theirs.compute_staging_digest, **args),
                )
                ids = value if isinstance(value, list) else [value]
                parent = value if isinstance(value, str) else None
                extras = value if isinstance(value, dict) else {"v": value}
                pairs = [
                    pair,
                    (
                        _result(ours.compute_chain_hash, parent, ids),
                        _result(theirs.compute_chain_hash, parent, ids),
                    ),
                    (_result(ours.hash_token_ids, ids), _result(theirs.hash_token_ids, ids)),
                    (
                        _result(ours.compute_extras_digest, extras),
                        _result(theirs.compute_extras_digest, extras),
                    ),
                ]
                differences += [(name, value, ours_, gyms) for ours_, gyms in pairs if ours_ != gyms]
    assert differences == []


def test_tokcaps_staging_records_validate_exactly_what_gyms_do(gym: GymModules) -> None:
    """Every field of each record, one at a time, set to every bad value: both accept the same, or both refuse."""
    from tokcap.staging import records as ours

    theirs = importlib.import_module("nemo_gym.token_id_capture.staging.records")
    root = staged_call(ROLLOUT, "v0", [1, 2], [3])
    child = staged_call(ROLLOUT, "v1", [4], [5, 6], parent=root)
    valid: dict[str, dict[str, Any]] = {
        "StagedCallRecord": child.model_dump(),
        "CallRecord": _record(child).model_dump(),
        "StageResult": {"ok": True, "staging_key": "k"},
        "RolloutReceipt": {
            "rollout_id": ROLLOUT,
            "manifest": [_record(root).model_dump(), _record(child).model_dump()],
            "terminal_model_call_id": "v1",
            "terminal_selection": "declared",
        },
        "RolloutManifest": {
            "rollout_id": ROLLOUT,
            "records": [],
            "failures": [{"model_call_id": "c", "reason": "r"}],
        },
        "CaptureLedgerCommit": {
            "rollout_id": ROLLOUT,
            "record": _record(child).model_dump(),
            "request_items": [{"role": "user", "content": "q"}],
            "response_items": [],
        },
    }

    def outcome(cls: Any, data: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(data).model_dump(mode="json")
        except (ValueError, TypeError) as exc:
            return type(exc).__name__ if isinstance(exc, TypeError) else "refused"

    differences = []
    for class_name, good in valid.items():
        for name in sorted(getattr(theirs, class_name).model_fields):
            for value in _BAD_VALUES:
                data = {**good, name: value}
                ours_, gyms = (
                    outcome(getattr(ours, class_name), data),
                    outcome(getattr(theirs, class_name), data),
                )
                if ours_ != gyms:
                    differences.append((class_name, name, value, ours_, gyms))
    assert differences == []
