"""Whether a rollout was retired or deleted after a given message of its partition, read from the log itself.

A staging sink remembers the digest of every key it staged, so that a different payload under a key is
refused at once instead of being acknowledged and then dead-lettered. That memory is only true until the
rollout is deleted (the key is free again) or retired (its fence refuses every stage). A sink with no
projection of its own learns of either only from the log: a rollout's commands sit in its partition, after
the stage the sink remembers, so reading that partition from there to its end as of now answers.

Only small JSON messages keyed by the rollout are decoded; anything else is passed over unread.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import TopicPartition

from tokcap.errors import EventDecodeError, NewerSchemaError, TransportError
from tokcap.log.events import DeleteEvent, RetireEvent
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, open_reader
from transports.kafka.client.error_map import Request, read_failure, translated
from transports.kafka.wire.codec import (
    ENCODING_JSON,
    HEADER_CHUNK_GROUP,
    HEADER_ENCODING,
    HEADER_TYPE,
    decode_message,
    headers_to_dict,
)

__all__ = ["Removal", "removal_after"]

_POLL_S = 0.2
_COMMANDS = frozenset({"retire", "delete"})


class Removal(enum.Enum):
    """The last retire or delete of a rollout after a position: none, a retire (fenced) or a delete (free)."""

    NONE = "none"
    RETIRED = "retired"
    DELETED = "deleted"


def removal_after(
    bootstrap_servers: str,
    topic: str,
    rollout_id: str,
    partition: int,
    offset: int,
    *,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> Removal:
    """The last retire or delete of ``rollout_id`` after ``offset`` of ``partition``, up to its end as of now.

    Raise ``TransportError`` when the broker does not answer within ``timeout_s``: a caller that cannot tell
    must refuse rather than guess.
    """
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    start = offset + 1
    consumer = open_reader(
        context, topic, {partition: start}, purpose="staging-removals", watch=watch, timeout_s=timeout_s
    )
    key = rollout_id.encode()
    last = Removal.NONE
    try:
        with translated(context, Request(f"read the end of partition {partition} of {topic!r}", timeout_s)):
            _, end = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=timeout_s, cached=False
            )
        deadline = time.monotonic() + timeout_s
        next_offset = start
        while next_offset < end:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"could not read partition {partition} of {topic!r} up to offset {end} within {timeout_s:g} s, "
                    f"so whether rollout {rollout_id!r} was deleted or retired is unknown; is the broker reachable?"
                )
            with translated(context, Request(f"read partition {partition} of {topic!r}", timeout_s)):
                messages = consumer.consume(100, min(remaining, _POLL_S))
            watch.raise_if_failed()
            for message in messages:
                error = message.error()
                if error is not None:
                    failure = read_failure(error, context, topic)
                    if failure is not None:
                        raise failure
                    continue
                next_offset = max(next_offset, int(message.offset() or 0) + 1)
                if message.key() == key:
                    last = _command_of(message.key(), message.value(), message.headers()) or last
        return last
    finally:
        consumer.close()


def _command_of(key: bytes | None, value: bytes | None, raw_headers: Any) -> Removal | None:
    """The removal one message of the rollout carries, or ``None`` (any other event, or one no reader applies)."""
    try:
        headers = headers_to_dict(raw_headers)
    except EventDecodeError:
        return None
    named = headers.get(HEADER_TYPE)
    if named is not None and named not in _COMMANDS:
        return None
    if headers.get(HEADER_ENCODING, ENCODING_JSON) != ENCODING_JSON or HEADER_CHUNK_GROUP in headers:
        return None
    try:
        event = decode_message(key, value, headers)
    except (EventDecodeError, NewerSchemaError):
        return None
    if isinstance(event, DeleteEvent):
        return Removal.DELETED
    if isinstance(event, RetireEvent):
        return Removal.RETIRED
    return None
