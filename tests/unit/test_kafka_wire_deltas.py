"""Wire deltas: a put continuing a call the sink already sent travels as (parent link, suffix), and every
reader restores the exact entry, or refuses it loudly, never applying it wrong.

The real sink writes into the in-memory topic double; the real materializer and timeline read it.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import orjson
import pytest
from kafka_topic_double import MemoryTopic, StoredMessage, materialize
from wire_delta_fixtures import conversation, delta_offsets, memory_sink, store_files

from tokcap.errors import EventDecodeError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import EVENT_SCHEMA_VERSION, DeleteEvent, FreezeEvent, IntentEvent, PutEvent
from tokcap.log.records import TokenEntry
from transports.kafka.materializer.dead_letters import dead_letter_path
from transports.kafka.timeline import DEAD_LETTERED, LogApplier
from transports.kafka.wire.codec import (
    HEADER_SCHEMA,
    ParentLink,
    decode_message,
    encode_delta_message,
    headers_to_dict,
)

TOPIC = "tokcap.wire-delta-test"


def write(
    topic: MemoryTopic, tmp_path: Path, rollouts: list[list[TokenEntry]], **sink_kwargs: object
) -> None:
    """Put every rollout's entries in turn order through one sink, the rollouts interleaved."""

    async def scenario() -> None:
        sink, _ = memory_sink(topic, tmp_path / "spill", **sink_kwargs)
        try:
            for turn in range(max(len(r) for r in rollouts)):
                for entries in rollouts:
                    if turn < len(entries):
                        await sink.put(entries[turn])
        finally:
            await sink.close()

    asyncio.run(scenario())


def rollouts() -> list[list[TokenEntry]]:
    return [conversation(f"r{i}", 5) for i in range(3)]


def full_and_delta(tmp_path: Path, partitions: int = 1) -> tuple[MemoryTopic, MemoryTopic]:
    """The same rollouts written with wire deltas off and on."""
    full, delta = MemoryTopic(TOPIC, partitions), MemoryTopic(TOPIC, partitions)
    write(full, tmp_path, rollouts(), wire_deltas=False)
    write(delta, tmp_path, rollouts())
    return full, delta


def dead_letters(directory: Path) -> list[dict[str, object]]:
    path = dead_letter_path(directory, 0)
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_a_store_fed_wire_deltas_is_byte_identical_to_one_fed_the_same_puts_whole(tmp_path: Path) -> None:
    full, delta = full_and_delta(tmp_path, partitions=2)
    assert sum(len(delta_offsets(delta, p)) for p in range(2)) == 3 * 4
    assert sum(len(m.value_ or b"") for p in range(2) for m in delta.messages(p)) < 0.7 * sum(
        len(m.value_ or b"") for p in range(2) for m in full.messages(p)
    )
    materialize(full, tmp_path / "full")
    materialize(delta, tmp_path / "delta")
    assert store_files(tmp_path / "delta") == store_files(tmp_path / "full")
    assert dead_letters(tmp_path / "delta") == []


def test_a_materializer_resumed_past_the_parents_reads_them_again_from_the_log(tmp_path: Path) -> None:
    full, delta = full_and_delta(tmp_path)
    materialize(full, tmp_path / "full")
    messages = delta.messages()
    cut = delta_offsets(delta)[5]
    # The first materializer sees the log up to the cut; the resumed one keeps nothing of it in memory.
    growing = MemoryTopic(TOPIC)
    for message in messages[:cut]:
        growing.produce(message.key_, message.value_, message.headers_)
    materialize(growing, tmp_path / "delta")
    for message in messages[cut:]:
        growing.produce(message.key_, message.value_, message.headers_)
    resumed = materialize(growing, tmp_path / "delta")
    assert resumed._router.parents.reads > 0
    assert store_files(tmp_path / "delta") == store_files(tmp_path / "full")
    assert dead_letters(tmp_path / "delta") == []


def test_the_timeline_restores_wire_deltas_whether_it_reads_all_rollouts_or_one(tmp_path: Path) -> None:
    full, delta = full_and_delta(tmp_path)
    materialize(full, tmp_path / "full")
    expected = store_files(tmp_path / "full")
    whole = LogApplier(TokenCaptureStore(tmp_path / "whole"), TOPIC)
    verdicts = [entry for m in delta.messages() for entry in whole.take_all(m.as_log_message())]
    assert DEAD_LETTERED not in {v.decision for v in verdicts}
    assert store_files(tmp_path / "whole") == expected
    one = LogApplier(TokenCaptureStore(tmp_path / "r1"), TOPIC)
    for message in delta.messages():
        if message.key_ == b"r1":
            one.take_all(message.as_log_message())
        else:
            one.pass_over(message.as_log_message())
    assert store_files(tmp_path / "r1") == {k: v for k, v in expected.items() if k.startswith("r1.")}


