"""Links planted in the store are refused, never followed; foreign files are skipped, never fatal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from factories import make_entry

from tokcap.cli.inspect import summarize_rollout
from tokcap.errors import StoreCorruptionError
from tokcap.files.store import TokenCaptureStore


@pytest.mark.parametrize("suffix", [".tokens.jsonl", ".tokens.intents", ".tokens.state.json", ".tokens.lock"])
def test_a_symlink_planted_as_a_rollout_file_is_refused_and_its_target_left_untouched(
    tmp_path: Path, suffix: str
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious\n")
    root = tmp_path / "store"
    store = TokenCaptureStore(root)
    (root / f"r1{suffix}").symlink_to(outside)
    with pytest.raises(StoreCorruptionError, match="symbolic link"):
        store.begin_call_now("r1", "c1")
        store.append(make_entry("r1", "c1"))
    with pytest.raises(StoreCorruptionError, match="symbolic link"):
        store.freeze_now("r1")
    assert outside.read_bytes() == b"precious\n"


def test_a_foreign_file_in_the_directory_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r1", "c1"))
    (tmp_path / "a b.tokens.jsonl").write_bytes(b"not ours\n")
    with caplog.at_level(logging.WARNING):
        assert store.rollout_ids() == ["r1"]
    assert "a b.tokens.jsonl" in caplog.text
    assert [summarize_rollout(store, rid).entries for rid in store.rollout_ids()] == [1]
