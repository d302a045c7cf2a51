"""Applying events with log positions: what a resumed materializer sees after a crash."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_entry
from tokcap.files.log_projection import Projection
from tokcap.files.store import ApplyOutcome, TokenCaptureStore
from tokcap.log.events import (
    CancelEvent,
    DeleteEvent,
    DropEvent,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
)
from tokcap.log.rules import decide


def _at(offset: int) -> LogPosition:
    return LogPosition("run", 0, offset)


def test_a_log_applied_delete_leaves_an_empty_state_that_remembers_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.apply(PutEvent(rollout_id="r", entry=make_entry("r", "c1")), _at(0))
    store.apply(RetireEvent(rollout_id="r"), _at(1))
    result = store.apply(DeleteEvent(rollout_id="r"), _at(2))
    assert result.removed is True
    state = store.read_state("r")
    assert state.is_pristine and state.removed_records is True and state.last_position == _at(2)
    assert not store.path_for("r").exists()
    assert store.apply(DeleteEvent(rollout_id="r"), _at(2)).outcome is ApplyOutcome.ALREADY_APPLIED
    assert store.apply(DeleteEvent(rollout_id="r"), _at(3)).removed is False


@pytest.mark.parametrize("leftover", ["entries", "entries-and-intents"])
def test_re_applying_a_delete_interrupted_after_its_fresh_state_finishes_the_removals(
    tmp_path: Path, leftover: str
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.apply(IntentEvent(rollout_id="r", model_call_id="c1"), _at(0))
    store.apply(PutEvent(rollout_id="r", entry=make_entry("r", "c1")), _at(1))
    leftover_entries = store.path_for("r").read_bytes()
    leftover_intents = store.intents_path_for("r").read_bytes()
    clean = TokenCaptureStore(tmp_path / "clean")
    clean.apply(IntentEvent(rollout_id="r", model_call_id="c1"), _at(0))
    clean.apply(PutEvent(rollout_id="r", entry=make_entry("r", "c1")), _at(1))
    clean.apply(DeleteEvent(rollout_id="r"), _at(2))
    # The crash: the delete at offset 2 replaced the state, then the process died before removing the files.
    interrupted = decide(store.read_state("r"), DeleteEvent(rollout_id="r"), _at(2)).state
    store.state_path_for("r").write_bytes(interrupted.encode())
    store.path_for("r").write_bytes(leftover_entries)
    if leftover == "entries-and-intents":
        store.intents_path_for("r").write_bytes(leftover_intents)
    assert store.read_entries("r") == []
    store.apply(DeleteEvent(rollout_id="r"), _at(2))
    assert not store.path_for("r").exists() and not store.intents_path_for("r").exists()
    assert store.state_path_for("r").read_bytes() == clean.state_path_for("r").read_bytes()


def test_a_later_event_does_not_finish_an_earlier_delete_and_lose_its_files(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.apply(DeleteEvent(rollout_id="r"), _at(0))
    store.apply(PutEvent(rollout_id="r", entry=make_entry("r", "reused")), _at(1))
    store.apply(FreezeEvent(rollout_id="r"), _at(2))
    assert [e.model_call_id for e in store.freeze_now("r").entries] == ["reused"]


def _files_open_under(directory: Path) -> list[str]:
    """Files under ``directory`` this process holds open (other descriptors come and go with other tests)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_a_projection_leaves_no_side_file_open_between_events_after_its_flush_or_when_abandoned(
    tmp_path: Path,
) -> None:
    projection = Projection(TokenCaptureStore(tmp_path))
    for offset, call_id in enumerate(("c1", "c2")):
        projection.apply(IntentEvent(rollout_id="r", model_call_id=call_id), _at(2 * offset))
        projection.apply(PutEvent(rollout_id="r", entry=make_entry("r", call_id)), _at(2 * offset + 1))
    projection.flush()
    assert _files_open_under(tmp_path) == []
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c3"), _at(4))
    projection.write_queued("r")
    assert _files_open_under(tmp_path) == []
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c4"), _at(5))
    projection.abandon(RuntimeError("the projection failed inside its block"))
    assert _files_open_under(tmp_path) == []


