"""The file lineage resolver keeps each rollout's index and last parent between resolves; what it kept must never
answer with a parent the file no longer holds."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from delta_chains import DeltaChain, delta_chain

from tokcap.errors import StoreCorruptionError
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver, KeptParents, LineageResolution, Materialized
from tokcap.log.records import ParentResolutionStatus, pack_token_ids

ROLLOUT = "r"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TokenCaptureStore]:
    made = TokenCaptureStore(tmp_path / "store")
    yield made
    asyncio.run(made.close())


@pytest.fixture
def resolver(store: TokenCaptureStore) -> Iterator[FileLineageResolver]:
    made = FileLineageResolver(store.root)
    yield made
    asyncio.run(made.close())


def _write(store: TokenCaptureStore, chain: DeltaChain, calls: int) -> None:
    for entry in chain.entries[:calls]:
        store.append(entry)


def _answer(resolver: FileLineageResolver, chain: DeltaChain, call: int) -> LineageResolution:
    """The resolver's answer to the request continuing ``call``."""
    return resolver.resolve_now(ROLLOUT, chain.requests[call + 1])


def _assert_resolves(resolution: LineageResolution, chain: DeltaChain, call: int) -> None:
    assert resolution.match is not None, resolution
    assert resolution.match.model_call_id == f"call-{call}"
    assert resolution.match.cumulative_token_ids == chain.cumulative[call]


def _warm(store: TokenCaptureStore, resolver: FileLineageResolver, chain: DeltaChain, calls: int) -> None:
    """Write ``calls`` calls and resolve the last one, so the resolver keeps the rollout's index and parent."""
    _write(store, chain, calls)
    _assert_resolves(_answer(resolver, chain, calls - 1), chain, calls - 1)


def _other_store_files(tmp_path: Path, chain: DeltaChain, calls: int) -> tuple[bytes, bytes]:
    """The entries and state files of ``chain`` written by a store of its own."""
    other = TokenCaptureStore(tmp_path / "other")
    try:
        _write(other, chain, calls)
        return other.path_for(ROLLOUT).read_bytes(), other.state_path_for(ROLLOUT).read_bytes()
    finally:
        asyncio.run(other.close())


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite a file's bytes keeping its inode, as a restore or an editor that truncates would."""
    before = os.stat(path).st_ino
    with open(path, "r+b") as handle:
        handle.truncate(0)
        handle.write(data)
    assert os.stat(path).st_ino == before


def test_each_resolve_of_a_growing_rollout_sees_the_calls_appended_since_the_last(
    store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 6)
    for call in range(6):
        store.append(chain.entries[call])
        _assert_resolves(_answer(resolver, chain, call), chain, call)
    # An older call resolves too, read again from its place in the file.
    _assert_resolves(_answer(resolver, chain, 2), chain, 2)


def test_a_retired_rollout_resolves_nothing_after_a_warm_resolve(
    store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 3)
    _warm(store, resolver, chain, 3)
    store.retire_now([ROLLOUT])
    assert _answer(resolver, chain, 2).status == ParentResolutionStatus.UNRESOLVED


def test_a_dropped_snapshot_resolves_nothing_after_a_warm_resolve(
    store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 3)
    _warm(store, resolver, chain, 3)
    snapshot = store.freeze_now(ROLLOUT)
    # Frozen, the rollout's calls are still its recorded parents.
    _assert_resolves(_answer(resolver, chain, 2), chain, 2)
    assert store.drop_now(ROLLOUT, snapshot.snapshot_id, snapshot.version)
    assert _answer(resolver, chain, 2).status == ParentResolutionStatus.UNRESOLVED


