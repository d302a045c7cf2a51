"""The state file's entry index: written lazily by the file store, exactly when applied from a log."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.factories import make_entry
from tokcap.files.layout import RolloutPaths
from tokcap.files.log_projection import Projection
from tokcap.files.store import INDEX_FLUSH_ENTRIES, TokenCaptureStore
from tokcap.log.events import LogPosition, PutEvent
from tokcap.log.state import RolloutState


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
    assert len(TokenCaptureStore(tmp_path).read_entries("r")) == INDEX_FLUSH_ENTRIES * 3 + 2


def test_a_put_applied_from_a_log_writes_its_index_at_once(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    for offset in range(3):
        entry = make_entry("r", f"c{offset}")
        store.apply(PutEvent(rollout_id="r", entry=entry), LogPosition("t", 0, offset))
        assert _indexed_on_disk(store, "r") == store.path_for("r").stat().st_size


def test_a_projection_writes_each_rollouts_index_once_at_its_flush(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.apply(PutEvent(rollout_id="r", entry=make_entry("r", "c0")), LogPosition("t", 0, 0))
    projection = Projection(store)
    state_writes = []
    write_state_file = store.files.replace_state_file

    def counted(paths: RolloutPaths, state: RolloutState, **options: bool) -> bytes:
        state_writes.append(state.indexed_size)
        return write_state_file(paths, state, **options)

    store.files.replace_state_file = counted  # type: ignore[method-assign]
    for offset in range(1, 6):
        entry = make_entry("r", f"c{offset}")
        projection.apply(PutEvent(rollout_id="r", entry=entry), LogPosition("t", 0, offset))
    assert state_writes == []
    projection.flush()
    assert len(state_writes) == 1
    assert _indexed_on_disk(store, "r") == store.path_for("r").stat().st_size
    assert len(store.read_entries("r")) == 6
