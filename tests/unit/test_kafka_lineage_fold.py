"""How the Kafka lineage resolver folds a rollout's log, without a broker: events are handed to it directly."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from delta_chains import DeltaChain, delta_chain
from kafka_topic_double import MemoryTopic

import transports.kafka.lineage.rollout_logs as rollout_logs
from tokcap.errors import EventDecodeError, LineageLookupError
from tokcap.lineage import stamp_continuation
from tokcap.log.events import (
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    PutEvent,
    RetireEvent,
    encode_event,
)
from tokcap.log.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.lineage.shared_question import SharedQuestion
from transports.kafka.wire.codec import (
    HEADER_ENCODING,
    HEADER_TYPE,
    ParentLink,
    encode_delta_message,
    encode_event_messages,
    encode_event_value,
    headers_to_dict,
)

REQUEST = [{"role": "user", "content": "hi"}]


def _next_request(text: str) -> list[dict[str, Any]]:
    return [*REQUEST, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]


def _put(call_id: str, text: str, prompt: list[int], log_prob: float = -0.5) -> PutEvent:
    entry = TokenEntry(
        rollout_id="r",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=[7, 8],
        generation_log_probs=[log_prob, -0.25],
        output_items=[{"role": "assistant", "content": text}],
    )
    stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    stamp_continuation(entry, REQUEST)
    return PutEvent(rollout_id="r", entry=entry)


@pytest.fixture
def resolver() -> Iterator[KafkaLineageResolver]:
    # No broker is contacted: the consumer connects only when used, and events are folded by hand.
    made = KafkaLineageResolver(bootstrap_servers="127.0.0.1:9", topic="fold")
    yield made
    asyncio.run(made.close())


def _feed(resolver: KafkaLineageResolver, *events: Event) -> None:
    for event in events:
        encoding, value = encode_event_value(event)
        resolver._logs.fold(
            event.rollout_id, value, {HEADER_TYPE: event.type.value, HEADER_ENCODING: encoding}
        )


def _status(resolver: KafkaLineageResolver, text: str) -> tuple[str, str | None]:
    resolution = resolver._answer("r", _next_request(text))
    return str(resolution.status.value), resolution.match.model_call_id if resolution.match else None


def test_a_put_read_from_the_log_resolves_with_its_cumulative_tokens(resolver: KafkaLineageResolver) -> None:
    _feed(resolver, _put("c1", "one", [1, 2]))
    resolution = resolver._answer("r", _next_request("one"))
    assert resolution.match is not None
    assert (resolution.match.model_call_id, resolution.match.cumulative_token_ids) == ("c1", (1, 2, 7, 8))


def test_a_put_after_the_freeze_is_not_a_candidate(resolver: KafkaLineageResolver) -> None:
    _feed(resolver, FreezeEvent(rollout_id="r"), _put("c1", "one", [1]))
    assert _status(resolver, "one") == ("unresolved", None)


def test_a_retire_forgets_the_calls_and_a_delete_starts_the_rollout_afresh(
    resolver: KafkaLineageResolver,
) -> None:
    _feed(resolver, _put("c1", "one", [1]), RetireEvent(rollout_id="r"), _put("c2", "two", [1]))
    assert _status(resolver, "one") == ("unresolved", None)
    assert _status(resolver, "two") == ("unresolved", None)
    _feed(resolver, DeleteEvent(rollout_id="r"), _put("c3", "three", [1]))
    assert _status(resolver, "three") == ("resolved", "c3")


def test_one_call_id_put_twice_with_different_tokens_is_no_candidate(resolver: KafkaLineageResolver) -> None:
    _feed(resolver, _put("c1", "one", [1]), _put("c1", "one", [2]))
    assert _status(resolver, "one") == ("unresolved", None)


def test_one_call_id_put_twice_with_different_log_probs_only_is_no_candidate(
    resolver: KafkaLineageResolver,
) -> None:
    # The heads are equal (same tokens, so the same digest); only the packed arrays differ.
    _feed(resolver, _put("c1", "one", [1]), _put("c1", "one", [1], log_prob=-0.75))
    assert _status(resolver, "one") == ("unresolved", None)


def test_the_same_put_read_twice_is_one_candidate(resolver: KafkaLineageResolver) -> None:
    _feed(resolver, _put("c1", "one", [1]), _put("c1", "one", [1]))
    assert _status(resolver, "one") == ("resolved", "c1")


def test_only_the_proven_parents_token_arrays_are_decoded(
    resolver: KafkaLineageResolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    _feed(resolver, *(_put(f"c{n}", f"text {n}", [n]) for n in range(20)))
    decoded: list[str] = []
    real = rollout_logs.decode_event_value

    def counting(value: bytes, headers: dict[str, str]) -> Event:
        event = real(value, headers)
        decoded.append(event.entry.model_call_id if isinstance(event, PutEvent) else "")
        return event

    monkeypatch.setattr(rollout_logs, "decode_event_value", counting)
    assert _status(resolver, "text 7") == ("resolved", "c7")
    assert decoded == ["c7"]


def _until(condition: Any) -> None:
    """Wait for an observable state (never for time to pass), failing after 30 s."""
    done = threading.Event()
    for _ in range(30_000):
        if condition():
            return
        done.wait(0.001)
    raise AssertionError("the expected state was never reached")


def test_a_caller_arriving_while_a_question_is_in_flight_gets_the_answer_of_a_later_question() -> None:
    shared = SharedQuestion()
    release_first = threading.Event()
    asked: list[frozenset[int]] = []

    def question(partitions: frozenset[int]) -> dict[int, int]:
        asked.append(partitions)
        if len(asked) == 1:
            release_first.wait(30)
        return dict.fromkeys(partitions, len(asked))

    answers: dict[str, int] = {}
    first = threading.Thread(target=lambda: answers.update(first=shared.ask(0, question)))
    first.start()
    _until(lambda: asked)  # the first question is in flight
    second = threading.Thread(target=lambda: answers.update(second=shared.ask(0, question)))
    second.start()
    _until(lambda: shared._condition._waiters)  # the second caller waits
    release_first.set()
    first.join(30)
    second.join(30)
    assert answers == {"first": 1, "second": 2}


def test_callers_on_different_partitions_arriving_during_a_question_share_the_next_one() -> None:
    shared = SharedQuestion()
    release_first = threading.Event()
    asked: list[frozenset[int]] = []

    def question(partitions: frozenset[int]) -> dict[int, int]:
        asked.append(partitions)
        if len(asked) == 1:
            release_first.wait(30)
        return {partition: 10 * partition + len(asked) for partition in partitions}

    answers: dict[int, int] = {}
    first = threading.Thread(target=lambda: answers.update({0: shared.ask(0, question)}))
    first.start()
    _until(lambda: asked)  # the first question is in flight
    later = [
        threading.Thread(target=lambda p=p: answers.update({p: shared.ask(p, question)})) for p in (1, 2)
    ]
    for thread in later:
        thread.start()
    _until(lambda: len(shared._condition._waiters) == 2)  # both later callers wait
    release_first.set()
    for thread in (first, *later):
        thread.join(30)
    assert asked == [frozenset({0}), frozenset({1, 2})]
    assert answers == {0: 1, 1: 12, 2: 22}


def test_a_failed_question_fails_every_caller_it_answers() -> None:
    shared = SharedQuestion()

    def question(partitions: frozenset[int]) -> dict[int, int]:
        raise OSError("broker gone")

    with pytest.raises(OSError, match="broker gone"):
        shared.ask(0, question)


def test_a_put_sent_as_a_wire_delta_resolves_with_its_restored_cumulative_tokens(
    resolver: KafkaLineageResolver,
) -> None:
    first = _put("c1", "one", list(range(100)))
    second_entry = TokenEntry(
        rollout_id="r",
        model_call_id="c2",
        prompt_token_ids=[*range(100), 7, 8, 500, 501],
        generation_token_ids=[9],
        generation_log_probs=[-0.5],
        output_items=[{"role": "assistant", "content": "two"}],
    )
    stamp_lineage(second_entry, "c1", parent_resolution=ParentResolutionStatus.RESOLVED)
    stamp_continuation(second_entry, _next_request("one"))
    second = PutEvent(rollout_id="r", entry=second_entry)
    encoding, value = encode_event_value(first)
    resolver._logs.fold("r", value, {HEADER_TYPE: "put", HEADER_ENCODING: encoding}, 0, 0)
    link = ParentLink(0, 0, "c1", 102)
    delta = encode_delta_message(second, link)
    resolver._logs.fold("r", delta.value, headers_to_dict(delta.headers), 0, 1)
    request = [
        *_next_request("one"),
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "go"},
    ]
    resolution = resolver._answer("r", request)
    assert resolution.match is not None
    assert resolution.match.model_call_id == "c2"
    assert resolution.match.cumulative_token_ids == (*range(100), 7, 8, 500, 501, 9)


def _crafted(encoding: str, **fields: Any) -> tuple[bytes, dict[str, str]]:
    """A put of call c1 (text "one") with ``fields`` changed, as a hand-made message would carry it."""
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c1",
        prompt_token_ids=[1, 2],
        generation_token_ids=[7, 8],
        generation_log_probs=[-0.5, -0.25],
        output_items=[{"role": "assistant", "content": "one"}],
    )
    stamp_continuation(entry, REQUEST)
    event = PutEvent(rollout_id="r", entry=entry.model_copy(update=fields))
    if encoding == "packed":
        value = encode_event_value(event)[1]
    else:
        raw = orjson.loads(encode_event(event))
        raw["entry"].update(fields)
        value = orjson.dumps(raw)
    return value, {HEADER_TYPE: "put", HEADER_ENCODING: encoding}


@pytest.mark.parametrize(
    ("encoding", "fields"),
    [
        ("packed", {"prompt_token_ids": [5, -7, 9]}),
        ("json", {"prompt_token_ids": [5, -7, 9]}),
        ("json", {"generation_token_ids": [True, 8]}),
        ("packed", {"model_call_id": "a\nb"}),
        ("packed", {"model_call_id": "z" * 5000}),
    ],
)
def test_a_put_the_sinks_input_rules_refuse_is_never_a_candidate_parent(
    resolver: KafkaLineageResolver, encoding: str, fields: dict[str, Any]
) -> None:
    value, headers = _crafted(encoding, **fields)
    # ``_take`` folds every message this way and passes over the ones that fail.
    with pytest.raises(EventDecodeError, match="input rules"):
        resolver._logs.fold("r", value, headers)
    assert _status(resolver, "one") == ("unresolved", None)
    resolver._logs.fold("r", *_crafted(encoding))
    assert _status(resolver, "one") == ("resolved", "c1")


def test_a_put_whose_arrays_fail_the_input_rules_once_decoded_never_resolves_a_request(
    resolver: KafkaLineageResolver,
) -> None:
    value, headers = _crafted("packed")
    nan_log_prob = value.replace(struct.pack("<d", -0.25), struct.pack("<d", float("nan")))
    assert nan_log_prob != value
    resolver._logs.fold("r", nan_log_prob, headers)
    # The lookup fails, which the capture path records as an unresolved parent; it never resolves to it.
    with pytest.raises(LineageLookupError, match="cannot be decoded"):
        resolver._answer("r", _next_request("one"))


def _feed_chain(resolver: KafkaLineageResolver, chain: DeltaChain, calls: range) -> None:
    _feed(resolver, *(PutEvent(rollout_id="r", entry=chain.entries[call]) for call in calls))


def _assert_chain_resolves(resolver: KafkaLineageResolver, chain: DeltaChain, call: int) -> None:
    resolution = resolver._answer("r", chain.requests[call + 1])
    assert resolution.match is not None, resolution
    assert resolution.match.model_call_id == f"call-{call}"
    assert resolution.match.cumulative_token_ids == chain.cumulative[call]


def test_each_resolve_of_a_growing_delta_chain_answers_the_whole_cumulative_tokens(
    resolver: KafkaLineageResolver,
) -> None:
    chain = delta_chain("r", 5)
    for call in range(5):
        _feed_chain(resolver, chain, range(call, call + 1))
        _assert_chain_resolves(resolver, chain, call)
    _assert_chain_resolves(resolver, chain, 1)


def test_a_deleted_rollout_written_again_resolves_to_its_new_tokens_not_the_kept_parent(
    resolver: KafkaLineageResolver,
) -> None:
    old, new = delta_chain("r", 3), delta_chain("r", 3, base=1000)
    _feed_chain(resolver, old, range(3))
    _assert_chain_resolves(resolver, old, 2)
    _feed(resolver, DeleteEvent(rollout_id="r"))
    _feed_chain(resolver, new, range(3))
    _assert_chain_resolves(resolver, new, 2)


def test_a_retired_rollout_resolves_nothing_after_its_parent_was_kept(resolver: KafkaLineageResolver) -> None:
    chain = delta_chain("r", 3)
    _feed_chain(resolver, chain, range(3))
    _assert_chain_resolves(resolver, chain, 2)
    _feed(resolver, RetireEvent(rollout_id="r"))
    assert resolver._answer("r", chain.requests[3]).status == ParentResolutionStatus.UNRESOLVED


def _taken(resolver: KafkaLineageResolver, topic: MemoryTopic) -> None:
    """Hand the resolver every message of the topic as its consumer would."""
    with resolver._lock:
        for message in topic.messages():
            resolver._reader._take(message)  # type: ignore[arg-type]


def test_a_put_too_large_for_one_message_is_reassembled_by_the_router_and_resolves_exactly(
    resolver: KafkaLineageResolver,
) -> None:
    topic = MemoryTopic("fold")
    prompt = list(range(300_000))
    assert len(topic.publish(_put("c1", "one", prompt))) > 1
    _taken(resolver, topic)
    resolution = resolver._answer("r", _next_request("one"))
    assert resolution.match is not None
    assert resolution.match.cumulative_token_ids == (*prompt, 7, 8)
    assert resolver._logs._chunk_router.open_chunk_bytes(0) == 0


def test_a_chunk_group_declaring_more_than_the_event_limit_is_not_buffered_by_the_resolver(
    resolver: KafkaLineageResolver,
) -> None:
    topic = MemoryTopic("fold")
    headers = [("tokcap.type", b"put"), ("tokcap.schema_version", b"1"), ("tokcap.encoding", b"packed")]
    for index in range(3):
        chunk = [
            ("tokcap.chunk.group", b"crafted:0"),
            ("tokcap.chunk.index", str(index).encode()),
            ("tokcap.chunk.count", b"300"),
            ("tokcap.chunk.sha256", b"0" * 64),
        ]
        topic.produce(b"r", b"\x00" * 900_000, [*headers, *chunk])
    _taken(resolver, topic)
    assert resolver._logs._chunk_router.open_chunk_bytes(0) == 0
    assert resolver._logs._chunk_router.open_groups() == []


def test_the_chunks_of_a_large_stage_are_counted_but_never_kept_by_the_resolver(
    resolver: KafkaLineageResolver,
) -> None:
    topic = MemoryTopic("fold")
    messages = encode_event_messages(_put("c1", "one", list(range(300_000))), next_chunk_group=lambda: "s:0")
    for message in messages[:-1]:
        topic.produce(
            message.key, message.value, [(n, b"stage" if n == HEADER_TYPE else v) for n, v in message.headers]
        )
    _taken(resolver, topic)
    router = resolver._logs._chunk_router
    assert router.open_chunk_bytes(0) == sum(len(m.value) for m in messages[:-1])
    assert router.open_groups() == []
    assert all(piece == b"" for group in router._chunks._groups[0].values() for piece in group.pieces)


def _feed_at(resolver: KafkaLineageResolver, *events: Event, first_offset: int = 0) -> None:
    """Fold events as the messages at consecutive offsets of partition 0, as the consumer hands them over."""
    for offset, event in enumerate(events, start=first_offset):
        encoding, value = encode_event_value(event)
        headers = {HEADER_TYPE: event.type.value, HEADER_ENCODING: encoding}
        resolver._logs.fold(event.rollout_id, value, headers, 0, offset)


def test_a_drop_of_a_stale_version_does_not_make_the_resolver_forget_the_rollouts_calls(
    resolver: KafkaLineageResolver,
) -> None:
    # put (version 1), freeze at offset 1 (version 2, snapshot fold:0:1), a late marker (version 3): a drop of
    # version 2 is stale, so the rules keep the rollout, and so must the resolver.
    late_marker = IncompleteEvent(rollout_id="r", reason="late")
    _feed_at(resolver, _put("c1", "one", [1]), FreezeEvent(rollout_id="r"), late_marker)
    _feed_at(resolver, DropEvent(rollout_id="r", snapshot_id="fold:0:1", version=2), first_offset=3)
    assert _status(resolver, "one") == ("resolved", "c1")


@pytest.mark.parametrize(
    "command",
    [
        DropEvent(rollout_id="r", snapshot_id="fold:0:1", version=2),
        RetireEvent(rollout_id="r"),
        DeleteEvent(rollout_id="r"),
    ],
    ids=["drop-of-the-frozen-version", "retire", "delete"],
)
def test_a_drop_of_the_frozen_version_a_retire_and_a_delete_make_the_resolver_forget_the_calls(
    resolver: KafkaLineageResolver, command: Event
) -> None:
    _feed_at(resolver, _put("c1", "one", [1]), FreezeEvent(rollout_id="r"), command)
    assert _status(resolver, "one") == ("unresolved", None)


def test_a_drop_after_a_put_the_rules_refuse_as_late_is_judged_at_the_version_that_put_moved(
    resolver: KafkaLineageResolver,
) -> None:
    # A put after the freeze is refused but moves the version (2 -> 3), as the materializer counts it.
    _feed_at(resolver, _put("c1", "one", [1]), FreezeEvent(rollout_id="r"), _put("c2", "two", [1]))
    _feed_at(resolver, DropEvent(rollout_id="r", snapshot_id="fold:0:1", version=2), first_offset=3)
    assert _status(resolver, "one") == ("resolved", "c1")
    _feed_at(resolver, DropEvent(rollout_id="r", snapshot_id="fold:0:1", version=3), first_offset=4)
    assert _status(resolver, "one") == ("unresolved", None)


def test_the_same_put_read_whole_and_again_as_a_wire_delta_is_one_candidate(
    resolver: KafkaLineageResolver,
) -> None:
    # A resend of the same call as a wire delta is a no-op for the rules (one payload digest), so the resolver
    # must not take it for a second payload under the call id.
    first = _put("c1", "one", list(range(100)))
    second_entry = TokenEntry(
        rollout_id="r",
        model_call_id="c2",
        prompt_token_ids=[*range(100), 7, 8, 500],
        generation_token_ids=[9],
        generation_log_probs=[-0.5],
        output_items=[{"role": "assistant", "content": "two"}],
    )
    stamp_lineage(second_entry, "c1", parent_resolution=ParentResolutionStatus.RESOLVED)
    stamp_continuation(second_entry, _next_request("one"))
    second = PutEvent(rollout_id="r", entry=second_entry)
    _feed_at(resolver, first, second)
    delta = encode_delta_message(second, ParentLink(0, 0, "c1", 102))
    resolver._logs.fold("r", delta.value, headers_to_dict(delta.headers), 0, 2)
    request = [
        *_next_request("one"),
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "go"},
    ]
    resolution = resolver._answer("r", request)
    assert resolution.match is not None
    assert resolution.match.model_call_id == "c2"
