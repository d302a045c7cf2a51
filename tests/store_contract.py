"""Scripted capture sequences written once, run against every sink/source pair.

A subclass provides ``make_sink_and_source`` (an async context manager yielding a sink with
``put``/``begin_call``/``cancel_call``/``mark_incomplete`` and a source with
``freeze``/``drop``/``retire``/``delete``). Each scenario asserts the same expected snapshots,
so the file store and the Kafka path must agree with each other and with the rules.

Writes that race a freeze or a fence may raise in the file store (it knows at once) and succeed
in the Kafka path (the log decides later); scenarios tolerate both and compare only what a
trainer sees: the snapshot, its incompleteness and version, and the drop verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from tokcap.errors import ConflictingEntryError, RolloutFrozenError, RolloutRetiredError
from tokcap.protocols import TokenCaptureSnapshot
from tokcap.records import TokenEntry

SinkAndSource = tuple[Any, Any]


def make_entry(rollout_id: str, call_id: str, *, tokens: int = 3, salt: int = 0) -> TokenEntry:
    """A deterministic entry; ``salt`` changes its payload without changing its call id."""
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="policy",
        prompt_token_ids=[salt + index for index in range(tokens)],
        generation_token_ids=[7, 8],
        generation_log_probs=[-0.25 - salt, -1.0 / 3.0],
        created_at=1_700_000_000.0,
    )


def call_ids(snapshot: TokenCaptureSnapshot) -> list[str]:
    """The snapshot's call ids, sorted (entry order carries no meaning)."""
    return sorted(entry.model_call_id for entry in snapshot.entries)


def directory_contents(root: Path) -> dict[str, bytes]:
    """Every file under a directory by relative name, for byte-for-byte comparison."""
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


@contextlib.asynccontextmanager
async def tolerated(*errors: type[BaseException]) -> AsyncIterator[None]:
    """Run a write whose rejection may be immediate (file store) or decided by the log (Kafka)."""
    with contextlib.suppress(*errors):
        yield


