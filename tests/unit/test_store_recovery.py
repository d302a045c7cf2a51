"""Recovery: what the store does with files a crash left behind."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.factories import make_entry
from tokcap.errors import NewerSchemaError, StoreCorruptionError
from tokcap.store import TokenCaptureStore


def _write_unindexed(store: TokenCaptureStore, data: bytes) -> None:
    with store.path_for("r").open("ab") as handle:
        handle.write(data)


def test_a_torn_final_line_that_was_never_acknowledged_is_dropped(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    good_size = store.path_for("r").stat().st_size
    _write_unindexed(store, make_entry("r", "c2").canonical_json()[:40])
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]
    assert store.path_for("r").stat().st_size == good_size
    store.append(make_entry("r", "c2"))
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1", "c2"]


def test_a_durable_but_unindexed_tail_is_reindexed(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    tail = make_entry("r", "c2")
    _write_unindexed(store, tail.canonical_json() + b"\n")
    state = store.read_state("r")
    assert state.entry_digests["c2"] == tail.payload_digest()
    assert state.indexed_size == store.path_for("r").stat().st_size
    store.append(tail)
    assert store.path_for("r").read_bytes().count(b"\n") == 2
    assert store.freeze_now("r").entries[1] == tail


def test_a_lost_state_file_is_rebuilt_from_the_entries(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    store.append(make_entry("r", "c2"))
    store.state_path_for("r").unlink()
    assert sorted(store.read_state("r").entry_digests) == ["c1", "c2"]
    with pytest.raises(ValueError):
        store.append(make_entry("r", "c1", generation=(9,)))


def test_a_malformed_line_followed_by_more_content_is_corruption(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    _write_unindexed(store, b"{not json}\n" + make_entry("r", "c2").canonical_json() + b"\n")
    with pytest.raises(StoreCorruptionError, match="malformed line"):
        store.read_entries("r")


def test_a_truncated_indexed_file_is_corruption(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    with store.path_for("r").open("r+b") as handle:
        handle.truncate(10)
    with pytest.raises(StoreCorruptionError, match="truncated"):
        store.freeze_now("r")


def test_a_record_with_a_newer_schema_fails_the_read(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    raw = orjson.loads(make_entry("r", "c2").canonical_json())
    raw["schema_version"] = 99
    _write_unindexed(store, orjson.dumps(raw, option=orjson.OPT_SORT_KEYS) + b"\n")
    with pytest.raises(NewerSchemaError, match="upgrade"):
        store.read_entries("r")


def test_a_state_file_with_a_newer_schema_is_refused(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    raw = orjson.loads(store.state_path_for("r").read_bytes())
    raw["schema_version"] = 42
    store.state_path_for("r").write_bytes(orjson.dumps(raw))
    with pytest.raises(NewerSchemaError):
        store.read_entries("r")


def test_a_fence_without_a_retired_state_still_refuses_writes_and_retire_completes(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    state = store.read_state("r")
    state.advance(state.lifecycle.RETIRED)
    store.fence_path_for("r").write_bytes(state.encode())
    with pytest.raises(RuntimeError):
        store.append(make_entry("r", "c2"))
    store.retire_now(["r"])
    assert not store.path_for("r").exists()
    assert store.read_state("r").retired
