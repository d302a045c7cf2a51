"""Recovery: what the store does with files a crash left behind."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.factories import make_entry
from tokcap.errors import NewerSchemaError, RolloutFrozenError, StoreCorruptionError, StoreFormatError
from tokcap.files.store import TokenCaptureStore


def _write_unindexed(store: TokenCaptureStore, data: bytes) -> None:
    with store.path_for("r").open("ab") as handle:
        handle.write(data)


def test_a_torn_final_line_is_ignored_by_reads_and_cut_by_the_next_write(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    good_size = store.path_for("r").stat().st_size
    _write_unindexed(store, make_entry("r", "c2").canonical_json()[:40])
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]
    assert store.path_for("r").stat().st_size == good_size + 40
    store.begin_call_now("r", "c2")
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


def test_lines_that_raced_a_freeze_tokcap_recorded_are_cut_by_the_next_write_and_markers_are_kept(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.begin_call_now("r", "c1")
    store.append(make_entry("r", "c1"))
    store.begin_call_now("r", "c2")
    frozen = store.freeze_now("r")
    files = {path: path.read_bytes() for path in (store.path_for("r"), store.intents_path_for("r"))}
    _write_unindexed(store, make_entry("r", "c3").canonical_json() + b"\n")
    with store.intents_path_for("r").open("ab") as handle:
        handle.write(b"c3\n")
    with store.incomplete_path_for("r").open("ab") as handle:
        handle.write(b"c4\n")
    with pytest.raises(RolloutFrozenError):
        store.begin_call_now("r", "c5")
    assert {path: path.read_bytes() for path in files} == files
    assert store.incomplete_path_for("r").read_bytes() == b"c4\n"
    state = store.read_state("r")
    assert sorted(state.intents) == ["c1", "c2"] and state.dangling_intents == ("c2",)
    assert [mark.model_call_id for mark in state.incomplete_marks] == ["c4"]
    again = store.freeze_now("r")
    assert (again.snapshot_id, again.entries, again.incomplete) == (frozen.snapshot_id, frozen.entries, True)


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
    raw["tokcap"]["schema_version"] = 42
    store.state_path_for("r").write_bytes(orjson.dumps(raw))
    with pytest.raises(NewerSchemaError):
        store.read_entries("r")


def test_a_retire_stopped_before_its_removals_still_refuses_writes_and_is_finished_by_the_next_writer(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    store.begin_call_now("r", "c2")
    entries = store.path_for("r").read_bytes()
    intents = store.intents_path_for("r").read_bytes()
    store.retire_now(["r"])
    # The crash: the retired state was durable, the records were not removed yet.
    store.path_for("r").write_bytes(entries)
    store.intents_path_for("r").write_bytes(intents)
    assert store.read_entries("r") == []
    with pytest.raises(RuntimeError):
        store.append(make_entry("r", "c2"))
    assert not store.path_for("r").exists() and not store.intents_path_for("r").exists()
    assert store.read_state("r").retired


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("r.tokens.fence", b"{}"),
        ("r.tokens.state.json", b'{"lifecycle":"open","rollout_id":"r","schema_version":1}'),
        ("r.tokens.intents", b'{"model_call_id":"c1","op":"intent"}\n'),
    ],
)
def test_a_directory_of_tokcap_0_1_is_refused_with_the_upgrade_step_never_misread(
    tmp_path: Path, name: str, content: bytes
) -> None:
    (tmp_path / name).write_bytes(content)
    store = TokenCaptureStore(tmp_path)
    with pytest.raises(StoreFormatError, match=r"tokcap 0\.1.*tokcap replay"):
        store.read_entries("r")
    with pytest.raises(StoreFormatError):
        store.begin_call_now("r", "c9")
    assert (tmp_path / name).read_bytes() == content
