"""Deferred decoding: the materializer's router settles a capture message only when its rollout needs it.

Whatever order the rollouts are settled in, every message ends as the decision routing it at once gives, so
the store, the answers ahead and the timeline cannot disagree. Commands, chunks and keys naming no rollout
are never deferred.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_topic_double import MemoryTopic, StoredMessage, materialize
from store_contract import make_entry
from wire_delta_fixtures import conversation, memory_sink, store_files

from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import DeleteEvent, Event, FreezeEvent, IntentEvent, PutEvent
from tokcap.log.records import TokenEntry
from transports.kafka.timeline import LogApplier
from transports.kafka.wire.codec import HEADER_TYPE, LogMessage, encode_event_messages
from transports.kafka.wire.router import ApplyEvent, DeadLetter, Deferred, InboundRouter, Routed

TOPIC = "tokcap.deferred-routing-test"


def log_message(message: StoredMessage) -> LogMessage:
    return message.as_log_message()


def one_message(event: object) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    (message,) = encode_event_messages(event, next_chunk_group=lambda: "unused")  # type: ignore[arg-type]
    return message.key, message.value, list(message.headers)


def with_type_header(headers: list[tuple[str, bytes]], kind: str) -> list[tuple[str, bytes]]:
    return [(name, kind.encode() if name == HEADER_TYPE else value) for name, value in headers]


def mixed_topic(tmp_path: Path) -> MemoryTopic:
    """Wire deltas of three rollouts, then chunks, freezes, a broken put, a lying header and a bad key."""
    topic = MemoryTopic(TOPIC)

    async def capture() -> None:
        sink, _ = memory_sink(topic, tmp_path / "spill")
        try:
            entries: list[list[TokenEntry]] = [conversation(f"r{index}", 4) for index in range(3)]
            for turn in range(4):
                for rollout in entries:
                    await sink.begin_call(rollout[turn].rollout_id, rollout[turn].model_call_id)
                    await sink.put(rollout[turn])
        finally:
            await sink.close()

    asyncio.run(capture())
    big = PutEvent(rollout_id="r1", entry=make_entry("r1", "big", tokens=1200))
    for message in encode_event_messages(big, chunk_bytes=2048, next_chunk_group=lambda: "w:0"):
        topic.produce(message.key, message.value, message.headers)
    topic.publish(FreezeEvent(rollout_id="r0"))
    key, _, headers = one_message(PutEvent(rollout_id="r2", entry=make_entry("r2", "broken")))
    topic.produce(key, b"not an event", headers)
    key, value, headers = one_message(FreezeEvent(rollout_id="r2"))
    topic.produce(key, value, with_type_header(headers, "put"))
    _, value, headers = one_message(IntentEvent(rollout_id="r1", model_call_id="stray"))
    topic.produce(b"not a valid/rollout id", value, headers)
    topic.publish(FreezeEvent(rollout_id="r1"))
    topic.publish(FreezeEvent(rollout_id="r2"))
    return topic


def routed_at_once(topic: MemoryTopic) -> list[list[Routed]]:
    router = InboundRouter()
    return [router.route(log_message(message)) for message in topic.messages()]


@pytest.fixture(scope="module")
def topic(tmp_path_factory: pytest.TempPathFactory) -> MemoryTopic:
    return mixed_topic(tmp_path_factory.mktemp("deferred"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deferred_messages_settle_to_what_routing_at_once_decides_in_any_order_of_rollouts(
    topic: MemoryTopic, data: st.DataObject
) -> None:
    expected = routed_at_once(topic)
    router = InboundRouter()
    decided: list[list[Routed | Deferred]] = []
    for message in topic.messages():
        decided.append(router.route_deferring(log_message(message)))
        # Now and then settle some rollout's deferred messages early, as an answer ahead does.
        waiting = [d for row in decided for d in row if isinstance(d, Deferred) and d.decided is None]
        if waiting and data.draw(st.booleans()):
            router.settle(data.draw(st.sampled_from(waiting)))
    settled = [[router.settle(d) if isinstance(d, Deferred) else d for d in row] for row in decided]
    assert settled == expected
    assert router.unsettled() == 0


def test_only_whole_capture_messages_of_a_valid_rollout_key_are_deferred(topic: MemoryTopic) -> None:
    router = InboundRouter()
    deferred_kinds = set()
    for message in topic.messages():
        for decision in router.route_deferring(log_message(message)):
            if isinstance(decision, Deferred):
                deferred_kinds.add(dict(message.headers_)[HEADER_TYPE].decode())
                assert decision.rollout_id == message.key_.decode() if message.key_ else False
            elif isinstance(decision, ApplyEvent):
                assert isinstance(decision.event, FreezeEvent) or decision.headers.get("tokcap.chunk.group")
    assert deferred_kinds == {"intent", "put"}


def test_settling_one_message_decodes_its_rollouts_earlier_ones_and_no_other_rollouts(
    topic: MemoryTopic,
) -> None:
    router = InboundRouter()
    decided = [d for message in topic.messages()[:24] for d in router.route_deferring(log_message(message))]
    r1 = [d for d in decided if isinstance(d, Deferred) and d.rollout_id == "r1"]
    router.settle(r1[2])
    assert [d.decided is not None for d in r1] == [True, True, True] + [False] * (len(r1) - 3)
    others = [d for d in decided if isinstance(d, Deferred) and d.rollout_id != "r1"]
    assert others and all(d.decided is None for d in others)


def test_an_event_whose_type_header_names_another_type_is_dead_lettered(topic: MemoryTopic) -> None:
    lying = [
        row
        for row in routed_at_once(topic)
        if any(isinstance(d, DeadLetter) and "type header 'put'" in d.reason for d in row)
    ]
    assert len(lying) == 1
    (dead,) = lying[0]
    assert isinstance(dead, DeadLetter) and dead.rollout_id == "r2" and dead.mask is not None


def test_the_materializer_deferring_decodes_ends_with_the_files_the_timeline_builds(
    topic: MemoryTopic, tmp_path: Path
) -> None:
    materialize(topic, tmp_path / "materialized")
    applier = LogApplier(TokenCaptureStore(tmp_path / "timeline"), TOPIC)
    for message in topic.messages():
        applier.take_all(log_message(message))
    assert store_files(tmp_path / "materialized") == store_files(tmp_path / "timeline")


_CAPTURE_MESSAGES = 24


def _route_capture_deferring(topic: MemoryTopic) -> tuple[InboundRouter, list[Deferred]]:
    """A router that has deferred the topic's first capture messages, and rollout r2's deferred ones."""
    router = InboundRouter()
    messages = topic.messages()[:_CAPTURE_MESSAGES]
    decided = [d for message in messages for d in router.route_deferring(log_message(message))]
    return router, [d for d in decided if isinstance(d, Deferred) and d.rollout_id == "r2"]


def _route_after_capture(router: InboundRouter, event: Event) -> list[Routed | Deferred]:
    """Route one command as the message after the capture, as a producer would have written it."""
    key, value, headers = one_message(event)
    return router.route_deferring(LogMessage(0, _CAPTURE_MESSAGES, None, key, tuple(headers), value))


def test_a_message_decoded_at_once_first_settles_its_rollouts_deferred_ones_in_order(
    topic: MemoryTopic,
) -> None:
    """A delete forgets its rollout's parents: decoded before the deferred deltas, they would lose them."""
    router, r2 = _route_capture_deferring(topic)
    router.settle(r2[1])
    (delete,) = _route_after_capture(router, DeleteEvent(rollout_id="r2"))
    assert isinstance(delete, ApplyEvent) and isinstance(delete.event, DeleteEvent)
    assert all(d.decided is not None for d in r2)
    assert all(isinstance(d.decided, ApplyEvent) for d in r2)


