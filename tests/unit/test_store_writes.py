"""Rules of put, intents and incomplete markers in the file store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from tests.factories import make_entry
from tokcap.errors import ConflictingEntryError, InvalidRolloutIdError
from tokcap.files.store import TokenCaptureStore


def test_repeating_a_put_with_the_same_payload_is_a_no_op(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    size = store.path_for("r").stat().st_size
    store.append(make_entry("r", "c1"))
    assert store.path_for("r").stat().st_size == size
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]
    assert not store.is_incomplete("r")


def test_a_conflicting_put_fails_and_marks_the_rollout_incomplete(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1", generation=(4, 5)))
    with pytest.raises(ConflictingEntryError) as raised:
        store.append(make_entry("r", "c1", generation=(4, 6)))
    assert raised.value.rollout_id == "r" and raised.value.model_call_id == "c1"
    assert isinstance(raised.value, ValueError)
    assert store.is_incomplete("r")
    assert [e.generation_token_ids for e in store.read_entries("r")] == [[4, 5]]
    assert store.freeze_now("r").incomplete


def test_each_entry_line_is_the_canonical_json_of_the_entry(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    entry = make_entry("r", "c1", output_items=[{"type": "message", "content": []}])
    store.append(entry)
    assert store.path_for("r").read_bytes() == entry.canonical_json() + b"\n"
    state = orjson.loads(store.state_path_for("r").read_bytes())
    assert state["entry_digests"] == {"c1": entry.payload_digest()}
    assert state["indexed_size"] == len(entry.canonical_json()) + 1
    assert {"frozen", "retired", "incomplete", "snapshot_id", "version"} <= set(state)


def test_mark_incomplete_is_durable_in_the_marker_file(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.mark_incomplete_now("r", "c9", "put failed")
    assert store.incomplete_path_for("r").exists()
    assert TokenCaptureStore(tmp_path).is_incomplete("r")
    assert b"c9" in store.incomplete_path_for("r").read_bytes()


def test_different_rollouts_write_concurrently_from_one_event_loop(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    async def write_all() -> None:
        await asyncio.gather(
            *(store.put(make_entry(f"r{n % 5}", f"c{n}")) for n in range(60)),
            *(store.begin_call(f"r{n % 5}", f"i{n}") for n in range(20)),
        )

    asyncio.run(write_all())
    assert sum(len(store.read_entries(f"r{n}")) for n in range(5)) == 60


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "../x", "a/b", "a\\b", "tab\there", "é", "x" * 201, "-lead", " sp"]
)
def test_a_bad_rollout_id_is_refused_before_any_file_is_touched(tmp_path: Path, bad: str) -> None:
    store = TokenCaptureStore(tmp_path / "store")
    with pytest.raises(InvalidRolloutIdError):
        store.begin_call_now(bad, "c1")
    with pytest.raises(InvalidRolloutIdError):
        store.freeze_now(bad)
    assert list((tmp_path / "store").iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["store"]
