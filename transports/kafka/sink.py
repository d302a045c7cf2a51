"""``KafkaTokenSink``: capture events published to the run topic, acknowledged before returning.

Build it from keyword arguments, so a config can name ``transports.kafka:KafkaTokenSink`` with
``sink_kwargs``. Each call returns only after the broker acknowledged its event (``acks=all``,
idempotent producer), and fails within ``delivery_timeout_s`` when the broker is unreachable.
The sink refuses at once a payload that conflicts with one it already wrote for the same call;
conflicts between processes are decided by the materializer, which fails closed.

``mark_incomplete`` is more available than ``put``: each marker is written to a local durable spill
(``marker_spill``) before it is sent, and stays there until the broker acknowledged it. When the broker cannot
be reached, ``mark_incomplete`` still returns once the marker is spilled, and the sink forwards it when the
broker answers again (``marker_forwarder``); a sink starting on the same spill directory forwards the markers
a crashed process left. Each marker carries an id the apply step applies once, so forwarding it again after a
lost acknowledgement changes nothing.
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
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError, ConflictingEntryError, DeliveryError, TransportError
from tokcap.log.checked_puts import accept_put
from tokcap.log.events import CancelEvent, Event, IncompleteEvent, IntentEvent, PutEvent
from tokcap.log.input_rules import check_call_id
from tokcap.log.records import TokenEntry, token_count
from tokcap.log.rollout_ids import validate_rollout_id
from tokcap.metrics import MARKERS_SPILLED, SENT_BYTES, sink_timed
from transports.kafka.client.limits_record import WriterLimits
from transports.kafka.client.producer_bridge import DEFAULT_DELIVERY_TIMEOUT_S, Delivered, ProducerBridge
from transports.kafka.client.topics import resolve_topic
from transports.kafka.wire.codec import DEFAULT_CHUNK_BYTES, OutgoingMessage, encode_event_messages
from transports.kafka.write.marker_forwarder import MarkerForwarder
from transports.kafka.write.marker_spill import (
    MarkerSpill,
    MarkerSpillError,
    SpilledMarker,
    default_spill_dir,
)
from transports.kafka.write.sent_calls import DEFAULT_REMEMBERED_TOKENS, SentCalls, encode_put

__all__ = [
    "DEFAULT_REMEMBERED_CALLS",
    "KafkaTokenSink",
    "default_writer_id",
    "logger",
]

logger = logging.getLogger(__name__)

DEFAULT_REMEMBERED_CALLS = 100_000
"""How many (rollout, call) digests a sink keeps to refuse conflicting payloads; oldest are forgotten first."""

_SENT = SENT_BYTES.labels("kafka")

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
        max_event_bytes: int | None = None,
        remembered_calls: int = DEFAULT_REMEMBERED_CALLS,
        spill_dir: str | Path | None = None,
        wire_deltas: bool = True,
        wire_delta_tokens: int = DEFAULT_REMEMBERED_TOKENS,
    ) -> None:
        """``spill_dir`` keeps incomplete markers the broker has not acknowledged yet, one sub-directory per
        topic (default ``$TOKCAP_SPILL_DIR``, else ``~/.cache/tokcap/spill``); use a local disk that outlives
        the process, shared by the sinks of one node so a new sink forwards what a crashed one left.

        ``wire_deltas`` sends a put whose prompt continues a call this sink already sent for the rollout as
        (parent link, suffix); readers restore the exact entry (docs/events.md). Readers must be upgraded
        first: older ones dead-letter such messages. ``wire_delta_tokens`` bounds the tokens remembered for it.

        The largest encoded put sent is the topic's ``max_event_bytes`` (``topic_limits``), read for the first
        event that needs chunks; a larger one raises ``EventTooLargeError`` and nothing is sent. ``max_event_bytes`` is
        deprecated: given, it is only checked against the topic's (``TopicLimitsMismatchError`` on a difference).
        """
        if not bootstrap_servers:
            raise ConfigError("bootstrap_servers must name at least one broker")
        if remembered_calls < 1:
            raise ConfigError(f"remembered_calls must be at least 1, got {remembered_calls}")
        if wire_delta_tokens < 0:
            raise ConfigError(f"wire_delta_tokens must not be negative, got {wire_delta_tokens}")
        self._sent = SentCalls(max_tokens=wire_delta_tokens) if wire_deltas and wire_delta_tokens else None
        self._topic = resolve_topic(run_id, topic)
        self._writer_id = writer_id or default_writer_id()
        self._chunk_bytes = chunk_bytes
        self._limits = WriterLimits(
            "KafkaTokenSink",
            bootstrap_servers,
            self._topic,
            client_config=producer_config,
            chunk_bytes=chunk_bytes,
            max_event_bytes=max_event_bytes,
            timeout_s=delivery_timeout_s,
        )
        self._session = uuid.uuid4().hex
        self._chunk_sequence = itertools.count()
        self._digests: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._digest_lock = threading.Lock()
        self._remembered_calls = remembered_calls
        self._bridge = ProducerBridge(
            bootstrap_servers, delivery_timeout_s=delivery_timeout_s, producer_config=producer_config
        )
        self._closed = False
        self._marker_sequence = itertools.count()
        self._spill = MarkerSpill(Path(spill_dir or default_spill_dir()) / self._topic, self._session)
        self._forwarder = MarkerForwarder(self._spill, self._forward)
        logger.info(
            "kafka token sink writing to topic %s on %s as %s",
            self._topic,
            bootstrap_servers,
            self._writer_id,
        )
        if self._spill.adopt_dead_sessions():
            self._forwarder.wake()

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

    async def _publish(
        self, event: Event, *, what: str, large: bool = False, entry_digest: str | None = None
    ) -> list[Delivered]:
        """Encode, send and await the acknowledgement of one event; a put may bring its entry's digest."""
        if self._limits.check_first:
            await asyncio.to_thread(self._limits.get)
        if large:
            messages = await asyncio.to_thread(self._encode, event, entry_digest)
        else:
            messages = self._encode(event, entry_digest)
        delivered = await self._bridge.send(self._topic, messages, what=what)
        _SENT.inc(sum(len(message.key) + len(message.value) for message in messages))
        return delivered

    def _encode(self, event: Event, entry_digest: str | None = None) -> list[OutgoingMessage]:
        """A put continuing a call this sink sent goes as one wire delta when it fits; all else as it is.

        The topic's limits are read for the first event that needs chunks (``WriterLimits``).
        """
        if isinstance(event, PutEvent):
            sent = self._sent
            return self._limits.encode(
                lambda limits: encode_put(
                    event,
                    sent,
                    chunk_bytes=self._chunk_bytes,
                    limits=limits,
                    next_chunk_group=self._next_chunk_group,
                    entry_digest=entry_digest,
                )
            )
        return self._limits.encode(
            lambda limits: encode_event_messages(
                event, chunk_bytes=self._chunk_bytes, limits=limits, next_chunk_group=self._next_chunk_group
            )
        )

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

    @sink_timed("kafka", "put")
    async def put(self, entry: TokenEntry) -> None:
        """Publish a call's entry and return once the broker acknowledged it; a Gym entry is taken as is.

        An entry whose encoded put is larger than ``max_event_bytes`` raises ``EventTooLargeError`` with
        nothing sent: the caller marks the rollout incomplete, as after any failed put.
        """
        event = accept_put(entry, self._writer_id)
        entry = event.entry
        rollout_id = validate_rollout_id(entry.rollout_id)
        call_id = entry.model_call_id
        digest = event.payload_digest
        added = self._reserve_digest(rollout_id, call_id, digest)
        tokens = token_count(entry)
        try:
            delivered = await self._publish(
                event,
                what=f"put of call {call_id!r} of rollout {rollout_id!r}",
                large=tokens > _LARGE_ENTRY_TOKENS,
                entry_digest=digest,
            )
        except BaseException:
            if added:
                self._forget_digest(rollout_id, call_id, digest)
            raise
        if self._sent is not None and len(delivered) == 1:
            # Acknowledged as one message: its partition and offset are a link every reader can follow.
            self._sent.remember(entry, delivered[0].partition, delivered[0].offset)

    @sink_timed("kafka", "intent")
    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Publish a call's intent before dispatch; a failure here stops the call before generation."""
        check_call_id(rollout_id, model_call_id)
        event = IntentEvent(rollout_id=rollout_id, writer=self._writer_id, model_call_id=model_call_id)
        await self._publish(event, what=f"intent of call {model_call_id!r} of rollout {rollout_id!r}")

    @sink_timed("kafka", "cancel")
    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Publish that a call ended without generation, closing its intent."""
        check_call_id(rollout_id, model_call_id)
        event = CancelEvent(rollout_id=rollout_id, writer=self._writer_id, model_call_id=model_call_id)
        await self._publish(event, what=f"cancel of call {model_call_id!r} of rollout {rollout_id!r}")

    @sink_timed("kafka", "mark")
    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Record that a call of the rollout failed to capture, so the rollout is masked.

        Returns once the broker acknowledged the marker, or, when it cannot be reached, once the marker is
        durable in the local spill (it is forwarded when the broker answers). Raises only when neither worked.
        """
        check_call_id(rollout_id, model_call_id, may_be_empty=True)
        what = f"incomplete marker of call {model_call_id!r} of rollout {rollout_id!r}"
        if self._closed:
            raise DeliveryError(f"{what} cannot be sent: the sink is closed")
        event = IncompleteEvent(
            rollout_id=rollout_id,
            writer=self._writer_id,
            model_call_id=model_call_id,
            reason=reason,
            marker_id=f"{self._session}-{next(self._marker_sequence)}",
        )
        self._forwarder.claim(event.marker_id)
        spilled: SpilledMarker | None = None
        acknowledged = False
        try:
            try:
                spilled = await asyncio.to_thread(self._spill.write, event)
            except MarkerSpillError as exc:
                spill_error: MarkerSpillError | None = exc
                logger.warning("%s is sent without a spill: %s", what, exc)
            else:
                spill_error = None
            try:
                await self._publish(event, what=what)
            except TransportError as exc:
                if spilled is None:
                    raise DeliveryError(
                        f"{what} could not be sent ({exc}) nor kept in the local spill ({spill_error})"
                    ) from exc
                logger.warning(
                    "%s is kept in %s until the broker answers: %s", what, self._spill.directory, exc
                )
                MARKERS_SPILLED.inc()
                return
            acknowledged = True
            if spilled is not None:
                self._spill.remove(spilled)
        finally:
            self._forwarder.release(event.marker_id)
            if not acknowledged:
                # Sent or not, spilled or still being written (a cancelled caller): the forwarder looks.
                self._forwarder.wake()

    async def _forward(self, event: IncompleteEvent) -> None:
        """Send one spilled marker as it was written (its writer may be a sink that is gone)."""
        what = f"spilled incomplete marker {event.marker_id} of rollout {event.rollout_id!r}"
        await self._publish(event, what=what)

    @property
    def spilled_markers(self) -> int:
        """How many incomplete markers wait in the local spill for the broker's acknowledgement."""
        return len(self._spill.pending())

    async def forward_spilled(self) -> int:
        """Try to forward every spilled marker now; return how many are still waiting (0 once all are in the log)."""
        return await asyncio.to_thread(self._forwarder.forward_pending)

    async def close(self) -> None:
        """Forward what is spilled if the broker answers, flush, stop the producer; calling it again is a no-op.

        Markers the broker does not take stay spilled; the next sink on this topic and spill directory
        forwards them.
        """
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._forwarder.stop, self._bridge.delivery_timeout_s + 10)
        if self._spill.pending():
            await self.forward_spilled()
        self._spill.close()
        await asyncio.to_thread(self._bridge.close)
