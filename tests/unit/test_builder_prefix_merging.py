"""prefix_merging: parents by longest prefix, retries, roots, quarantine, order independence and depth."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import make_entry
from tests.unit.agent_rollouts import AgentRollout
from tokcap.builder import Chain, ChainLink, per_request, prefix_merging, run_builder
from tokcap.errors import ChainValidationError, TrajectoryBuildError, UnknownBuilderError
from tokcap.log.records import TokenEntry


def tool_using_agent() -> AgentRollout:
    """Three kept turns with tool output between them; the second turn was retried once."""
    agent = AgentRollout("r", [1, 2, 3])
    agent.turn("c1", [10, 11], then=[90, 91, 92])
    agent.attempt("c2-retry", [12, 13])
    agent.turn("c2", [14, 15], then=[93])
    agent.turn("c3", [16])
    return agent


def chain_shape(entries: list[TokenEntry]) -> list[tuple[str, ...]]:
    return [chain.call_ids for chain in prefix_merging(entries).chains]


def test_a_tool_using_agent_builds_one_chain_with_tool_tokens_as_interstitials() -> None:
    build = prefix_merging(tool_using_agent().entries)
    assert build.notes.roots == 1
    assert build.notes.chains == 1
    main = build.main_chain
    assert main is not None
    assert main.call_ids == ("c1", "c2", "c3")
    assert main.root_prompt_token_ids == (1, 2, 3)
    assert [link.interstitial_token_ids for link in main.links] == [(), (90, 91, 92), (93,)]
    main.validate()


def test_a_retry_that_a_later_call_extends_is_kept_and_its_sibling_discarded() -> None:
    build = prefix_merging(tool_using_agent().entries)
    assert build.notes.discarded_retries == ("c2-retry",)
    assert build.notes.unresolved_retries == ()
    assert build.notes.generated_tokens_captured == 7
    assert build.notes.generated_tokens_delivered == 5
    assert build.notes.delivered_fraction == pytest.approx(5 / 7)


def test_a_lost_final_call_leaves_its_retry_unresolved_keeping_the_latest_attempt() -> None:
    agent = AgentRollout("r", [1, 2, 3])
    agent.turn("c1", [10], then=[90])
    agent.attempt("c2-first", [11])
    agent.attempt("c2-second", [12])
    build = prefix_merging(agent.entries)
    assert build.notes.unresolved_retries == (("c2-first", "c2-second"),)
    assert build.main_chain is not None
    assert build.main_chain.call_ids == ("c1", "c2-second")
    assert build.notes.discarded_retries == ("c2-first",)


def test_a_lost_middle_call_is_invisible_to_the_builder_so_only_the_incomplete_mark_can_mask_it() -> None:
    agent = AgentRollout("r", [1, 2, 3])
    agent.turn("c1", [10], then=[90])
    agent.turn("c2", [11, 12], then=[91])
    agent.turn("c3", [13])
    build = prefix_merging(agent.without("c2"))
    assert build.notes.roots == 1
    assert build.main_chain is not None
    assert build.main_chain.call_ids == ("c1", "c3")
    assert build.main_chain.links[1].interstitial_token_ids == (90, 11, 12, 91)


def test_a_lost_middle_call_with_a_retry_leaves_two_chains() -> None:
    build = prefix_merging(tool_using_agent().without("c2"))
    assert build.notes.chains == 2
    assert set(build.branch_chain_ids) | {build.main_chain_id} == {"c2-retry", "c3"}


def test_compaction_starts_a_new_root_and_the_earlier_root_is_the_main_chain() -> None:
    agent = AgentRollout("r", [1, 2, 3])
    agent.turn("c1", [10], then=[90])
    agent.turn("c2", [11], then=[91])
    agent.compact([7, 7, 7, 7, 7, 7, 7, 7])
    agent.turn("c3", [12], then=[92])
    agent.turn("c4", [13])
    build = prefix_merging(agent.entries)
    assert build.notes.roots == 2
    assert [chain.call_ids for chain in build.chains] == [("c1", "c2"), ("c3", "c4")]
    assert build.main_chain_id == "c2"
    assert build.branch_chain_ids == ("c4",)


def test_two_different_continuations_of_one_call_are_a_main_chain_and_a_branch() -> None:
    first = make_entry("r", "a", [1], [2], created_at=1.0)
    early = make_entry("r", "b", [1, 2, 3], [4], created_at=3.0)
    late = make_entry("r", "c", [1, 2, 5], [6], created_at=2.0)
    build = prefix_merging([early, first, late])
    assert build.notes.roots == 1
    assert build.notes.chains == 2
    assert build.main_chain_id == "c"
    assert build.branch_chain_ids == ("b",)


def test_the_parent_is_the_longest_prefix_not_the_first_match() -> None:
    entries = [
        make_entry("r", "a", [1], [2]),
        make_entry("r", "b", [1, 2, 3], [4]),
        make_entry("r", "c", [1, 2, 3, 4, 5], [6]),
    ]
    main = prefix_merging(entries).main_chain
    assert main is not None
    assert main.call_ids == ("a", "b", "c")
    assert main.links[2].interstitial_token_ids == (5,)


def test_identical_candidate_parents_quarantine_the_subtree() -> None:
    entries = [
        make_entry("r", "root", [1], [2]),
        make_entry("r", "twin-a", [1, 2, 3], [4]),
        make_entry("r", "twin-b", [1, 2, 3], [4]),
        make_entry("r", "child", [1, 2, 3, 4, 5], [6]),
        make_entry("r", "grandchild", [1, 2, 3, 4, 5, 6, 7], [8]),
    ]
    build = prefix_merging(entries)
    assert build.quarantined_call_ids == ("child", "grandchild", "twin-a", "twin-b")
    assert build.main_chain is not None
    assert build.main_chain.call_ids == ("root",)


def test_calls_without_generated_tokens_are_excluded_and_reported() -> None:
    entries = [
        make_entry("r", "a", [1], [2]),
        make_entry("r", "empty", [1, 2, 3], []),
        make_entry("r", "b", [1, 2, 3, 4], [5]),
    ]
    build = prefix_merging(entries)
    assert build.notes.empty_generation_calls == ("empty",)
    assert build.main_chain is not None
    assert build.main_chain.call_ids == ("a", "b")
    assert build.main_chain.links[1].interstitial_token_ids == (3, 4)


def test_an_exact_duplicate_is_ignored_but_a_conflicting_duplicate_fails_the_build() -> None:
    entry = make_entry("r", "a", [1], [2])
    assert prefix_merging([entry, entry]).notes.chains == 1
    with pytest.raises(TrajectoryBuildError, match="appears twice"):
        prefix_merging([entry, make_entry("r", "a", [1], [3])])


def test_an_empty_snapshot_builds_no_chain() -> None:
    build = prefix_merging([])
    assert build.chains == ()
    assert build.main_chain is None


@st.composite
def agent_rollouts(draw: st.DrawFn) -> list[TokenEntry]:
    agent = AgentRollout("r", draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)))
    for index in range(draw(st.integers(1, 8))):
        action = draw(st.sampled_from(["turn", "retry-then-turn", "compact", "attempt"]))
        generation = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        if action == "compact":
            agent.compact(draw(st.lists(st.integers(0, 5), min_size=1, max_size=6)))
        if action == "attempt":
            agent.attempt(f"c{index}", generation)
            continue
        if action == "retry-then-turn":
            agent.attempt(f"c{index}-retry", draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
        agent.turn(f"c{index}", generation, then=draw(st.lists(st.integers(0, 5), max_size=3)))
    return agent.entries


@settings(max_examples=200, deadline=None)
@given(agent_rollouts(), st.randoms(use_true_random=False))
def test_shuffling_the_entries_never_changes_the_build(entries: list[TokenEntry], rng: random.Random) -> None:
    shuffled = list(entries)
    rng.shuffle(shuffled)
    assert prefix_merging(shuffled) == prefix_merging(entries)
    for chain in prefix_merging(shuffled).chains:
        chain.validate()


def test_a_ten_thousand_call_rollout_builds_deeper_than_the_recursion_limit() -> None:
    turns = 2500
    assert turns > sys.getrecursionlimit()
    agent = AgentRollout("r", [1, 2, 3])
    for turn in range(turns):
        for attempt in range(3):
            agent.attempt(f"t{turn:05d}-retry{attempt}", [200 + attempt])
        agent.turn(f"t{turn:05d}", [100], then=[7])
    assert len(agent.entries) == 10_000
    build = prefix_merging(agent.entries)
    assert build.notes.roots == 1
    assert build.notes.chains == 1
    assert build.main_chain is not None
    assert len(build.main_chain.links) == turns
    assert len(build.notes.discarded_retries) == 3 * turns
    build.main_chain.validate()


def test_per_request_builds_one_chain_per_generating_call() -> None:
    build = per_request([*tool_using_agent().entries, make_entry("r", "empty", [1], [])])
    assert [chain.call_ids for chain in build.chains] == [("c1",), ("c2-retry",), ("c2",), ("c3",)]
    assert build.main_chain is None
    assert build.notes.empty_generation_calls == ("empty",)


def test_run_builder_dispatches_by_name_and_refuses_unknown_names() -> None:
    entries = tool_using_agent().entries
    assert run_builder(entries) == prefix_merging(entries)
    assert run_builder(entries, "per_request") == per_request(entries)
    with pytest.raises(UnknownBuilderError, match="prefix_merging"):
        run_builder(entries, "longest_first")


def test_a_chain_whose_prompt_does_not_extend_its_parent_fails_validation() -> None:
    a = make_entry("r", "a", [1], [2])
    b = make_entry("r", "b", [1, 2, 9, 4], [5])
    Chain("b", (1,), (ChainLink(a), ChainLink(b, (9, 4)))).validate()
    with pytest.raises(ChainValidationError, match="'b'"):
        Chain("b", (1,), (ChainLink(a), ChainLink(b, (8, 4)))).validate()
    with pytest.raises(ChainValidationError, match="root prompt"):
        Chain("a", (7,), (ChainLink(a),)).validate()
    with pytest.raises(ChainValidationError, match="no links"):
        Chain("x", (), ()).validate()


def test_a_chain_mixing_rollouts_fails_validation() -> None:
    a = make_entry("r", "a", [1], [2])
    b = make_entry("other", "b", [1, 2], [3])
    with pytest.raises(ChainValidationError, match="mixes rollouts"):
        Chain("b", (1,), (ChainLink(a), ChainLink(b))).validate()


def test_training_tokens_mask_everything_but_generated_tokens() -> None:
    main = prefix_merging(tool_using_agent().entries).main_chain
    assert main is not None
    tokens = main.training_tokens()
    assert tokens.token_ids == [1, 2, 3, 10, 11, 90, 91, 92, 14, 15, 93, 16]
    assert tokens.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1]
    generated_log_probs = [lp for lp, mask in zip(tokens.log_probs, tokens.loss_mask, strict=True) if mask]
    assert generated_log_probs == [lp for link in main.links for lp in link.entry.generation_log_probs]