def test_a_rollout_deleted_and_written_again_in_one_block_keeps_only_the_new_lines(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    projection = Projection(store)
    projection.apply(IntentEvent(rollout_id="r", model_call_id="old"), _at(0))
    projection.apply(PutEvent(rollout_id="r", entry=make_entry("r", "old")), _at(1))
    projection.apply(RetireEvent(rollout_id="r"), _at(2))
    projection.apply(DeleteEvent(rollout_id="r"), _at(3))
    projection.apply(IntentEvent(rollout_id="r", model_call_id="new"), _at(4))
    projection.apply(PutEvent(rollout_id="r", entry=make_entry("r", "new")), _at(5))
    projection.flush()
    assert [entry.model_call_id for entry in store.read_entries("r")] == ["new"]
    assert store.intents_path_for("r").read_bytes() == b"new\n"
    assert [entry.model_call_id for entry in TokenCaptureStore(tmp_path).read_entries("r")] == ["new"]


def _mixed_log() -> list[tuple[Any, LogPosition]]:
    """Three rollouts interleaved: intents, puts, a conflict, a cancel, a marker, freezes, a late put, a drop,
    a retire, and a delete followed by the id's reuse."""
    events: list[Any] = []
    for turn in range(3):
        for rollout in ("a", "b", "c"):
            events.append(IntentEvent(rollout_id=rollout, model_call_id=f"{rollout}{turn}"))
            events.append(
                PutEvent(rollout_id=rollout, entry=make_entry(rollout, f"{rollout}{turn}", prompt=(turn,)))
            )
    events += [
        PutEvent(rollout_id="b", entry=make_entry("b", "b0", prompt=(9, 9))),
        CancelEvent(rollout_id="c", model_call_id="c9"),
        IncompleteEvent(rollout_id="a", model_call_id="a7", reason="lost"),
        FreezeEvent(rollout_id="a"),
        FreezeEvent(rollout_id="b"),
        PutEvent(rollout_id="a", entry=make_entry("a", "late")),
        RetireEvent(rollout_id="b"),
        DeleteEvent(rollout_id="c"),
        IntentEvent(rollout_id="c", model_call_id="again"),
        PutEvent(rollout_id="c", entry=make_entry("c", "again")),
        FreezeEvent(rollout_id="c"),
    ]
    log = [(event, _at(offset)) for offset, event in enumerate(events)]
    frozen_a = next(offset for offset, event in enumerate(events) if isinstance(event, FreezeEvent))
    log.append((DropEvent(rollout_id="a", snapshot_id=f"run:0:{frozen_a}", version=5), _at(len(events))))
    return log


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def test_a_projections_block_leaves_the_same_bytes_and_verdicts_as_the_store_applying_event_by_event(
    tmp_path: Path,
) -> None:
    log = _mixed_log()
    one_by_one = TokenCaptureStore(tmp_path / "one")
    projection = Projection(TokenCaptureStore(tmp_path / "projected"))
    expected = [one_by_one.apply(event, position) for event, position in log]
    results = [projection.apply(event, position) for event, position in log]
    projection.flush()
    assert results == expected
    assert {result.outcome for result in results} >= {
        ApplyOutcome.ACCEPTED,
        ApplyOutcome.CONFLICT,
        ApplyOutcome.REJECTED_AFTER_FREEZE,
    }
    assert _files(tmp_path / "projected") == _files(tmp_path / "one")
    again = Projection(TokenCaptureStore(tmp_path / "projected"))
    assert [again.apply(event, position) for event, position in log] == [
        one_by_one.apply(event, position) for event, position in log
    ]


def test_a_projection_block_over_more_rollouts_than_the_open_file_limit_keeps_every_line(
    tmp_path: Path,
) -> None:
    """A block must not hold a descriptor per rollout it touches.

    A materializer's block may touch a thousand rollouts (a replay of many short rollouts), and a process's
    soft limit is often 1,024 descriptors.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    limit = in_use + 16
    rollouts = [f"r{index}" for index in range(limit + 64)]
    projection = Projection(TokenCaptureStore(tmp_path))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        for offset, rollout_id in enumerate(rollouts):
            projection.apply(IntentEvent(rollout_id=rollout_id, model_call_id="c1"), _at(2 * offset))
            projection.apply(
                PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, "c1")), _at(2 * offset + 1)
            )
            projection.write_queued(rollout_id)
        projection.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _files_open_under(tmp_path) == []
    reopened = TokenCaptureStore(tmp_path)
    for rollout_id in rollouts:
        assert [entry.model_call_id for entry in reopened.read_entries(rollout_id)] == ["c1"]
        assert reopened.intents_path_for(rollout_id).read_bytes() == b"c1\n"


def test_a_side_file_another_program_appends_to_during_a_projection_block_is_refused_as_corruption(
    tmp_path: Path,
) -> None:
    """A block owns its rollouts' files and keeps their states in memory, so bytes written beside it would
    be counted as the block's own: the block must fail before its end, and before any checkpoint.

    Each write checks that the file ends where the projection's state says it does.
    """
    from tokcap.errors import StoreCorruptionError

    store = TokenCaptureStore(tmp_path)
    projection = Projection(store)
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c1"), _at(0))
    projection.apply(IntentEvent(rollout_id="other", model_call_id="c1"), _at(1))
    projection.write_queued("r")
    projection.write_queued("other")
    with store.intents_path_for("r").open("ab") as foreign:
        foreign.write(b"planted\n")
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c2"), _at(2))
    with pytest.raises(StoreCorruptionError, match="grew outside the rollout lock"):
        try:
            projection.flush()
        except StoreCorruptionError as exc:
            projection.abandon(exc)
            raise
    assert _files_open_under(tmp_path) == []  # the other rollout's file too, closed after r's check failed
