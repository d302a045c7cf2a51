"""A staged reference restores exactly the stage whose pieces it names, and nothing else."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import orjson
import pytest
from staging_calls import staged_call

from tokcap.errors import EventDecodeError, EventTooLargeError, TransportError
from tokcap.log.events import StagedBlob, StageEvent
from transports.kafka.wire.codec import (
    LogMessage,
    OutgoingMessage,
    encode_event_messages,
    encode_event_value,
    headers_to_dict,
)
from transports.kafka.wire.router import ApplyEvent, DeadLetter, InboundRouter
from transports.kafka.wire.staged_payloads import (
    StagedPayloadRestorer,
    decode_reference,
    encode_staged_payload,
    encode_staged_reference,
    is_staged_reference,
)
from transports.kafka.wire.topic_limits import TopicLimits

PAYLOAD_TOPIC = "tokcap-staged.tokcap.r"
LIMITS = TopicLimits(max_event_bytes=1 << 20, staged_payload_topic=PAYLOAD_TOPIC)


def stage(rollout_id: str = "r", call_id: str = "call-0", image: bytes = b"\x00pixels" * 700) -> StageEvent:
    call = staged_call(rollout_id, call_id, [1, 2], [7, 8, 9])
    sha = hashlib.sha256(image).hexdigest()
    return StageEvent(
        rollout_id=rollout_id,
        staging_key=f"{rollout_id}/{call_id}",
        model_call_id=call_id,
        row=call.model_dump(mode="json", exclude={"extras"}),
        attachments={"image": StagedBlob(sha256=sha, size=len(image))},
    ).with_blob_bytes({sha: image})


@dataclass
class PayloadTopic:
    """The payload topic as a list per partition: a reader returns what lies at an offset, or ``None``."""

    partitions: dict[int, list[LogMessage | None]] = field(default_factory=dict)
    closed: bool = False

    def append(self, partition: int, message: OutgoingMessage) -> int:
        log = self.partitions.setdefault(partition, [])
        log.append(LogMessage(partition, len(log), None, message.key, tuple(message.headers), message.value))
        return len(log) - 1

    def read(self, partition: int, offset: int) -> LogMessage | None:
        log = self.partitions.get(partition, [])
        return log[offset] if offset < len(log) else None

    def close(self) -> None:
        self.closed = True


def sent(
    event: StageEvent, topic: PayloadTopic, *, chunk_bytes: int = 1024, partition: int = 0
) -> LogMessage:
    """Send the stage as a sink does: its pieces to the payload topic, then the reference message."""
    payload = encode_staged_payload(event, chunk_bytes=chunk_bytes, limits=LIMITS)
    offsets = [topic.append(partition, piece) for piece in payload.pieces]
    reference = encode_staged_reference(event, payload, PAYLOAD_TOPIC, partition, offsets)
    return LogMessage(partition, 9, None, reference.key, tuple(reference.headers), reference.value)


def restorer(topic: PayloadTopic) -> StagedPayloadRestorer:
    return StagedPayloadRestorer(lambda name: topic if name == PAYLOAD_TOPIC else PayloadTopic())


def restored(message: LogMessage, topic: PayloadTopic, limits: TopicLimits = LIMITS) -> StageEvent:
    event, size = restorer(topic).restore(
        message.key, message.value, headers_to_dict(message.headers), limits
    )
    assert size == len(encode_event_value(event)[1])
    return event


def test_a_reference_restores_the_exact_stage_its_pieces_carry() -> None:
    topic = PayloadTopic()
    event = stage()
    message = sent(event, topic)
    assert is_staged_reference(headers_to_dict(message.headers))
    assert len(topic.partitions[0]) > 1, "the value was meant to need several pieces"
    back = restored(message, topic)
    assert back.stored_line == event.stored_line
    assert back.blob_bytes == event.blob_bytes
    assert encode_event_value(back) == encode_event_value(event)


def test_a_reference_is_small_whatever_the_stage_holds() -> None:
    topic = PayloadTopic()
    message = sent(stage(image=b"x" * 500_000), topic, chunk_bytes=100_000)
    assert len(message.value or b"") < 512
    assert sum(len(piece.value or b"") for piece in topic.partitions[0] if piece) > 500_000


def test_a_stage_larger_than_the_topic_allows_is_refused_before_any_piece_exists() -> None:
    with pytest.raises(EventTooLargeError, match="max_event_bytes"):
        encode_staged_payload(
            stage(image=b"x" * 5000), chunk_bytes=1024, limits=TopicLimits(max_event_bytes=2048)
        )


def _tampered(topic: PayloadTopic, index: int, **changes: object) -> None:
    piece = topic.partitions[0][index]
    assert piece is not None
    topic.partitions[0][index] = replace(piece, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda t: _tampered(t, 1, value=b"X" + (t.partitions[0][1].value or b"")[1:]), "SHA-256"),
        (lambda t: t.partitions[0].__setitem__(1, None), "no longer in the log"),
        (lambda t: t.partitions[0].pop(), "no longer in the log"),
        (lambda t: _tampered(t, 0, key=b"other"), "mismatched: key"),
        (
            lambda t: _tampered(
                t,
                0,
                headers=tuple(
                    (n, b"7" if n == "tokcap.payload.index" else v) for n, v in t.partitions[0][0].headers
                ),
            ),
            "tokcap.payload.index",
        ),
        (
            lambda t: _tampered(
                t,
                0,
                headers=tuple(
                    (n, b"0" * 64 if n == "tokcap.payload.sha256" else v)
                    for n, v in t.partitions[0][0].headers
                ),
            ),
            "tokcap.payload.sha256",
        ),
    ],
    ids=[
        "a changed byte",
        "a piece gone",
        "the last piece gone",
        "another key",
        "another index",
        "another digest",
    ],
)
def test_a_reference_whose_pieces_are_not_exactly_what_it_names_is_undecodable(
    damage: object, reason: str
) -> None:
    topic = PayloadTopic()
    message = sent(stage(), topic)
    damage(topic)  # type: ignore[operator]
    with pytest.raises(EventDecodeError, match=reason):
        restored(message, topic)


def _rewritten(message: LogMessage, **fields: object) -> LogMessage:
    raw = orjson.loads(message.value or b"")
    raw.update(fields)
    return replace(message, value=orjson.dumps(raw))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"topic": "tokcap.another-run"}, "staged payloads are on"),
        ({"size": 2 << 20}, "over the topic's max_event_bytes"),
        ({"staging_key": "r/call-9"}, "is not the stage of"),
        ({"model_call_id": "call-9"}, "is not the stage of"),
        ({"offsets": []}, "offsets must be whole numbers"),
        ({"offsets": [True]}, "offsets must be whole numbers"),
        ({"sha256": "A" * 64}, "64 lowercase hex"),
        ({"schema": 2}, "Upgrade tokcap"),
        ({"extra": 1}, "must hold exactly"),
        ({"rollout_id": "s"}, "does not match the staged reference's rollout"),
    ],
)
def test_a_reference_that_names_anything_else_is_undecodable(fields: dict[str, object], reason: str) -> None:
    topic = PayloadTopic()
    message = _rewritten(sent(stage(), topic), **fields)
    with pytest.raises(EventDecodeError, match=reason):
        restored(message, topic)


def test_a_reference_on_a_topic_whose_record_names_no_payload_topic_is_undecodable() -> None:
    topic = PayloadTopic()
    with pytest.raises(EventDecodeError, match="names no staged-payload topic"):
        restored(sent(stage(), topic), topic, TopicLimits(max_event_bytes=1 << 20))


def test_a_reader_built_without_a_way_to_the_payload_topic_stops_instead_of_masking() -> None:
    message = sent(stage(), PayloadTopic())
    with pytest.raises(TransportError, match="without a way"):
        StagedPayloadRestorer().restore(message.key, message.value, headers_to_dict(message.headers), LIMITS)


def test_the_router_applies_a_reference_at_its_own_position_and_dead_letters_a_broken_one() -> None:
    topic = PayloadTopic()
    event = stage()
    good = sent(event, topic)
    broken = replace(sent(stage("s"), topic), offset=10)
    topic.partitions[0][-1] = None
    router = InboundRouter(limits=LIMITS, topic="tokcap.r", payloads=restorer(topic))
    [applied] = router.route(good)
    assert isinstance(applied, ApplyEvent) and (applied.partition, applied.offset) == (0, 9)
    assert isinstance(applied.event, StageEvent) and applied.event.stored_line == event.stored_line
    # A reader's read-ahead holds the restored payload with the decision, so it counts the payload's bytes.
    assert applied.size == len(encode_event_value(event)[1]) > len(good.value or b"")
    [refused] = router.route(broken)
    assert isinstance(refused, DeadLetter) and "no longer in the log" in refused.reason


def test_an_inline_stage_still_decodes_on_a_topic_with_a_payload_topic() -> None:
    event = stage()
    [message] = encode_event_messages(event, chunk_bytes=1 << 20, next_chunk_group=str)
    router = InboundRouter(limits=LIMITS, topic="tokcap.r")
    [applied] = router.route(LogMessage(0, 3, None, message.key, tuple(message.headers), message.value))
    assert isinstance(applied, ApplyEvent) and applied.event.stored_line == event.stored_line  # type: ignore[union-attr]


def test_a_reference_value_is_canonical_json_with_sorted_keys() -> None:
    message = sent(stage(), PayloadTopic())
    value = message.value or b""
    assert value == orjson.dumps(orjson.loads(value), option=orjson.OPT_SORT_KEYS)
    assert decode_reference(value).offsets == tuple(range(len(decode_reference(value).offsets)))


def test_closing_the_restorer_closes_the_readers_it_opened() -> None:
    topic = PayloadTopic()
    restorer_ = restorer(topic)
    message = sent(stage(), topic)
    restorer_.restore(message.key, message.value, headers_to_dict(message.headers), LIMITS)
    restorer_.close()
    assert topic.closed