def test_settling_the_oldest_decodes_in_arrival_order_until_the_deadline(topic: MemoryTopic) -> None:
    router = InboundRouter()
    capture = topic.messages()[:24]
    decided = [d for message in capture for d in router.route_deferring(log_message(message))]
    deferred = [d for d in decided if isinstance(d, Deferred)]
    assert len(deferred) == len(capture)
    assert router.settle_oldest(time.monotonic() - 1) == 0
    assert router.unsettled() == len(deferred)
    router.settle(deferred[5])  # its rollout's earlier ones with it, out of arrival order
    settled_early = sum(d.decided is not None for d in deferred)
    assert 1 < settled_early < 6
    assert router.settle_oldest(time.monotonic() + 60) == len(deferred) - settled_early
    assert router.unsettled() == 0
    eager = InboundRouter()
    expected = [d for message in capture for d in eager.route(log_message(message))]
    assert [router.settle(d) if isinstance(d, Deferred) else d for d in decided] == expected


def test_a_router_whose_messages_were_all_settled_keeps_none_of_them_once_asked_to_settle(
    topic: MemoryTopic,
) -> None:
    router = InboundRouter()
    decided = [d for message in topic.messages()[:24] for d in router.route_deferring(log_message(message))]
    for deferred in decided:
        assert isinstance(deferred, Deferred)
        router.settle(deferred)
    assert router.settle_oldest(0.0) == 0
    assert not router._arrived


def test_tokens_decoded_ahead_are_counted_until_their_messages_are_asked_for(topic: MemoryTopic) -> None:
    router = InboundRouter()
    decided = [d for message in topic.messages()[:24] for d in router.route_deferring(log_message(message))]
    deferred = [d for d in decided if isinstance(d, Deferred)]
    router.settle(deferred[3])  # asked for: decoded, never counted as ahead
    assert router.decoded_ahead_tokens == 0
    assert not router.all_decoded()
    router.settle_oldest(time.monotonic() + 60)
    assert router.all_decoded()
    ahead = [d for d in deferred if d.decoded_ahead]
    assert ahead and deferred[3] not in ahead
    puts = [d for d in ahead if isinstance(d.decided, ApplyEvent) and isinstance(d.decided.event, PutEvent)]
    expected = 0
    for put in puts:
        assert isinstance(put.decided, ApplyEvent) and isinstance(put.decided.event, PutEvent)
        entry = put.decided.event.entry
        expected += len(entry.prompt_token_ids) + len(entry.generation_token_ids)
    assert expected > 0 and router.decoded_ahead_tokens == expected
    for waiting in ahead:
        router.settle(waiting)
        router.settle(waiting)  # asked for again: counted off once
    assert router.decoded_ahead_tokens == 0


def test_routing_a_freeze_leaves_its_rollouts_deferred_capture_undecoded_until_the_freeze_is_carried_out(
    topic: MemoryTopic,
) -> None:
    """A burst of freezes must not decode every rollout's puts before the first freeze is carried out."""
    router, r2 = _route_capture_deferring(topic)
    (freeze,) = _route_after_capture(router, FreezeEvent(rollout_id="r2"))
    assert isinstance(freeze, ApplyEvent) and isinstance(freeze.event, FreezeEvent)
    assert r2 and all(d.decided is None for d in r2)
    assert all(isinstance(router.settle(d), ApplyEvent) for d in r2)
