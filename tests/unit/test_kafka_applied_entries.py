"""The materializer's applied entries: only accepted puts, in order, forgotten on removal and past the bound."""

from __future__ import annotations

from store_contract import make_entry

from tokcap.events import DeleteEvent, IntentEvent, PutEvent, RetireEvent
from tokcap.rules import ApplyOutcome, ApplyResult
from transports.kafka.applied_entries import AppliedEntries


def put(rollout_id: str, call_id: str, tokens: int = 4) -> PutEvent:
    return PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, tokens=tokens))


def verdict(event: PutEvent | RetireEvent | DeleteEvent | IntentEvent, outcome: ApplyOutcome) -> ApplyResult:
    return ApplyResult(outcome, event.type, event.rollout_id)


def test_only_puts_the_store_accepted_are_kept_in_the_order_they_were_applied() -> None:
    kept = AppliedEntries()
    first, same_again, conflicting, second = put("r", "c0"), put("r", "c0"), put("r", "c0", 9), put("r", "c1")
    kept.note(first, verdict(first, ApplyOutcome.ACCEPTED))
    kept.note(same_again, verdict(same_again, ApplyOutcome.NOOP))
    kept.note(conflicting, verdict(conflicting, ApplyOutcome.CONFLICT))
    intent = IntentEvent(rollout_id="r", model_call_id="c1")
    kept.note(intent, verdict(intent, ApplyOutcome.ACCEPTED))
    kept.note(second, verdict(second, ApplyOutcome.ACCEPTED))
    assert kept.of("r") == [first.entry, second.entry]
    assert kept.of("other") is None


def test_a_retire_or_delete_forgets_the_rollout_whatever_its_verdict() -> None:
    kept = AppliedEntries()
    for removal in (RetireEvent(rollout_id="r"), DeleteEvent(rollout_id="r")):
        event = put("r", "c0")
        kept.note(event, verdict(event, ApplyOutcome.ACCEPTED))
        kept.note(removal, verdict(removal, ApplyOutcome.NOOP))
        assert kept.of("r") is None
    assert kept.kept_tokens == 0


def test_past_the_token_bound_the_least_recently_grown_rollouts_are_forgotten_first() -> None:
    first_of_a, first_of_b, second_of_a = put("a", "c0", 10), put("b", "c0", 10), put("a", "c1", 10)
    tokens = len(first_of_a.entry.prompt_token_ids) + len(first_of_a.entry.generation_token_ids)
    kept = AppliedEntries(max_tokens=2 * tokens)
    for event in (first_of_a, first_of_b, second_of_a):
        kept.note(event, verdict(event, ApplyOutcome.ACCEPTED))
    # a grew last: b is the least recently grown, and forgetting it brings the total back to the bound.
    assert kept.of("b") is None
    assert kept.of("a") == [first_of_a.entry, second_of_a.entry]
    assert kept.kept_tokens == 2 * tokens
