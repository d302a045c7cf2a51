"""Scripted capture sequences written once, run against every sink/source pair.

A subclass provides ``make_sink_and_source`` (an async context manager yielding an ``IntentTokenSink``
and a ``RetiringTokenSource`` sharing one store). Every scenario runs the same steps and the same
assertions on every pair, so the file store and the Kafka path must agree with each other and with the rules.

One known difference is asserted, not tolerated: a write after a freeze or a retire raises to its writer
in the file store, while the Kafka sink is told "acknowledged" and the log refuses the write later
(DESIGN.md: "whatever its sink was told"). Such scenarios check everything a trainer sees first and the
writer's answer last, raising ``LateWriteAcceptedError``; a transport that differs there marks exactly
that case ``xfail(strict=True, raises=LateWriteAcceptedError)``, so any other failure still fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, cast

import pytest

from tokcap.errors import (
    ConflictingEntryError,
    InvalidInputError,
    RolloutFrozenError,
    RolloutRetiredError,
    TokcapError,
)
from tokcap.log.records import TokenEntry
from tokcap.protocols import IntentTokenSink, RetiringTokenSource, TokenCaptureSnapshot

SinkAndSource = tuple[IntentTokenSink, RetiringTokenSource]
Scenario = Callable[[IntentTokenSink, RetiringTokenSource], Awaitable[None]]


class LateWriteAcceptedError(AssertionError):
    """A write after a freeze or a retire was acknowledged to its writer instead of refused."""


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


async def refused(write: Awaitable[None], error: type[TokcapError]) -> bool:
    """Whether the writer was told ``error``; the scenario asserts the answer after the trainer-side checks."""
    try:
        await write
    except error:
        return True
    return False


def assert_refused_to_the_writer(**answers: bool) -> None:
    """The Gym contract: "Writing after the rollout is frozen must fail" (and after a retire, too)."""
    accepted = sorted(name for name, was_refused in answers.items() if not was_refused)
    if accepted:
        raise LateWriteAcceptedError(f"late writes acknowledged to their writer: {accepted}")


class StoreContract:
    """The scenarios; subclasses bind ``make_sink_and_source``."""

    def make_sink_and_source(self) -> AbstractAsyncContextManager[SinkAndSource]:
        """A fresh, empty sink/source pair sharing one store."""
        raise NotImplementedError

    def run(self, scenario: Scenario) -> None:
        """Run one scenario on a fresh pair."""

        async def body() -> None:
            async with self.make_sink_and_source() as (sink, source):
                await scenario(sink, source)

        asyncio.run(body())

    def test_freeze_lists_exactly_the_entries_put_before_it_and_is_idempotent(self) -> None:
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
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
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            await sink.put(make_entry("r-conflict", "c1"))
            await sink.put(make_entry("r-conflict", "c1"))
            try:
                await sink.put(make_entry("r-conflict", "c1", salt=5))
            except ConflictingEntryError:
                await sink.mark_incomplete("r-conflict", "c1")
            snapshot = await source.freeze("r-conflict")
            assert call_ids(snapshot) == ["c1"]
            assert snapshot.entries[0].canonical_json() == make_entry("r-conflict", "c1").canonical_json()
            assert snapshot.incomplete is True

        self.run(scenario)

    def test_a_write_after_freeze_is_never_in_the_snapshot_and_keeps_the_stale_one_from_being_dropped(
        self,
    ) -> None:
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            await sink.put(make_entry("r-late", "c1"))
            frozen = await source.freeze("r-late")
            put_refused = await refused(sink.put(make_entry("r-late", "c2")), RolloutFrozenError)
            intent_refused = await refused(sink.begin_call("r-late", "c3"), RolloutFrozenError)
            after = await source.freeze("r-late")
            assert call_ids(after) == ["c1"]
            assert after.snapshot_id == frozen.snapshot_id
            assert (frozen.version, after.version) == (2, 4)
            assert await source.drop("r-late", frozen.snapshot_id, frozen.version) is False
            assert await source.drop("r-late", after.snapshot_id, after.version) is True
            assert_refused_to_the_writer(put_after_freeze=put_refused, intent_after_freeze=intent_refused)

        self.run(scenario)

    def test_an_intent_without_entry_or_cancel_masks_the_snapshot(self) -> None:
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
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
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            await sink.put(make_entry("r-race", "c1"))
            frozen = await source.freeze("r-race")
            assert frozen.incomplete is False
            await sink.mark_incomplete("r-race", "c2")
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
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            await sink.put(make_entry("r-marked", "c1"))
            await sink.mark_incomplete("r-marked", "c2")
            snapshot = await source.freeze("r-marked")
            assert (call_ids(snapshot), snapshot.incomplete, snapshot.version) == (["c1"], True, 3)

        self.run(scenario)

    def test_retire_removes_records_and_its_fence_refuses_late_writes_and_freezes(self) -> None:
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            await sink.put(make_entry("r-retire", "c1"))
            await source.freeze("r-retire")
            first = await source.retire(["r-retire", "r-never"])
            assert (first.removed, first.not_found) == (("r-retire",), ("r-never",))
            put_refused = await refused(sink.put(make_entry("r-retire", "c2")), RolloutRetiredError)
            with pytest.raises(RolloutRetiredError):
                await source.freeze("r-retire")
            again = await source.retire(["r-retire"])
            assert (again.removed, again.not_found) == ((), ("r-retire",))
            assert_refused_to_the_writer(put_after_retire=put_refused)

        self.run(scenario)

    def test_delete_frees_the_id_for_reuse_with_a_new_snapshot_id(self) -> None:
        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
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

    def test_input_no_reader_could_read_back_is_refused_naming_the_call_and_field_and_nothing_is_written(
        self,
    ) -> None:
        rid = "r-input"

        def entry(call_id: str, **fields: object) -> TokenEntry:
            return make_entry(rid, call_id).model_copy(update=fields)

        bad_entries = [
            ("created_at", entry("nan-time", created_at=float("nan"))),
            ("output_items", entry("nan-item", output_items=[{"type": "x", "score": float("inf")}])),
            ("prompt_token_ids", entry("too-big", prompt_token_ids=[1, 2**64])),
            ("generation_token_ids", entry("negative", generation_token_ids=[-1, 8])),
            ("model_call_id", entry("nul\x00call")),
            ("model_call_id", entry("x" * 2000)),
        ]
        extra = TokenEntry.model_validate(
            {**make_entry(rid, "nan-extra").model_dump(), "extra_score": float("inf")}
        )
        bad_entries.append(("extra_score", extra))
        bad_call_ids = ["", "new\nline", "nul\x00", "y" * 2000]

        async def scenario(sink: IntentTokenSink, source: RetiringTokenSource) -> None:
            for field, bad in bad_entries:
                with pytest.raises(InvalidInputError, match=field) as refused_put:
                    await sink.put(bad)
                assert refused_put.value.rollout_id == rid
            for call_id in bad_call_ids:
                with pytest.raises(InvalidInputError, match="model_call_id"):
                    await sink.begin_call(rid, call_id)
                with pytest.raises(InvalidInputError, match="model_call_id"):
                    await sink.cancel_call(rid, call_id)
            with pytest.raises(InvalidInputError, match="control character"):
                await sink.mark_incomplete(rid, "lost\ncall")
            as_string = {
                **make_entry(rid, "string-log-prob").model_dump(mode="json"),
                "generation_log_probs": ["-0.5", 1],
            }
            as_bytes = {**make_entry(rid, "bytes-id").model_dump(mode="json"), "rollout_id": rid.encode()}
            for raw, field in ((as_string, "generation_log_probs"), (as_bytes, "rollout_id")):
                with pytest.raises(InvalidInputError, match=field):
                    await sink.put(cast(Any, raw))
            widest = entry(
                "wide-ids", prompt_token_ids=[0, 2**63, 2**64 - 1], generation_token_ids=[2**63 + 5, 1]
            )
            await sink.put(widest)
            snapshot = await source.freeze(rid)
            assert (call_ids(snapshot), snapshot.incomplete) == (["wide-ids"], False)
            assert snapshot.entries[0].canonical_json() == widest.canonical_json()

        self.run(scenario)