def corrupt(message: StoredMessage, at: int) -> StoredMessage:
    value = bytearray(message.value_ or b"")
    value[at] ^= 0x01
    return StoredMessage(
        message.topic, message.partition_, message.offset_, message.key_, bytes(value), message.headers_
    )


def test_a_wire_delta_with_a_corrupted_suffix_is_dead_lettered_and_masks_its_rollout(tmp_path: Path) -> None:
    _, delta = full_and_delta(tmp_path)
    target = delta_offsets(delta)[0]
    # The 20 suffix ids (80 B) sit before 40 generated ids (160 B) and 40 log probs (320 B).
    bad = corrupt(delta.partitions[0][target], -500)
    delta.partitions[0][target] = bad
    materialize(delta, tmp_path / "delta")
    store = TokenCaptureStore(tmp_path / "delta")
    rollout = (bad.key_ or b"").decode()
    first, *children = dead_letters(tmp_path / "delta")
    assert first["offset"] == target and "digest" in str(first["reason"])
    assert store.is_incomplete(rollout)
    # Its children link it: they cannot be proven either, and are refused, never applied wrong.
    assert len(children) == 3 and {line["rollout_id"] for line in children} == {rollout}
    assert {e.model_call_id for e in store.read_entries(rollout)} == {"call-0"}


def test_a_wire_delta_linking_another_rollouts_message_is_dead_lettered(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    a, b = conversation("ra", 2), conversation("rb", 1, seed=1)
    # rb's call is at offset 0; a forged delta of ra links it although ra's prompt starts with ra's call.
    topic.publish(PutEvent(rollout_id="rb", entry=b[0]))
    topic.publish(PutEvent(rollout_id="ra", entry=a[0]))
    length = len(a[0].prompt_token_ids) + len(a[0].generation_token_ids)
    forged = encode_delta_message(
        PutEvent(rollout_id="ra", entry=a[1]),
        ParentLink(0, 0, "call-0", length),
    )
    topic.produce(forged.key, forged.value, forged.headers)
    materialize(topic, tmp_path)
    (line,) = dead_letters(tmp_path)
    assert line["offset"] == 2 and "another rollout" in str(line["reason"])
    assert TokenCaptureStore(tmp_path).is_incomplete("ra")


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("prompt_token_ids", "prompt_suffix_token_ids holds a negative token id"),
        ("generation_token_ids", "generation_token_ids holds a negative token id"),
        ("model_call_id", "model_call_id 'call-1\\nx' contains a control character"),
    ],
)
def test_a_wire_delta_a_sink_would_refuse_is_dead_lettered_naming_the_field_and_masks_its_rollout(
    tmp_path: Path, field: str, named: str
) -> None:
    topic = MemoryTopic(TOPIC)
    root, child = conversation("ra", 2)
    topic.publish(PutEvent(rollout_id="ra", entry=root))
    length = len(root.prompt_token_ids) + len(root.generation_token_ids)
    changed = {
        "prompt_token_ids": [*child.prompt_token_ids, -7],
        "generation_token_ids": [-7, *child.generation_token_ids[1:]],
        "model_call_id": "call-1\nx",
    }
    forged = encode_delta_message(
        PutEvent(rollout_id="ra", entry=child.model_copy(update={field: changed[field]})),
        ParentLink(0, 0, root.model_call_id, length),
    )
    topic.produce(forged.key, forged.value, forged.headers)
    materialize(topic, tmp_path)
    (line,) = dead_letters(tmp_path)
    assert line["offset"] == 1 and named in str(line["reason"]), line
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("ra") and [e.model_call_id for e in store.read_entries("ra")] == ["call-0"]
    assert store.read_intents("ra") == {}


def test_a_reader_that_knows_only_schema_1_is_told_a_wire_delta_is_newer_and_decode_message_refuses_it(
    tmp_path: Path,
) -> None:
    _, delta = full_and_delta(tmp_path)
    message = delta.messages()[delta_offsets(delta)[0]]
    headers = headers_to_dict(message.headers_)
    assert int(headers[HEADER_SCHEMA]) > EVENT_SCHEMA_VERSION  # what a reader before wire deltas compares
    with pytest.raises(EventDecodeError, match="inbound router"):
        decode_message(message.key_, message.value_, headers)


