"""The ``staged`` value of a stage event: the event and the bytes of the blobs it names, in one value.

Layout (``binary_frame``, magic ``TKS1``): the event's canonical JSON, then each blob's bytes in the order
``StageEvent.blob_refs`` gives. A reader checks every blob's size and SHA-256 against the row, so a run topic
holds every staged byte and no reader takes a blob its row does not name.
"""

from __future__ import annotations

from tokcap.errors import EventDecodeError, InvalidInputError
from tokcap.log.events import StageEvent, encode_event
from tokcap.log.hashing import sha256_hex
from transports.kafka.wire.binary_frame import frame, read_frame
from transports.kafka.wire.input_refusals import accepted

__all__ = ["pack_stage", "unpack_stage"]

_STAGED_MAGIC = b"TKS1"


def pack_stage(event: StageEvent) -> bytes:
    """The ``staged`` value of a stage event: its JSON, then the bytes of every blob it names."""
    head = encode_event(event)
    carried = event.blob_bytes
    blobs = []
    for ref in event.blob_refs():
        data = carried.get(ref.sha256)
        if data is None:
            raise InvalidInputError(
                f"stage of {event.staging_key!r} names blob {ref.sha256} but does not carry its bytes; "
                "a run topic must hold every staged byte",
                rollout_id=event.rollout_id,
                model_call_id=event.model_call_id,
            )
        blobs.append(data)
    return frame(_STAGED_MAGIC, head, blobs)


def unpack_stage(value: bytes) -> StageEvent:
    """A stage event with the blob bytes it carries, each checked against the size and SHA-256 its row names."""
    raw, head_end = read_frame(value, _STAGED_MAGIC, "staged value")
    event = accepted(raw, token_ids_checked=False)
    if not isinstance(event, StageEvent):
        raise EventDecodeError(f"a staged value must be a stage event, got {event.type.value}")
    blobs: dict[str, bytes] = {}
    cursor = head_end
    for ref in event.blob_refs():
        data = value[cursor : cursor + ref.size]
        if len(data) != ref.size:
            raise EventDecodeError(
                f"staged value of {event.staging_key!r} is truncated inside blob {ref.sha256}"
            )
        if sha256_hex(data) != ref.sha256:
            raise EventDecodeError(
                f"a blob of {event.staging_key!r} does not match the SHA-256 {ref.sha256} its row names"
            )
        blobs[ref.sha256] = data
        cursor += ref.size
    if cursor != len(value):
        raise EventDecodeError(
            f"staged value of {event.staging_key!r} has {len(value) - cursor} trailing bytes"
        )
    return event.with_blob_bytes(blobs)