def test_a_deleted_and_rewritten_rollout_resolves_to_the_new_tokens(
    store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    old, new = delta_chain(ROLLOUT, 3), delta_chain(ROLLOUT, 3, base=1000)
    _warm(store, resolver, old, 3)
    store.delete_now([ROLLOUT])
    _write(store, new, 3)
    _assert_resolves(_answer(resolver, new, 2), new, 2)
    _assert_resolves(_answer(resolver, new, 1), new, 1)


def test_a_file_rewritten_in_place_with_other_calls_resolves_to_what_it_holds_now(
    tmp_path: Path, store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    old, new = delta_chain(ROLLOUT, 3), delta_chain(ROLLOUT, 4, base=1000)
    _warm(store, resolver, old, 3)
    entries, state = _other_store_files(tmp_path, new, 4)
    # Same inode, longer than what was read, every byte different: only the state's digests tell.
    _rewrite_in_place(store.path_for(ROLLOUT), entries)
    _rewrite_in_place(store.state_path_for(ROLLOUT), state)
    _assert_resolves(_answer(resolver, new, 3), new, 3)
    _assert_resolves(_answer(resolver, new, 2), new, 2)


def test_a_file_replaced_by_a_shorter_one_no_longer_resolves_the_calls_it_lost(
    tmp_path: Path, store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 4)
    _warm(store, resolver, chain, 4)
    entries, state = _other_store_files(tmp_path, chain, 2)
    _rewrite_in_place(store.path_for(ROLLOUT), entries)
    _rewrite_in_place(store.state_path_for(ROLLOUT), state)
    assert _answer(resolver, chain, 3).status == ParentResolutionStatus.UNRESOLVED
    _assert_resolves(_answer(resolver, chain, 1), chain, 1)


def test_a_torn_last_line_is_not_a_parent_until_it_is_complete(
    store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 3)
    _warm(store, resolver, chain, 2)
    line = chain.entries[2].canonical_json() + b"\n"
    with open(store.path_for(ROLLOUT), "ab") as handle:
        handle.write(line[:40])
    assert _answer(resolver, chain, 2).status == ParentResolutionStatus.UNRESOLVED
    _assert_resolves(_answer(resolver, chain, 1), chain, 1)
    with open(store.path_for(ROLLOUT), "ab") as handle:
        handle.write(line[40:])
    _assert_resolves(_answer(resolver, chain, 2), chain, 2)


def test_an_entries_file_replaced_by_a_symlink_is_refused_not_answered_from_what_was_read(
    tmp_path: Path, store: TokenCaptureStore, resolver: FileLineageResolver
) -> None:
    chain = delta_chain(ROLLOUT, 3)
    _warm(store, resolver, chain, 3)
    path = store.path_for(ROLLOUT)
    elsewhere = tmp_path / "elsewhere.jsonl"
    shutil.copyfile(path, elsewhere)
    path.unlink()
    path.symlink_to(elsewhere)
    with pytest.raises(StoreCorruptionError, match="symbolic link"):
        _answer(resolver, chain, 2)


def test_a_resolver_keeping_no_parent_tokens_still_resolves_every_call(store: TokenCaptureStore) -> None:
    chain = delta_chain(ROLLOUT, 4)
    resolver = FileLineageResolver(store.root, max_kept_tokens=0)
    try:
        for call in range(4):
            store.append(chain.entries[call])
            _assert_resolves(_answer(resolver, chain, call), chain, call)
    finally:
        asyncio.run(resolver.close())


def _materialized(call_id: str, tokens: int) -> Materialized:
    ids = tuple(range(tokens))
    return Materialized(call_id, ids, pack_token_ids(ids))


def test_a_kept_parent_is_handed_back_only_to_the_state_that_kept_it() -> None:
    kept, reading, other = KeptParents(100), object(), object()
    kept.keep(ROLLOUT, reading, _materialized("call-1", 3))
    assert kept.get(ROLLOUT, other) is None
    found = kept.get(ROLLOUT, reading)
    assert found is not None and found.call_id == "call-1"


def test_kept_parents_stay_within_their_token_bound_forgetting_the_oldest_first() -> None:
    kept, owner = KeptParents(10), object()
    kept.keep("a", owner, _materialized("a-1", 4))
    kept.keep("b", owner, _materialized("b-1", 4))
    kept.keep("c", owner, _materialized("c-1", 4))
    kept.keep("d", owner, _materialized("d-1", 11))
    assert [kept.get(name, owner) is not None for name in "abcd"] == [False, True, True, False]