def test_a_put_continuing_a_call_another_sink_sent_goes_whole(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    entries = conversation("r1", 3)

    async def scenario() -> None:
        first, _ = memory_sink(topic, tmp_path / "spill-a")
        second, _ = memory_sink(topic, tmp_path / "spill-b")
        try:
            await first.put(entries[0])
            await second.put(entries[1])
            await first.put(entries[2])  # continues call-1 (not this sink's) and call-0 (this sink's)
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())
    assert delta_offsets(topic) == [2]
    value = topic.messages()[2].value_ or b""
    head = orjson.loads(value[8 : 8 + struct.unpack_from("<I", value, 4)[0]])
    assert head["parent"]["model_call_id"] == "call-0"


def test_a_put_continuing_a_call_whose_send_failed_goes_whole(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    entries = conversation("r1", 3)

    async def scenario() -> None:
        sink, bridge = memory_sink(topic, tmp_path / "spill")
        try:
            bridge.fail_next = True
            with pytest.raises(Exception, match="refused"):
                await sink.put(entries[0])
            await sink.put(entries[1])
            await sink.put(entries[2])
        finally:
            await sink.close()

    asyncio.run(scenario())
    assert delta_offsets(topic) == [1]


def test_a_put_continuing_a_call_whose_send_is_not_acknowledged_yet_goes_whole(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    entries = conversation("r1", 3)

    async def scenario() -> None:
        sink, bridge = memory_sink(topic, tmp_path / "spill")
        try:
            bridge.hold = asyncio.Event()
            first = asyncio.create_task(sink.put(entries[0]))
            while not topic.messages():
                await asyncio.sleep(0)  # call-0 is in the log, its acknowledgement held back
            second = asyncio.create_task(sink.put(entries[1]))
            while len(topic.messages()) < 2:
                await asyncio.sleep(0)
            bridge.hold.set()
            await asyncio.gather(first, second)
            bridge.hold = None
            await sink.put(entries[2])
        finally:
            await sink.close()

    asyncio.run(scenario())
    assert delta_offsets(topic) == [2]


def test_chunked_puts_are_never_parents_and_a_delta_too_large_for_one_message_goes_whole(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    # r1: call-0 (1,200 ids) is chunked, so call-1, whose delta (440 new ids) would fit, cannot link it.
    chunked_parents = conversation("r1", 3, prompt=1200, generated=40, tool=400)
    # r2: call-0 is one message, but call-1 adds 2,040 ids: its delta would itself need chunks.
    large_suffix = conversation("r2", 2, prompt=300, generated=40, tool=2000)
    write(topic, tmp_path, [chunked_parents, large_suffix], chunk_bytes=4096)
    assert delta_offsets(topic) == []
    assert max(len(m.value_ or b"") for m in topic.messages()) <= 4096
    materialize(topic, tmp_path / "store")
    store = TokenCaptureStore(tmp_path / "store")
    assert [len(store.read_entries(r)) for r in ("r1", "r2")] == [3, 2]


def test_a_deleted_and_reused_rollout_id_still_restores_exactly_from_the_log(tmp_path: Path) -> None:
    full, delta = MemoryTopic(TOPIC), MemoryTopic(TOPIC)
    entries = conversation("r1", 4)
    for topic, deltas in ((full, False), (delta, True)):

        async def scenario(topic: MemoryTopic = topic, deltas: bool = deltas) -> None:
            sink, _ = memory_sink(topic, tmp_path / f"spill-{deltas}", wire_deltas=deltas)
            try:
                await sink.put(entries[0])
                await sink.put(entries[1])
                topic.publish(FreezeEvent(rollout_id="r1"))
                topic.publish(DeleteEvent(rollout_id="r1"))
                topic.publish(IntentEvent(rollout_id="r1", model_call_id="call-2"))
                await sink.put(entries[2])  # the sink does not know of the delete: it links call-1
                await sink.put(entries[3])
            finally:
                await sink.close()

        asyncio.run(scenario())
    assert len(delta_offsets(delta)) == 3
    materialize(full, tmp_path / "full")
    clean = tmp_path / "clean"
    materialize(delta, clean)
    assert store_files(clean) == store_files(tmp_path / "full")
    # Resumed just after the delete: the parents were applied and deleted before the checkpoint.
    resumed = tmp_path / "resumed"
    growing = MemoryTopic(TOPIC)
    messages = delta.messages()
    for message in messages[:5]:
        growing.produce(message.key_, message.value_, message.headers_)
    materialize(growing, resumed)
    for message in messages[5:]:
        growing.produce(message.key_, message.value_, message.headers_)
    materialize(growing, resumed)
    assert store_files(resumed) == store_files(tmp_path / "full")
