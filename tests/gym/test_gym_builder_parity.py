"""tokcap's builder, terminal attribution and consumer against Gym 0.7.0's own, on random captured rollouts.

A rollout here is what a Gym writer would have stored: calls that start conversations (the task,
an auxiliary call, a sub-agent), continue a proven parent (tool turns), retry a call (same prompt,
another generation), branch (two continuations of one call), compact (a prompt that does not extend
the call it follows, recorded unresolved, or with a stale parent link), or generate nothing; then some
calls are lost before the freeze, and the snapshot comes in any order. Each rollout is stored full and
with delta records (Gym's rule: a RESOLVED call whose prompt extends its parent's exact tokens keeps
only the suffix). Both builders, attributions and consumers get the same entries and must agree.
"""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass
from typing import Any

import pytest
from gym_wheel import GymModules
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokcap.builder import Chain, run_builder
from tokcap.consumer import trajectories_from_source
from tokcap.protocols import TokenCaptureSnapshot
from tokcap.records import TokenEntry, compute_digest
from tokcap.terminal import resolve_terminal

ROLLOUT = "r-parity"


@dataclass(frozen=True)
class Call:
    call_id: str
    prompt: tuple[int, ...]
    generation: tuple[int, ...]
    resolution: str
    parent: str | None
    created_at: float


@dataclass(frozen=True)
class Capture:
    calls: tuple[Call, ...]
    lost: frozenset[str]
    order: tuple[int, ...]
    # Records delivered twice (at-least-once): (position in the stored order, payload changed, copy first).
    repeats: tuple[tuple[int, bool, bool], ...]
    terminal: str | None
    declared: str | None
    response_of: str | None


@st.composite
def captures(draw: st.DrawFn) -> Capture:
    """A random rollout as a Gym writer records it, with losses, an order, and what the record says."""
    calls: list[Call] = []
    sequences: dict[str, tuple[int, ...]] = {}
    fresh = iter(range(1000, 100_000))

    def tokens(low: int, high: int) -> tuple[int, ...]:
        return tuple(next(fresh) for _ in range(draw(st.integers(low, high))))

    for index in range(draw(st.integers(1, 9))):
        call_id = f"c{index:02d}"
        kinds = ["root"] if not calls else ["root", "continue", "continue", "continue", "retry", "compact"]
        kind = draw(st.sampled_from(kinds))
        parent: str | None = None
        resolution = "root"
        if kind == "root":
            prompt = tokens(1, 3)
        elif kind == "continue":
            parent = draw(st.sampled_from([call.call_id for call in calls]))
            prompt = sequences[parent] + tokens(0, 2)
            resolution = "resolved"
        elif kind == "retry":
            twin = draw(st.sampled_from(calls))
            prompt, parent, resolution = twin.prompt, twin.parent, twin.resolution
        else:
            follows = draw(st.sampled_from([call.call_id for call in calls]))
            prompt = tokens(1, 3) + sequences[follows][-1:]
            resolution, parent = draw(st.sampled_from([("unresolved", None), ("resolved", follows)]))
        generation = tokens(0, 3) if draw(st.integers(0, 5)) == 0 else tokens(1, 3)
        created_at = float(draw(st.integers(0, 4)))
        calls.append(Call(call_id, prompt, generation, resolution, parent, created_at))
        sequences[call_id] = prompt + generation
    ids = [call.call_id for call in calls]
    lost = frozenset(draw(st.sets(st.sampled_from(ids), max_size=2)))
    order = tuple(draw(st.permutations(range(len(calls)))))
    maybe_id = st.one_of(st.none(), st.sampled_from(ids), st.just("c-never"))
    return Capture(
        calls=tuple(calls),
        lost=lost,
        order=order,
        repeats=tuple(
            draw(
                st.lists(st.tuples(st.integers(0, len(calls) - 1), st.booleans(), st.booleans()), max_size=2)
            )
        ),
        terminal=draw(maybe_id),
        declared=draw(st.one_of(st.none(), st.none(), maybe_id)),
        response_of=draw(maybe_id),
    )


_TOOL_USE_WITH_A_LOST_MIDDLE_CALL = Capture(
    calls=(
        Call("c00", (1, 2), (3,), "root", None, 0.0),
        Call("c01", (1, 2, 3, 4), (5, 6), "resolved", "c00", 1.0),
        Call("c02", (1, 2, 3, 4, 5, 6, 7), (8,), "resolved", "c01", 2.0),
        Call("c03", (1, 2, 3, 4, 5, 6, 7, 8, 9), (10,), "resolved", "c02", 3.0),
    ),
    lost=frozenset({"c01"}),
    order=(3, 1, 0, 2),
    repeats=(),
    terminal="c03",
    declared=None,
    response_of="c03",
)
"""A lost middle call: full records recover through the grandparent, delta records cannot be rebuilt."""