class StoreContract:
    """The scenarios; subclasses bind ``make_sink_and_source``."""

    def make_sink_and_source(self) -> AbstractAsyncContextManager[SinkAndSource]:
        """A fresh, empty sink/source pair sharing one store."""
        raise NotImplementedError

    def run(self, scenario: Callable[[Any, Any], Awaitable[None]]) -> None:
        """Run one scenario on a fresh pair."""

        async def body() -> None:
            async with self.make_sink_and_source() as (sink, source):
                await scenario(sink, source)

        asyncio.run(body())

    def test_freeze_lists_exactly_the_entries_put_before_it_and_is_idempotent(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-freeze", "c1"))
            await sink.put(make_entry("r-freeze", "c2"))
            first = await source.freeze("r-freeze")
            again = await source.freeze("r-freeze")
            assert call_ids(first) == ["c1", "c2"]
            # Gym's counting: one version per entry, one for the first freeze.
            assert (first.incomplete, first.version) == (False, 3)
            assert (again.snapshot_id, again.version, call_ids(again)) == (first.snapshot_id, 3, ["c1", "c2"])
            stored = {entry.model_call_id: entry.canonical_json() for entry in first.entries}
            assert stored["c1"] == make_entry("r-freeze", "c1").canonical_json()

        self.run(scenario)

    def test_repeated_payload_is_a_noop_and_a_conflicting_payload_masks_the_rollout(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-conflict", "c1"))
            await sink.put(make_entry("r-conflict", "c1"))
            try:
                await sink.put(make_entry("r-conflict", "c1", salt=5))
            except ConflictingEntryError:
                await sink.mark_incomplete("r-conflict", "c1", "conflicting payload")
            snapshot = await source.freeze("r-conflict")
            assert call_ids(snapshot) == ["c1"]
            assert snapshot.entries[0].canonical_json() == make_entry("r-conflict", "c1").canonical_json()
            assert snapshot.incomplete is True

        self.run(scenario)

    def test_a_write_after_freeze_is_never_in_the_snapshot_and_keeps_the_stale_one_from_being_dropped(
        self,
    ) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-late", "c1"))
            frozen = await source.freeze("r-late")
            async with tolerated(RolloutFrozenError):
                await sink.put(make_entry("r-late", "c2"))
            async with tolerated(RolloutFrozenError):
                await sink.begin_call("r-late", "c3")
            after = await source.freeze("r-late")
            assert call_ids(after) == ["c1"]
            assert after.snapshot_id == frozen.snapshot_id
            assert (frozen.version, after.version) == (2, 4)
            assert await source.drop("r-late", frozen.snapshot_id, frozen.version) is False
            assert await source.drop("r-late", after.snapshot_id, after.version) is True

        self.run(scenario)

    def test_an_intent_without_entry_or_cancel_masks_the_snapshot(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.begin_call("r-intent", "c1")
            await sink.put(make_entry("r-intent", "c1"))
            await sink.begin_call("r-intent", "c2")
            await sink.cancel_call("r-intent", "c2")
            clean = await source.freeze("r-intent")
            assert (call_ids(clean), clean.incomplete) == (["c1"], False)
            await sink.begin_call("r-dangling", "c1")
            await sink.put(make_entry("r-dangling", "c1"))
            await sink.begin_call("r-dangling", "c2")
            dangling = await source.freeze("r-dangling")
            assert (call_ids(dangling), dangling.incomplete) == (["c1"], True)

        self.run(scenario)

    def test_a_late_incomplete_marker_moves_the_version_so_the_racing_drop_fails(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-race", "c1"))
            frozen = await source.freeze("r-race")
            assert frozen.incomplete is False
            await sink.mark_incomplete("r-race", "c2", "lost after generation")
            assert await source.drop("r-race", frozen.snapshot_id, frozen.version) is False
            refrozen = await source.freeze("r-race")
            assert (refrozen.snapshot_id, refrozen.version, refrozen.incomplete) == (
                frozen.snapshot_id,
                3,
                True,
            )
            assert await source.drop("r-race", refrozen.snapshot_id, refrozen.version) is True
            assert await source.drop("r-race", refrozen.snapshot_id, refrozen.version) is True

        self.run(scenario)

    def test_an_incomplete_marker_before_freeze_masks_the_rollout(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-marked", "c1"))
            await sink.mark_incomplete("r-marked", "c2", "capture failed")
            snapshot = await source.freeze("r-marked")
            assert (call_ids(snapshot), snapshot.incomplete, snapshot.version) == (["c1"], True, 3)

        self.run(scenario)

    def test_retire_removes_records_and_its_fence_refuses_late_writes_and_freezes(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-retire", "c1"))
            await source.freeze("r-retire")
            first = await source.retire(["r-retire", "r-never"])
            assert (first.removed, first.not_found) == (("r-retire",), ("r-never",))
            async with tolerated(RolloutRetiredError):
                await sink.put(make_entry("r-retire", "c2"))
            with pytest.raises(RolloutRetiredError):
                await source.freeze("r-retire")
            again = await source.retire(["r-retire"])
            assert (again.removed, again.not_found) == ((), ("r-retire",))

        self.run(scenario)

    def test_delete_frees_the_id_for_reuse_with_a_new_snapshot_id(self) -> None:
        async def scenario(sink: Any, source: Any) -> None:
            await sink.put(make_entry("r-reuse", "c1"))
            old = await source.freeze("r-reuse")
            assert await source.drop("r-reuse", old.snapshot_id, old.version) is True
            deleted = await source.delete(["r-reuse", "r-absent"])
            assert (deleted.removed, deleted.not_found) == (("r-reuse",), ("r-absent",))
            await sink.put(make_entry("r-reuse", "c9"))
            new = await source.freeze("r-reuse")
            assert (call_ids(new), new.version, new.incomplete) == (["c9"], 2, False)
            assert new.snapshot_id != old.snapshot_id

        self.run(scenario)
