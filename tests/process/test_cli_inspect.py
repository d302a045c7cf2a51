"""``tokcap inspect`` shows a store's rollouts and judges one rollout exactly as the trainer would."""

from __future__ import annotations

import contextlib
from pathlib import Path

from cli_helpers import tokcap
from factories import make_entry

from tokcap.files.store import TokenCaptureStore


def _conversation(store: TokenCaptureStore, rollout_id: str) -> None:
    """Two calls whose second prompt extends the first call's prompt and generation."""
    store.append(make_entry(rollout_id, "c1", prompt=[1, 2, 3], generation=[4, 5]))
    store.append(make_entry(rollout_id, "c2", prompt=[1, 2, 3, 4, 5, 6], generation=[7]))


def test_inspect_lists_every_rollout_with_its_state_entries_and_tokens(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "open-one")
    _conversation(store, "frozen-one")
    store.freeze_now("frozen-one")
    _conversation(store, "gone")
    store.retire_now(["gone"])
    completed = tokcap("inspect", str(tmp_path), "--json")
    assert completed.returncode == 0, completed.stderr
    rows = {row["rollout_id"]: row for row in completed.json()["rollouts"]}
    assert {rid: row["state"] for rid, row in rows.items()} == {
        "frozen-one": "frozen",
        "gone": "retired",
        "open-one": "open",
    }
    assert rows["open-one"]["entries"] == 2
    assert rows["open-one"]["prompt_tokens"] == 9 and rows["open-one"]["generated_tokens"] == 3
    assert rows["gone"]["entries"] == 0


def test_inspecting_an_open_rollout_shows_its_chain_and_verdict_without_freezing_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "r1")
    completed = tokcap("inspect", str(tmp_path), "r1", "--json")
    assert completed.returncode == 0, completed.stderr
    detail = completed.json()
    assert detail["state"] == "open"
    assert [link["model_call_id"] for link in detail["build"]["main_chain"]["links"]] == ["c1", "c2"]
    assert detail["verdict"] == {"masked": False, "mask_reasons": [], "sequence_tokens": 7}
    assert store.read_state("r1").is_open


def test_a_dangling_intent_makes_an_open_rollout_masked_in_inspect(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "r1")
    store.begin_call_now("r1", "c3")
    detail = tokcap("inspect", str(tmp_path), "r1", "--json").json()
    assert detail["intents"]["c3"] == "intent"
    assert detail["verdict"]["masked"] is True
    assert detail["verdict"]["mask_reasons"] == ["incomplete"]


def test_inspect_shows_incomplete_reasons_and_late_rejections_of_a_frozen_rollout(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "r1")
    store.mark_incomplete_now("r1", "c9", "put failed: disk full")
    store.freeze_now("r1")
    with contextlib.suppress(RuntimeError):
        store.append(make_entry("r1", "late"))
    completed = tokcap("inspect", str(tmp_path), "r1")
    assert completed.returncode == 0, completed.stderr
    assert "incomplete: call c9: put failed: disk full" in completed.stdout
    assert "rejected after freeze: put of call late" in completed.stdout
    assert "masked" in completed.stdout


def test_a_retired_rollout_is_reported_as_retired(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "r1")
    store.retire_now(["r1"])
    detail = tokcap("inspect", str(tmp_path), "r1", "--json").json()
    assert detail["state"] == "retired"
    assert detail["entries"] == [] and detail["verdict"] is None


def test_inspect_without_json_prints_one_row_per_rollout_with_its_state_and_mask(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _conversation(store, "r-open")
    _conversation(store, "r-lost")
    store.mark_incomplete_now("r-lost", "c3", "lost after generation")
    store.freeze_now("r-lost")
    completed = tokcap("inspect", str(tmp_path))
    assert completed.returncode == 0, completed.stderr
    rows = {line.split()[1]: line.split() for line in completed.stdout.splitlines() if "│ r-" in line}
    assert set(rows) == {"r-open", "r-lost"}
    assert rows["r-lost"][2:5] == ["│", "frozen", "│"] and "yes" in rows["r-lost"]
    assert rows["r-open"][2:5] == ["│", "open", "│"] and "yes" not in rows["r-open"]


def test_inspect_shows_each_delta_records_full_prompt_and_masks_a_delta_whose_parent_is_missing(
    tmp_path: Path,
) -> None:
    from tokcap.delta_records import store_as_delta
    from tokcap.log.records import ParentResolutionStatus, stamp_lineage

    store = TokenCaptureStore(tmp_path)
    root = stamp_lineage(
        make_entry("r1", "c1", prompt=[1, 2, 3], generation=[4, 5]), None, parent_resolution="root"
    )
    child = make_entry("r1", "c2", prompt=[1, 2, 3, 4, 5, 6], generation=[7])
    full = store_as_delta(child, [1, 2, 3, 4, 5])
    stamp_lineage(child, "c1", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=full)
    store.append(root)
    store.append(child)
    detail = tokcap("inspect", str(tmp_path), "r1", "--json").json()
    assert [
        (e["prompt_tokens"], e["prompt_is_delta"], e["full_prompt_tokens"]) for e in detail["entries"]
    ] == [
        (3, False, 3),
        (1, True, 6),
    ]
    assert detail["verdict"]["masked"] is False

    orphan = child.model_copy(update={"rollout_id": "r2"})
    store.append(orphan)
    detail = tokcap("inspect", str(tmp_path), "r2", "--json").json()
    assert detail["lineage"]["unrebuildable"] == ["c2"]
    assert detail["verdict"]["masked"] is True
    assert "broken-delta-chain" in detail["verdict"]["mask_reasons"]
