"""Gym 0.7.0's file store and tokcap's on one directory: one format, one lock, each fences the other's writers."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gym_wheel import GymModules

from tokcap.errors import RolloutFrozenError, RolloutRetiredError
from tokcap.store import TokenCaptureStore


def _gym_entry(gym: GymModules, rollout_id: str, call_id: str, generation: int = 3) -> Any:
    return gym.records.TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=[1, 2],
        generation_token_ids=[generation],
        generation_log_probs=[-0.5],
        created_at=1.0,
    )


def _ids(snapshot: Any) -> list[str]:
    return sorted(entry.model_call_id for entry in snapshot.entries)


@pytest.fixture
def both(gym: GymModules, tmp_path: Path) -> tuple[Any, TokenCaptureStore]:
    return gym.store.TokenCaptureStore(tmp_path), TokenCaptureStore(tmp_path)


def test_tokcap_opens_a_rollout_gym_wrote_and_sees_its_entries_intents_and_markers(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    theirs._begin_call("r", "c1")
    theirs.append(_gym_entry(gym, "r", "c1"))
    theirs._begin_call("r", "c2")
    theirs._begin_call("m", "c1")
    theirs._mark_incomplete("m", "c1")
    assert [entry.model_call_id for entry in ours.read_entries("r")] == ["c1"]
    assert ours.read_state("r").version == 1
    snapshot = ours.freeze_now("r")
    assert (_ids(snapshot), snapshot.incomplete, snapshot.version) == (["c1"], True, 2)
    assert ours.read_state("r").dangling_intents == ("c2",)
    assert ours.is_incomplete("m")
    assert ours.freeze_now("m").version == 2


def test_gym_opens_a_rollout_tokcap_wrote_and_builds_the_same_snapshot(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    for call in ("c1", "c2", "c3"):
        ours.begin_call_now("r", call)
        ours.append(_gym_entry(gym, "r", call))
    assert [entry.model_call_id for entry in theirs.read_entries("r")] == ["c1", "c2", "c3"]
    gym_snapshot = theirs.freeze_now("r")
    assert (_ids(gym_snapshot), gym_snapshot.incomplete, gym_snapshot.version) == (
        ["c1", "c2", "c3"],
        False,
        4,
    )
    tokcap_snapshot = ours.freeze_now("r")
    assert (tokcap_snapshot.snapshot_id, tokcap_snapshot.version) == (gym_snapshot.snapshot_id, 4)
    assert [e.model_dump() for e in tokcap_snapshot.entries] == [e.model_dump() for e in gym_snapshot.entries]


def test_a_freeze_by_gym_fences_tokcaps_writers_and_a_freeze_by_tokcap_fences_gyms(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    ours.append(_gym_entry(gym, "a", "c1"))
    theirs.freeze_now("a")
    with pytest.raises(RolloutFrozenError):
        ours.append(_gym_entry(gym, "a", "late"))
    with pytest.raises(RolloutFrozenError):
        ours.begin_call_now("a", "late")
    theirs.append(_gym_entry(gym, "b", "c1"))
    ours.freeze_now("b")
    with pytest.raises(RuntimeError, match="frozen"):
        theirs.append(_gym_entry(gym, "b", "late"))
    with pytest.raises(RuntimeError, match="frozen"):
        theirs._begin_call("b", "late")
    assert [entry.model_call_id for entry in theirs.read_entries("b")] == ["c1"]


def test_a_drop_by_either_fences_the_other_and_a_stale_drop_by_either_returns_false(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    ours.append(_gym_entry(gym, "a", "c1"))
    ours_frozen = ours.freeze_now("a")
    theirs._mark_incomplete("a", "c1")
    assert theirs._drop("a", ours_frozen.snapshot_id, ours_frozen.version) is False
    assert ours.drop_now("a", ours_frozen.snapshot_id, ours_frozen.version) is False
    assert [entry.model_call_id for entry in theirs.read_entries("a")] == ["c1"]
    refrozen = theirs.freeze_now("a")
    assert ours.drop_now("a", refrozen.snapshot_id, refrozen.version) is True
    with pytest.raises(RuntimeError, match="retired"):
        theirs.append(_gym_entry(gym, "a", "late"))

    theirs.append(_gym_entry(gym, "b", "c1"))
    gym_frozen = theirs.freeze_now("b")
    ours.mark_incomplete_now("b", "c2", "lost after the freeze")
    assert theirs._drop("b", gym_frozen.snapshot_id, gym_frozen.version) is False
    again = ours.freeze_now("b")
    assert theirs._drop("b", again.snapshot_id, again.version) is True
    with pytest.raises(RolloutRetiredError):
        ours.append(_gym_entry(gym, "b", "late"))
    assert ours.read_entries("b") == [] and not ours.path_for("b").exists()


def test_nothing_acknowledged_is_deleted_unconsumed_when_both_write_one_rollout(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    acknowledged = []
    for n in range(12):
        writer = ours.append if n % 2 else theirs.append
        writer(_gym_entry(gym, "r", f"c{n}"))
        acknowledged.append(f"c{n}")
    snapshot = theirs.freeze_now("r")
    assert _ids(snapshot) == sorted(acknowledged)
    with pytest.raises(RuntimeError):
        theirs.append(_gym_entry(gym, "r", "late-gym"))
    with pytest.raises(RolloutFrozenError):
        ours.append(_gym_entry(gym, "r", "late-tokcap"))
    # tokcap keeps a write that raced the freeze as evidence: the consumed snapshot is not the last word.
    assert theirs._drop("r", snapshot.snapshot_id, snapshot.version) is False
    assert ours.drop_now("r", snapshot.snapshot_id, snapshot.version) is False
    final = ours.freeze_now("r")
    assert _ids(final) == sorted(acknowledged) and final.version == snapshot.version + 1
    assert theirs._drop("r", final.snapshot_id, final.version) is True


def test_a_rollout_deleted_by_gym_is_reusable_by_tokcap(
    gym: GymModules, both: tuple[Any, TokenCaptureStore]
) -> None:
    theirs, ours = both
    ours.append(_gym_entry(gym, "r", "c1"))
    first = ours.freeze_now("r")
    assert ours.drop_now("r", first.snapshot_id, first.version)
    theirs.delete("r")
    ours.append(_gym_entry(gym, "r", "c2"))
    reused = ours.freeze_now("r")
    assert _ids(reused) == ["c2"] and reused.snapshot_id != first.snapshot_id


@pytest.mark.parametrize("first_call_by", ["gym", "tokcap"])
def test_a_call_gym_began_and_never_delivered_keeps_masking_the_rollout_gym_froze_in_both_stores(
    gym: GymModules, both: tuple[Any, TokenCaptureStore], first_call_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    theirs, ours = both
    if first_call_by == "gym":
        theirs._begin_call("r1", "c1")
        theirs.append(_gym_entry(gym, "r1", "c1"))
    else:
        ours.begin_call_now("r1", "c1")
        ours.append(_gym_entry(gym, "r1", "c1"))
    theirs._begin_call("r1", "c2")
    intents = ours.intents_path_for("r1").read_bytes()
    with caplog.at_level(logging.WARNING, logger="tokcap"):
        assert theirs.freeze_now("r1").incomplete
        assert ours.freeze_now("r1").incomplete
        assert ours.read_state("r1").dangling_intents == ("c2",)
        assert theirs.freeze_now("r1").incomplete
    assert ours.intents_path_for("r1").read_bytes() == intents
    assert not [record for record in caplog.records if "cutting" in record.getMessage()]


_STORES = ("gym", "tokcap")
_BEGIN, _PUT, _FREEZE, _REFUSED_PUT, _REFUSED_INTENT = "begin", "put", "freeze", "late put", "late intent"

Step = tuple[str, str, str]
"""What happens, to which call, by which store: ("begin", "c2", "gym"), ("freeze", "", "tokcap")."""


def _orders() -> Iterator[Any]:
    """Every order of a complete call c1 and a dangling call c2, each write by either store, a freeze by either,
    then a write tokcap refuses (c2's tokens arriving late, or a new call c3), or none, before or after the other
    store's freeze."""
    for writes in itertools.permutations(((_BEGIN, "c1"), (_PUT, "c1"), (_BEGIN, "c2"))):
        if writes.index((_BEGIN, "c1")) > writes.index((_PUT, "c1")):
            continue  # a call is begun before it is dispatched, so before its entry
        for writers in itertools.product(_STORES, repeat=len(writes)):
            for freezer, other in itertools.permutations(_STORES):
                before: list[Step] = [
                    (what, call, by) for (what, call), by in zip(writes, writers, strict=True)
                ]
                before.append((_FREEZE, "", freezer))
                tails: list[tuple[Step, ...]] = [((_FREEZE, "", other),)]
                for refused in ((_REFUSED_PUT, "c2", "tokcap"), (_REFUSED_INTENT, "c3", "tokcap")):
                    tails.extend(itertools.permutations((refused, (_FREEZE, "", other))))
                for tail in tails:
                    steps = (*before, *tail)
                    name = ", ".join(" ".join(part for part in step if part) for step in steps)
                    yield pytest.param(steps, id=name)


def _carry_out(gym: GymModules, theirs: Any, ours: TokenCaptureStore, step: Step) -> Any:
    """Carry out one step on rollout ``r``; a freeze returns its snapshot."""
    what, call, by = step
    if what == _FREEZE:
        return (theirs if by == "gym" else ours).freeze_now("r")
    if what in (_REFUSED_PUT, _REFUSED_INTENT):
        with pytest.raises(RolloutFrozenError):
            if what == _REFUSED_PUT:
                ours.append(_gym_entry(gym, "r", call))
            else:
                ours.begin_call_now("r", call)
    elif what == _BEGIN:
        (theirs._begin_call if by == "gym" else ours.begin_call_now)("r", call)
    else:
        (theirs.append if by == "gym" else ours.append)(_gym_entry(gym, "r", call))
    return None


@pytest.mark.parametrize("steps", list(_orders()))
def test_a_dangling_call_masks_the_rollout_in_both_stores_and_no_line_written_before_the_freeze_is_removed(
    gym: GymModules, both: tuple[Any, TokenCaptureStore], steps: tuple[Step, ...]
) -> None:
    theirs, ours = both
    record_files = (ours.path_for("r"), ours.intents_path_for("r"))
    committed: dict[Path, bytes] = {}
    for step in steps:
        if step[0] == _FREEZE and not committed:
            committed = {path: path.read_bytes() for path in record_files}
            assert sorted(committed[ours.intents_path_for("r")].split()) == [b"c1", b"c2"]
        snapshot = _carry_out(gym, theirs, ours, step)
        if snapshot is not None:
            assert (_ids(snapshot), snapshot.incomplete) == (["c1"], True), step
        if committed:
            assert {path: path.read_bytes() for path in record_files} == committed, step
    for store in (theirs, ours, theirs):
        snapshot = store.freeze_now("r")
        assert (_ids(snapshot), snapshot.incomplete) == (["c1"], True)
    assert {path: path.read_bytes() for path in record_files} == committed


def _record_files_without_a_lock(directory: Path) -> list[str]:
    """Record files of rollouts whose lock file is missing; an answer ahead relies on there being none."""
    names = {path.name for path in directory.iterdir()}
    stems = {name.split(".tokens.")[0] for name in names if ".tokens." in name}
    return sorted(
        name
        for stem in stems
        if f"{stem}.tokens.lock" not in names
        for name in names
        if name.startswith(f"{stem}.tokens.")
    )


def test_every_write_of_gyms_store_leaves_a_rollouts_lock_file_beside_its_record_files(
    gym: GymModules, tmp_path: Path
) -> None:
    """tokcap answers a freeze ahead without reading when a rollout has no lock file: Gym must agree."""
    theirs = gym.store.TokenCaptureStore(tmp_path)
    steps = [
        lambda: theirs._begin_call("r", "c1"),
        lambda: theirs.append(_gym_entry(gym, "r", "c1")),
        lambda: theirs._mark_incomplete("m", "c9"),
        lambda: theirs._begin_call("s", "c1"),
        lambda: theirs.freeze_now("r"),
        lambda: theirs.freeze_now("s"),
        lambda: theirs._drop("s", theirs.freeze_now("s").snapshot_id, theirs.freeze_now("s").version),
        lambda: theirs.delete("r"),
        lambda: theirs.sweep_retired(older_than_seconds=-1),
    ]
    for step in steps:
        step()
        assert _record_files_without_a_lock(tmp_path) == []
