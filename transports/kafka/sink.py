"""``KafkaTokenSink``: capture events published to the run topic, acknowledged before returning.

Build it from keyword arguments, so a config can name ``transports.kafka:KafkaTokenSink`` with
``sink_kwargs``. Each call returns only after the broker acknowledged its event (``acks=all``,
idempotent producer), and fails within ``delivery_timeout_s`` when the broker is unreachable.
The sink refuses at once a payload that conflicts with one it already wrote for the same call;
conflicts between processes are decided by the materializer, which fails closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from tokcap.errors import ConfigError, ConflictingEntryError
from tokcap.events import CancelEvent, Event, IncompleteEvent, IntentEvent, PutEvent
from tokcap.input_rules import accept_entry, check_call_id
from tokcap.records import TokenEntry
from tokcap.rollout_ids import validate_rollout_id
from transports.kafka.codec import DEFAULT_CHUNK_BYTES, encode_event_messages
from transports.kafka.producer_bridge import DEFAULT_DELIVERY_TIMEOUT_S, Delivered, ProducerBridge
from transports.kafka.topics import resolve_topic

__all__ = [
    "DEFAULT_REMEMBERED_CALLS",
    "KafkaTokenSink",
    "default_writer_id",
    "logger",
]

logger = logging.getLogger(__name__)

DEFAULT_REMEMBERED_CALLS = 100_000
"""How many (rollout, call) digests a sink keeps to refuse conflicting payloads; oldest are forgotten first."""

_LARGE_ENTRY_TOKENS = 50_000
"""Entries with more tokens than this are encoded in a worker thread, off the event loop."""


def default_writer_id() -> str:
    """A writer id unique to this sink instance: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class KafkaTokenSink:
    """Publishes intent, cancel, put and incomplete events for the materializer to apply."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        run_id: str | None = None,
        topic: str | None = None,
        writer_id: str | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        remembered_calls: int = DEFAULT_REMEMBERED_CALLS,
    ) -> None:
        if not bootstrap_servers:
            raise ConfigError("bootstrap_servers must name at least one broker")
        if chunk_bytes < 1024:
            raise ConfigError(f"chunk_bytes must be at least 1024, got {chunk_bytes}")
        if remembered_calls < 1:
            raise ConfigError(f"remembered_calls must be at least 1, got {remembered_calls}")
        self._topic = resolve_topic(run_id, topic)
        self._writer_id = writer_id or default_writer_id()
        self._chunk_bytes = chunk_bytes
        self._session = uuid.uuid4().hex
        self._chunk_sequence = itertools.count()
        self._digests: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._digest_lock = threading.Lock()
        self._remembered_calls = remembered_calls
        self._bridge = ProducerBridge(
            bootstrap_servers, delivery_timeout_s=delivery_timeout_s, producer_config=producer_config
        )
        self._closed = False
        logger.info(
            "kafka token sink writing to topic %s on %s as %s",
            self._topic,
            bootstrap_servers,
            self._writer_id,
        )

    def __repr__(self) -> str:
        """Names the topic and writer only: producer settings may hold credentials."""
        return f"KafkaTokenSink(topic={self._topic!r}, writer_id={self._writer_id!r})"

    @property
    def topic(self) -> str:
        """The run topic this sink writes to."""
        return self._topic

    @property
    def writer_id(self) -> str:
        """The id stamped on every event this sink writes."""
        return self._writer_id

    def _next_chunk_group(self) -> str:
        return f"{self._session}:{next(self._chunk_sequence)}"

    async def _publish(self, event: Event, *, what: str, large: bool = False) -> list[Delivered]:
        """Encode, send and await the acknowledgement of one event."""
        if large:
            messages = await asyncio.to_thread(
                encode_event_messages,
                event,
                chunk_bytes=self._chunk_bytes,
                next_chunk_group=self._next_chunk_group,
            )
        else:
            messages = encode_event_messages(
                event, chunk_bytes=self._chunk_bytes, next_chunk_group=self._next_chunk_group
            )
        return await self._bridge.send(self._topic, messages, what=what)

    def _reserve_digest(self, rollout_id: str, call_id: str, digest: str) -> bool:
        """Remember the payload of a call; refuse a different one; return whether this call added it."""
        key = (rollout_id, call_id)
        with self._digest_lock:
            known = self._digests.get(key)
            if known is not None:
                self._digests.move_to_end(key)
                if known != digest:
                    raise ConflictingEntryError(
                        f"call {call_id!r} of rollout {rollout_id!r} was already written by this sink with a "
                        "different payload; the caller must mark the rollout incomplete",
                        rollout_id=rollout_id,
                        model_call_id=call_id,
                    )
                return False
            self._digests[key] = digest
            while len(self._digests) > self._remembered_calls:
                self._digests.popitem(last=False)
            return True

    def _forget_digest(self, rollout_id: str, call_id: str, digest: str) -> None:
        with self._digest_lock:
            if self._digests.get((rollout_id, call_id)) == digest:
                del self._digests[(rollout_id, call_id)]

    async def put(self, entry: TokenEntry) -> None:
        """Publish a call's entry and return once the broker acknowledged it; a Gym entry is taken as is."""
        entry = accept_entry(entry)
        rollout_id = validate_rollout_id(entry.rollout_id)
        call_id = entry.model_call_id
        digest = entry.payload_digest()
        added = self._reserve_digest(rollout_id, call_id, digest)
        event = PutEvent(rollout_id=rollout_id, writer=self._writer_id, entry=entry)
        tokens = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
        try:
            await self._publish(
                event,
                what=f"put of call {call_id!r} of rollout {rollout_id!r}",
                large=tokens > _LARGE_ENTRY_TOKENS,
            )
        except BaseException:
            if added:
                self._forget_digest(rollout_id, call_id, digest)
            raise

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Publish a call's intent before dispatch; a failure here stops the call before generation."""
        check_call_id(rollout_id, model_call_id)
        event = IntentEvent(rollout_id=rollout_id, writer=self._writer_id, model_call_id=model_call_id)
        await self._publish(event, what=f"intent of call {model_call_id!r} of rollout {rollout_id!r}")

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Publish that a call ended without generation, closing its intent."""
        check_call_id(rollout_id, model_call_id)
        event = CancelEvent(rollout_id=rollout_id, writer=self._writer_id, model_call_id=model_call_id)
        await self._publish(event, what=f"cancel of call {model_call_id!r} of rollout {rollout_id!r}")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Publish that a call of the rollout failed to capture, so the rollout is masked."""
        check_call_id(rollout_id, model_call_id, may_be_empty=True)
        event = IncompleteEvent(
            rollout_id=rollout_id, writer=self._writer_id, model_call_id=model_call_id, reason=reason
        )
        await self._publish(
            event, what=f"incomplete marker of call {model_call_id!r} of rollout {rollout_id!r}"
        )

    async def close(self) -> None:
        """Flush pending events and stop the producer; calling it again is a no-op."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._bridge.close)