def _output_item(call: Call) -> dict[str, Any]:
    text = "answer " + " ".join(str(token) for token in call.generation)
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def _records(capture: Capture, delta_records: bool) -> list[dict[str, Any]]:
    """The stored records: lineage stamped, suffixes where Gym's writer would cut them, losses removed."""
    sequences = {call.call_id: call.prompt + call.generation for call in capture.calls}
    records: list[dict[str, Any]] = []
    for position in capture.order:
        call = capture.calls[position]
        if call.call_id in capture.lost:
            continue
        full = list(call.prompt + call.generation)
        prompt = list(call.prompt)
        delta = False
        if delta_records and call.resolution == "resolved" and call.parent is not None:
            parent = list(sequences[call.parent])
            if parent and prompt[: len(parent)] == parent:
                prompt, delta = prompt[len(parent) :], True
        records.append(
            {
                "rollout_id": ROLLOUT,
                "model_call_id": call.call_id,
                "model": "policy",
                "prompt_token_ids": prompt,
                "generation_token_ids": list(call.generation),
                "generation_log_probs": [-(token % 13 + 1) / 16 for token in call.generation],
                "output_items": [_output_item(call)],
                "token_item_index": 0,
                "response_id": f"resp-{call.call_id}",
                "created_at": call.created_at,
                "parent_call_id": call.parent,
                "parent_resolution": call.resolution,
                "cum_len": len(full),
                "digest": compute_digest(full),
                "prompt_is_delta": delta,
            }
        )
    for position, changed, first in capture.repeats:
        if position >= len(records):
            continue
        copy = dict(records[position])
        if changed:
            generation = [*copy["generation_token_ids"], 7]
            rebuilt = next(call for call in capture.calls if call.call_id == copy["model_call_id"])
            copy.update(
                generation_token_ids=generation,
                generation_log_probs=[*copy["generation_log_probs"], -1.0],
                cum_len=len(rebuilt.prompt) + len(generation),
                digest=compute_digest([*rebuilt.prompt, *generation]),
            )
        records.insert(0 if first else len(records), copy)
    return records


def _training(
    chain: Any, root_prompt: list[int], interstitial: Any
) -> tuple[list[int], list[int], list[float]]:
    tokens: list[int] = []
    mask: list[int] = []
    log_probs: list[float] = []
    for step, link in enumerate(chain.links):
        context = list(root_prompt) if step == 0 else list(interstitial(link))
        tokens += context + list(link.entry.generation_token_ids)
        mask += [0] * len(context) + [1] * len(link.entry.generation_token_ids)
        log_probs += [0.0] * len(context) + list(link.entry.generation_log_probs)
    return tokens, mask, log_probs


def _ours(chain: Chain) -> tuple[tuple[str, ...], tuple[list[int], list[int], list[float]]]:
    tokens = chain.training_tokens()
    return chain.call_ids, (tokens.token_ids, tokens.loss_mask, tokens.log_probs)


def _theirs(chain: Any) -> tuple[tuple[str, ...], tuple[list[int], list[int], list[float]]]:
    ids = tuple(link.entry.model_call_id for link in chain.links)
    return ids, _training(chain, chain.root_prompt, lambda link: link.interstitial)


def _gym_main(out: Any) -> Any:
    mains = [chain for chain in out.chains if chain.chain_id == "main"]
    return mains[0] if mains else None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capture=captures())
