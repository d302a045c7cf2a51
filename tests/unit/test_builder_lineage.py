"""Lineage snapshots: parent links are verified, delta prompts rebuilt to a full anchor, and what cannot be
proven is left out and named, so the consumer masks it with a typed reason."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tests.factories import make_entry
from tokcap.builder import run_builder
from tokcap.consumer import MaskReason, TrajectoryResult, trajectories_from_source
from tokcap.delta_records import rebuild_full_prompts, store_as_delta
from tokcap.log.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.protocols import TokenCaptureSnapshot

ROOT = ParentResolutionStatus.ROOT
RESOLVED = ParentResolutionStatus.RESOLVED


def call(
    call_id: str,
    prompt: Sequence[int],
    generation: Sequence[int],
    parent: str | None = None,
    *,
    delta_after: Sequence[int] | None = None,
) -> TokenEntry:
    """A stamped call; with ``delta_after`` (the parent's full sequence) it is stored as a delta, as Gym would."""
    entry = make_entry("r", call_id, prompt, generation)
    cumulative = store_as_delta(entry, delta_after) if delta_after is not None else None
    return stamp_lineage(entry, parent, parent_resolution=RESOLVED if parent else ROOT, cumulative=cumulative)


class Frozen:
    def __init__(self, entries: list[TokenEntry]) -> None:
        self.snapshot = TokenCaptureSnapshot("r", tuple(entries), False, "s", 1)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return self.snapshot


def consume(entries: list[TokenEntry]) -> TrajectoryResult:
    return asyncio.run(trajectories_from_source("r", Frozen(entries)))  # type: ignore[arg-type]


def test_a_delta_prompt_is_rebuilt_from_its_parents_full_sequence_and_keeps_its_digest() -> None:
    root = call("c1", [1, 2], [3])
    child = call("c2", [1, 2, 3, 4], [5], "c1", delta_after=[1, 2, 3])
    assert child.prompt_token_ids == [4] and child.prompt_is_delta
    rebuilt = rebuild_full_prompts([child, root])
    assert rebuilt.broken == ()
    assert [entry.prompt_token_ids for entry in rebuilt.entries] == [[1, 2, 3, 4], [1, 2]]


def test_a_prompt_that_does_not_extend_its_parent_is_stored_full() -> None:
    entry = make_entry("r", "c2", [9, 4], [5])
    assert store_as_delta(entry, [1, 2, 3]) is None
    assert entry.prompt_token_ids == [9, 4] and not entry.prompt_is_delta


def test_a_delta_whose_link_names_a_retry_sibling_fails_its_digest_and_masks_the_rollout() -> None:
    # The writer proved c2a as the parent; the stored link was then pointed at its retry c2b.
    root = call("c1", [1, 2], [3])
    kept = call("c2a", [1, 2, 3, 4], [5], "c1")
    retry = call("c2b", [1, 2, 3, 4], [6], "c1")
    child = call("c3", [1, 2, 3, 4, 5, 7], [8], "c2a", delta_after=[1, 2, 3, 4, 5])
    relinked = child.model_copy(update={"parent_call_id": "c2b"})
    build = run_builder([root, kept, retry, relinked])
    assert "c3" not in {call_id for chain in build.chains for call_id in chain.call_ids}
    assert build.notes.parent_link_failures == {"delta_chain_unreconstructable": 1}
    result = consume([root, kept, retry, relinked])
    assert result.masked and result.response is None
    assert MaskReason.BROKEN_DELTA_CHAIN in result.mask_reasons


def test_a_full_prompt_whose_named_parent_does_not_prefix_it_is_a_boundary_not_a_link() -> None:
    root = call("c1", [1, 2], [3])
    stale = call("c2", [9, 9, 9], [4], "c1")
    build = run_builder([root, stale])
    assert build.notes.parent_link_failures == {"parent_digest_mismatch": 1}
    assert build.notes.roots == 2
    assert MaskReason.PARENT_DIGEST_MISMATCH in consume([root, stale]).mask_reasons


def test_a_lost_middle_call_is_bridged_by_prefix_in_full_records_but_masks_delta_records() -> None:
    root = call("c1", [1, 2], [3])
    last_full = call("c3", [1, 2, 3, 4, 5, 6, 7], [8], "c2")
    full = consume([root, last_full])
    assert full.masked is False
    assert full.build is not None and full.build.notes.parent_link_failures == {
        "parent_call_id_missing_recovered": 1
    }
    last_delta = call("c3", [1, 2, 3, 4, 5, 6, 7], [8], "c2", delta_after=[1, 2, 3, 4, 5, 6])
    delta = consume([root, last_delta])
    assert delta.masked is True
    assert MaskReason.BROKEN_DELTA_CHAIN in delta.mask_reasons


def test_a_delta_child_of_a_root_that_generated_nothing_is_masked_with_its_parent_missing() -> None:
    root = call("c1", list(range(100, 140)), [])
    child = call("c2", [*range(100, 140), 7, 8], [9], "c1", delta_after=list(range(100, 140)))
    result = consume([root, child])
    assert result.masked is True and result.response is None
    assert MaskReason.MISSING_PARENT in result.mask_reasons


def test_a_three_call_delta_rollout_is_delivered_whole() -> None:
    c1 = call("c1", [1, 2], [3])
    c2 = call("c2", [1, 2, 3, 4], [5], "c1", delta_after=[1, 2, 3])
    c3 = call("c3", [1, 2, 3, 4, 5, 6], [7], "c2", delta_after=[1, 2, 3, 4, 5])
    result = consume([c3, c1, c2])
    assert result.masked is False, result.mask_reasons
    assert result.build is not None and result.build.main_chain is not None
    tokens = result.build.main_chain.training_tokens()
    assert tokens.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert tokens.loss_mask == [0, 0, 1, 0, 1, 0, 1]


def test_per_request_gives_each_delta_call_its_full_prompt_and_leaves_out_one_that_cannot_be_rebuilt() -> (
    None
):
    c1 = call("c1", [1, 2], [3])
    c2 = call("c2", [1, 2, 3, 4], [5], "c1", delta_after=[1, 2, 3])
    orphan = call("c3", [7, 8, 9], [6], "gone", delta_after=[7, 8])
    build = run_builder([c1, c2, orphan], "per_request")
    assert {chain.chain_id: chain.root_prompt_token_ids for chain in build.chains} == {
        "c1": (1, 2),
        "c2": (1, 2, 3, 4),
    }


def test_a_scored_call_behind_an_unproven_link_masks_for_that_reason_alone() -> None:
    c1 = call("c1", [1, 2], [3])
    c2 = stamp_lineage(
        make_entry("r", "c2", [1, 2, 3, 4], [5]), None, parent_resolution=ParentResolutionStatus.UNRESOLVED
    )
    c3 = call("c3", [1, 2, 3, 4, 5, 6], [7], "c2")
    result = asyncio.run(
        trajectories_from_source("r", Frozen([c1, c2, c3]), explicit_terminal_call_id="c3")  # type: ignore[arg-type]
    )
    assert result.masked and result.response is None
    assert result.mask_reasons == (MaskReason.TERMINAL_NOT_DELIVERED,)
    assert result.metrics["terminal_attribution"]["chain"] == "broken"
