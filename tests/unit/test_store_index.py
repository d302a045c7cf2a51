"""The state file's entry index: written lazily by the file store, exactly when applied from a log."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.factories import make_entry
from tokcap.events import LogPosition, PutEvent
from tokcap.store import INDEX_FLUSH_ENTRIES, TokenCaptureStore


def _indexed_on_disk(store: TokenCaptureStore, rollout_id: str) -> int:
    return int(orjson.loads(store.state_path_for(rollout_id).read_bytes())["indexed_size"])


def test_the_index_on_disk_lags_by_fewer_than_the_flush_interval_and_reads_see_everything(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    for n in range(INDEX_FLUSH_ENTRIES * 3 + 2):
        store.append(make_entry("r", f"c{n}"))
        lag = store.path_for("r").stat().st_size - _indexed_on_disk(store, "r")
        lagging_lines = store.path_for("r").read_bytes()[-lag:].count(b"\n") if lag else 0
        assert lagging_lines < INDEX_FLUSH_ENTRIES
    assert len(store.read_state("r").entry_digests) == INDEX_FLUSH_ENTRIES * 3 + 2
    assert store.reconcile_indexes() == 1
    assert _indexed_on_disk(store, "r") == store.path_for("r").stat().st_size


def test_a_put_applied_from_a_log_writes_its_index_at_once(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    for offset in range(3):
        entry = make_entry("r", f"c{offset}")
        store.apply(PutEvent(rollout_id="r", entry=entry), LogPosition("t", 0, offset))
        assert _indexed_on_disk(store, "r") == store.path_for("r").stat().st_size


def test_a_deferred_block_writes_each_lagging_index_once_at_its_end(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.apply(PutEvent(rollout_id="r", entry=make_entry("r", "c0")), LogPosition("t", 0, 0))
    with store.deferred_durability():
        for offset in range(1, 6):
            entry = make_entry("r", f"c{offset}")
            store.apply(PutEvent(rollout_id="r", entry=entry), LogPosition("t", 0, offset))
        assert _indexed_on_disk(store, "r") < store.path_for("r").stat().st_size
    assert _indexed_on_disk(store, "r") == store.path_for("r").stat().st_size
    assert len(store.read_entries("r")) == 6