@example(capture=_TOOL_USE_WITH_A_LOST_MIDDLE_CALL)
@pytest.mark.parametrize("delta_records", [False, True], ids=["full-records", "delta-records"])
def test_tokcaps_builder_gives_gyms_chains_tokens_and_notes_on_any_capture(
    gym: GymModules, capture: Capture, delta_records: bool
) -> None:
    records = _records(capture, delta_records)
    ours = run_builder(
        [TokenEntry.model_validate(record) for record in records], terminal_call_id=capture.terminal
    )
    theirs = gym.builder.run_builder(
        [gym.records.TokenEntry.model_validate(record) for record in records],
        terminal_call_id=capture.terminal,
    )
    gym_main = _gym_main(theirs)
    assert (ours.main_chain is None) == (gym_main is None)
    if ours.main_chain is not None:
        assert _ours(ours.main_chain) == _theirs(gym_main)
    assert sorted(_ours(chain) for chain in ours.chains) == sorted(_theirs(chain) for chain in theirs.chains)
    notes, gym_notes = ours.notes, theirs.notes
    assert notes.terminal_chain == gym_notes.terminal_chain
    assert (notes.roots, notes.chains) == (gym_notes.roots, gym_notes.chains)
    assert [call for group in notes.unresolved_retries for call in group] == gym_notes.unresolved_retries
    assert list(notes.unresolved_parent_calls) == gym_notes.unresolved_parent_calls
    assert dict(notes.parent_link_failures) == gym_notes.parent_link_failures
    assert sorted(ours.quarantined_call_ids) == sorted(theirs.quarantined)
    assert list(notes.empty_generation_calls) == gym_notes.empty_generation_calls
    assert (notes.generated_tokens_captured, notes.generated_tokens_delivered) == (
        gym_notes.generated_tokens_captured,
        gym_notes.generated_tokens_delivered,
    )


def _verified(capture: Capture) -> dict[str, Any] | None:
    """The scored response: one call's served id and output, a response no call served, or none."""
    if capture.response_of is None:
        return None
    named = next((call for call in capture.calls if call.call_id == capture.response_of), None)
    if named is None:
        return {"id": "resp-never", "output": [{"type": "message", "role": "assistant", "content": "never"}]}
    return {"id": f"resp-{named.call_id}", "output": [_output_item(named)]}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capture=captures())
def test_tokcaps_terminal_attribution_names_the_call_gyms_names_for_the_same_reasons(
    gym: GymModules, capture: Capture
) -> None:
    records = _records(capture, True)
    verified = _verified(capture)
    ours = resolve_terminal(
        [TokenEntry.model_validate(record) for record in records],
        verified,
        capture.terminal,
        declared_response_id=f"resp-{capture.declared}" if capture.declared else None,
    )
    theirs = gym.terminal.resolve_terminal(
        [gym.records.TokenEntry.model_validate(record) for record in records],
        verified,
        capture.terminal,
        declared_response_id=f"resp-{capture.declared}" if capture.declared else None,
    )
    assert (ours.model_call_id, ours.method, ours.reason) == (
        theirs.model_call_id,
        theirs.method,
        theirs.reason,
    )


class _Frozen:
    """A source that hands out one fixed snapshot (Gym's consumer reads the same attributes)."""

    def __init__(self, snapshot: Any) -> None:
        self.snapshot = snapshot

    async def freeze(self, rollout_id: str) -> Any:
        return self.snapshot


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capture=captures())
@pytest.mark.parametrize("delta_records", [False, True], ids=["full-records", "delta-records"])
def test_tokcaps_consumer_masks_and_delivers_what_gyms_consumer_does(
    gym: GymModules, capture: Capture, delta_records: bool
) -> None:
    records = _records(capture, delta_records)
    if not records:
        return
    verified = _verified(capture)
    declared = f"resp-{capture.declared}" if capture.declared else None
    ours_snapshot = TokenCaptureSnapshot(
        ROLLOUT, tuple(TokenEntry.model_validate(record) for record in records), False, "s", 1
    )
    gym_snapshot = types.SimpleNamespace(
        rollout_id=ROLLOUT,
        entries=[gym.records.TokenEntry.model_validate(record) for record in records],
        incomplete=False,
        snapshot_id="s",
        version=1,
    )

    async def both() -> tuple[Any, dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "verified_response": verified,
            "explicit_terminal_call_id": capture.terminal,
            "declared_response_id": declared,
        }
        ours = await trajectories_from_source(ROLLOUT, _Frozen(ours_snapshot), model="policy", **kwargs)  # type: ignore[arg-type]
        theirs = await gym.consumer.trajectories_from_source(
            ROLLOUT, _Frozen(gym_snapshot), model="policy", **kwargs
        )
        return ours, theirs

    ours, theirs = asyncio.run(both())
    assert ours.masked == theirs["mask_sample"], (ours.mask_reasons, theirs.get("metrics"))
    if not ours.masked:
        assert ours.response is not None
        assert ours.response["output"] == theirs["rebuilt_response"]["output"]
    attribution = ours.metrics["terminal_attribution"]
    gym_attribution = theirs["metrics"].get("terminal_attribution")
    if gym_attribution is not None:
        assert (attribution["call_id"], attribution["method"], attribution["chain"]) == (
            gym_attribution["call_id"],
            gym_attribution["method"],
            gym_attribution["chain"],
        )
