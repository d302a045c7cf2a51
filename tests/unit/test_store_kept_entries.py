"""A freeze of the file store answers with exactly what parsing the rollout's file gives, kept copies or not.

The store keeps exact copies of the entries its own puts appended (``tokcap.files.kept_entries``), so a freeze
need not parse the file. Each test compares the snapshot exactly (types, key order, fields-set) with a fresh
read of the same directory by another store instance, which keeps nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.exact_shape import exact_shape, snapshot_shape
from tests.factories import make_entry
from tokcap.files.kept_entries import KeptEntries
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from tokcap.log.state import RolloutState


def _parses_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every stored line the process parses from now on."""
    parsed: list[int] = []
    original = TokenEntry.from_json.__func__  # type: ignore[attr-defined]

    def counted(cls: type[TokenEntry], data: bytes | str) -> TokenEntry:
        parsed.append(1)
        return original(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(TokenEntry, "from_json", classmethod(counted))
    return parsed


def _fresh_read(directory: Path, rollout_id: str) -> list[TokenEntry]:
    return TokenCaptureStore(directory, kept_entry_tokens=0).read_entries(rollout_id)


def _write(store: TokenCaptureStore, rollout_id: str, calls: int, *, prefix: str = "c") -> list[TokenEntry]:
    entries = [
        make_entry(
            rollout_id,
            f"{prefix}{index}",
            prompt=range(index * 10, index * 10 + 7),
            output_items=[{"type": "message", "content": [{"text": f"turn {index}"}]}],
            x_note={"turn": index, "tags": ["a", "b"]},
        )
        for index in range(calls)
    ]
    for entry in entries:
        store.begin_call_now(rollout_id, entry.model_call_id)
        store.append(entry)
    return entries


def test_a_freeze_after_the_stores_own_puts_parses_no_line_and_equals_a_fresh_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TokenCaptureStore(tmp_path)
    _write(store, "r", 5)
    parsed = _parses_counted(monkeypatch)
    snapshot = store.freeze_now("r")
    assert parsed == []
    fresh = _fresh_read(tmp_path, "r")
    assert [exact_shape(entry) for entry in snapshot.entries] == [exact_shape(entry) for entry in fresh]


def test_a_caller_changing_its_entry_after_the_put_does_not_change_the_snapshot(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    entries = _write(store, "r", 2)
    entries[0].prompt_token_ids.append(999)
    entries[1].output_items[0]["content"].append({"text": "changed"})
    entries[1].__pydantic_extra__["x_note"]["tags"].append("c")  # type: ignore[index]
    snapshot = store.freeze_now("r")
    fresh = _fresh_read(tmp_path, "r")
    assert [exact_shape(entry) for entry in snapshot.entries] == [exact_shape(entry) for entry in fresh]
    assert 999 not in snapshot.entries[0].prompt_token_ids


def test_a_rollout_another_store_appended_to_is_parsed_and_holds_every_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TokenCaptureStore(tmp_path)
    other = TokenCaptureStore(tmp_path)
    _write(store, "r", 2)
    _write(other, "r", 1, prefix="other-")
    parsed = _parses_counted(monkeypatch)
    snapshot = store.freeze_now("r")
    assert len(parsed) == 3
    assert {entry.model_call_id for entry in snapshot.entries} == {"c0", "c1", "other-0"}
    assert [exact_shape(entry) for entry in snapshot.entries] == [
        exact_shape(entry) for entry in _fresh_read(tmp_path, "r")
    ]


def test_a_store_appending_after_another_stores_line_keeps_nothing_it_could_hand_over_wrong(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    other = TokenCaptureStore(tmp_path)
    _write(other, "r", 1, prefix="other-")
    _write(store, "r", 2)
    snapshot = store.freeze_now("r")
    assert [entry.model_call_id for entry in snapshot.entries] == ["other-0", "c0", "c1"]
    assert [exact_shape(entry) for entry in snapshot.entries] == [
        exact_shape(entry) for entry in _fresh_read(tmp_path, "r")
    ]


def test_a_rollout_deleted_and_rewritten_elsewhere_is_answered_with_the_new_entries(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    other = TokenCaptureStore(tmp_path)
    _write(store, "r", 2)
    other.delete_now(["r"])
    rewritten = make_entry("r", "c0", prompt=[42, 43])
    other.append(rewritten)
    snapshot = store.freeze_now("r")
    assert [entry.prompt_token_ids for entry in snapshot.entries] == [[42, 43]]
    assert [exact_shape(entry) for entry in snapshot.entries] == [
        exact_shape(entry) for entry in _fresh_read(tmp_path, "r")
    ]


def test_a_rollout_deleted_and_rewritten_by_the_same_store_is_answered_with_the_new_entries(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    _write(store, "r", 3)
    store.delete_now(["r"])
    _write(store, "r", 1, prefix="new-")
    snapshot = store.freeze_now("r")
    assert [entry.model_call_id for entry in snapshot.entries] == ["new-0"]
    assert [exact_shape(entry) for entry in snapshot.entries] == [
        exact_shape(entry) for entry in _fresh_read(tmp_path, "r")
    ]


def test_a_second_freeze_returns_the_same_snapshot_from_the_file(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _write(store, "r", 3)
    first = store.freeze_now("r")
    assert snapshot_shape(store.freeze_now("r")) == snapshot_shape(first)
    assert snapshot_shape(TokenCaptureStore(tmp_path).freeze_now("r")) == snapshot_shape(first)


def test_a_rejected_put_after_the_freeze_is_not_kept_or_answered(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    _write(store, "r", 2)
    first = store.freeze_now("r")
    with pytest.raises(Exception, match="frozen"):
        store.append(make_entry("r", "late"))
    again = store.freeze_now("r")
    assert [entry.model_call_id for entry in again.entries] == [
        entry.model_call_id for entry in first.entries
    ]


def test_rollouts_past_the_token_budget_are_forgotten_oldest_first_and_still_answered_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each entry carries 7 prompt and 2 generated tokens: two rollouts of 2 entries fit in 40 tokens, three do not.
    store = TokenCaptureStore(tmp_path, kept_entry_tokens=40)
    for rollout_id in ("a", "b", "c"):
        _write(store, rollout_id, 2)
    parsed = _parses_counted(monkeypatch)
    snapshots = {rollout_id: store.freeze_now(rollout_id) for rollout_id in ("a", "b", "c")}
    assert len(parsed) == 2, "only the oldest rollout was forgotten and parsed"
    for rollout_id, snapshot in snapshots.items():
        assert [exact_shape(entry) for entry in snapshot.entries] == [
            exact_shape(entry) for entry in _fresh_read(tmp_path, rollout_id)
        ]


def test_a_store_keeping_no_tokens_parses_every_freeze(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TokenCaptureStore(tmp_path, kept_entry_tokens=0)
    _write(store, "r", 2)
    parsed = _parses_counted(monkeypatch)
    store.freeze_now("r")
    assert len(parsed) == 2


@pytest.mark.parametrize("removal", ["retire", "delete", "drop"])
def test_a_rollout_whose_records_are_removed_frees_what_was_kept(tmp_path: Path, removal: str) -> None:
    store = TokenCaptureStore(tmp_path)
    _write(store, "r", 2)
    _write(store, "other", 1)
    before = store._kept_entries.tokens
    if removal == "retire":
        store.retire_now(["r"])
    elif removal == "delete":
        store.delete_now(["r"])
    else:
        # Frozen by another instance, so this one still keeps the entries when it drops the snapshot.
        snapshot = TokenCaptureStore(tmp_path).freeze_now("r")
        assert "r" in store._kept_entries
        assert store.drop_now("r", snapshot.snapshot_id, snapshot.version)
    assert "r" not in store._kept_entries
    assert 0 < store._kept_entries.tokens < before


def test_kept_copies_are_refused_when_the_state_names_other_digests_or_another_size() -> None:
    kept = KeptEntries()
    entry = make_entry("r", "c0")
    line = entry.canonical_json() + b"\n"
    digest = entry.payload_digest()
    matching = RolloutState(rollout_id="r", entry_digests={"c0": digest}, indexed_size=len(line))
    kept.appended("r", entry, 0, len(line), digest)
    assert kept.take("r", matching.evolve(entry_digests={"c0": "0" * 64})) is None
    assert kept.take("r", matching) is None, "a refused take forgets the rollout"
    kept.appended("r", entry, 0, len(line), digest)
    assert kept.take("r", matching.evolve(indexed_size=len(line) + 1)) is None
    kept.appended("r", entry, 0, len(line), digest)
    taken = kept.take("r", matching)
    assert taken is not None and [exact_shape(copy) for copy in taken] == [
        exact_shape(TokenEntry.from_json(line))
    ]
    assert kept.tokens == 0


def test_a_line_appended_anywhere_but_after_the_kept_ones_forgets_the_rollout() -> None:
    kept = KeptEntries()
    first, second = make_entry("r", "c0"), make_entry("r", "c1")
    kept.appended("r", first, 0, 100, first.payload_digest())
    kept.appended("r", second, 150, 100, second.payload_digest())
    assert "r" not in kept
    assert kept.tokens == 0


def test_an_entry_that_cannot_be_copied_exactly_forgets_the_rollout() -> None:
    kept = KeptEntries()
    entry = make_entry("r", "c0")
    kept.appended("r", entry, 0, 100, entry.payload_digest())
    odd = make_entry("r", "c1")
    odd.prompt_token_ids.append(True)
    kept.appended("r", odd, 100, 100, odd.payload_digest())
    assert "r" not in kept


def test_a_negative_token_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        KeptEntries(-1)
