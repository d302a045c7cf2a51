"""Engine-side staging over a run topic: Gym's ``StagingSink``, ``StagingSource`` and ``CaptureLedger``.

A staged call is a ``stage`` event and a ledger row a ``ledger`` or ``ledger-failure`` event, keyed by the
rollout id on the run topic like every other event. The stage's value (the ``staged`` encoding) carries its
row, extras and attachments. On a topic whose limits record names a staged-payload topic (every topic
``ensure_topic`` makes now) that value goes there in pieces and the run topic gets a small reference to it
(``wire.staged_payloads``), so readers of ledger rows never fetch staged bytes; on an older topic it goes
inline, as chunk messages the inbound router reassembles and checks, all or nothing. ``stage`` returns ok
once the broker acknowledged every message with ``acks=all``. The materializer applies the events with the
same rules as the file store and projects them into a store directory, which the source and the ledger read
once it has applied the rollout's partition up to its end (``caught_up``).

What a stage cannot know from the broker's acknowledgement alone: a different payload staged under the
same key by another process, or a stage of a rollout retired meanwhile. The store keeps the first row,
dead-letters the refused stage and masks the rollout, so it is never trained on. The caller learns it before
the call commits: the ledger row Gym's model server writes next waits for the store's verdict, and the rules
refuse a row that commits a staged digest other than the one kept, or any row of a retired rollout. A sink
given a ``store_dir`` learns it at ``stage`` already. Within one process the sink refuses a different
payload under a key it already staged at once; before refusing it asks its projection, or else the log after
the row it remembers (``removals``), so a delete frees the key and a retire refuses as the fence does.

The ledger (``KafkaCaptureLedger``) lives in ``ledger``, which the lineage resolver uses too; it stays
nameable from here.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from confluent_kafka import Consumer

from tokcap.errors import (
    ConfigError,
    EventTooLargeError,
    StagingKeyNotFoundError,
    TransportError,
)
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import ledger_failure_event
from tokcap.log.events import Event, StagedBlob, StageEvent
from tokcap.log.hashing import sha256_hex
from tokcap.metrics import SENT_BYTES, source_timed, stage_timed
from tokcap.staging.file_sink import attachment_bytes, staged_record_from
from tokcap.staging.file_source import FileStagingSource
from tokcap.staging.gym_types import build
from tokcap.staging.journal import REFUSED_STAGE_REASON, JournalCursor, kafka_cursor
from tokcap.staging.records import staging_key
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, open_reader
from transports.kafka.client.limits_record import WriterLimits
from transports.kafka.client.producer_bridge import Delivered, ProducerBridge
from transports.kafka.client.removals import Removal, removal_after
from transports.kafka.client.topics import resolve_topic
from transports.kafka.ledger import DEFAULT_STAGE_TIMEOUT_S, KafkaCaptureLedger
from transports.kafka.materializer.caught_up import CaughtUpStore, end_offsets
from transports.kafka.private_projection import (
    LEDGER_SKIPPED_TYPES,
    PROJECTION,
    PrivateProjection,
)
from transports.kafka.sink import default_writer_id
from transports.kafka.wire.codec import DEFAULT_CHUNK_BYTES, OutgoingMessage, encode_event_messages
from transports.kafka.wire.staged_payloads import encode_staged_payload, encode_staged_reference
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = [
    "DEFAULT_STAGE_TIMEOUT_S",
    "LEDGER_SKIPPED_TYPES",
    "KafkaCaptureLedger",
    "KafkaStagingSink",
    "KafkaStagingSource",
]

_REMEMBERED_KEYS = 200_000
"""Staged keys whose row digest a process remembers, to refuse a different payload under one at once."""

_T = TypeVar("_T")

_CONNECTION_PREFIXES = ("security.", "sasl.", "ssl.", "socket.", "client.", "broker.")


def _connection_settings(producer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``producer_config`` that say how to reach and log in to the broker, for a reader."""
    return {name: value for name, value in producer_config.items() if name.startswith(_CONNECTION_PREFIXES)}


_SENT = SENT_BYTES.labels("kafka")


class _LoopThread:
    """One event loop in a daemon thread, so synchronous callers (Gym's completion threads) can await a send."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, awaitable: Awaitable[_T], timeout_s: float) -> _T:
        future: Future[_T] = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()


async def _awaited(awaitable: Awaitable[_T]) -> _T:
    return await awaitable


@dataclass(frozen=True)
class _Staged:
    """A row this process staged under a key: its digest, and where it landed (``None`` while in flight)."""

    digest: str
    landed: Delivered | None = None


class _StagedDigests:
    """Per topic and staging key, the row staged ok in this process (bounded, oldest forgotten).

    It lets a sink refuse a different payload under a key at once. It is a memory, not the truth: a delete
    frees the key and a retire fences it, so a sink asks the log (or its projection) before it refuses.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: OrderedDict[tuple[str, str], _Staged] = OrderedDict()

    def claim(self, topic: str, key: str, digest: str) -> _Staged | None:
        """Claim the key for this digest and return ``None``; if a row is remembered there, return it instead."""
        with self._lock:
            known = self._rows.get((topic, key))
            if known is not None:
                return known
            self._rows[(topic, key)] = _Staged(digest)
            while len(self._rows) > _REMEMBERED_KEYS:
                self._rows.popitem(last=False)
            return None

    def replace(self, topic: str, key: str, stale: _Staged, digest: str) -> bool:
        """Claim a key whose remembered row ``stale`` was removed from the log; ``False`` if it changed since."""
        with self._lock:
            if self._rows.get((topic, key)) is not stale:
                return False
            self._rows[(topic, key)] = _Staged(digest)
            return True

    def settle(self, topic: str, key: str, digest: str, landed: Delivered) -> None:
        """Remember where the row with this digest landed, the position a later check reads the log from."""
        with self._lock:
            known = self._rows.get((topic, key))
            if known is not None and known.digest == digest:
                self._rows[(topic, key)] = _Staged(digest, landed)

    def forget(self, topic: str, key: str, digest: str) -> None:
        with self._lock:
            known = self._rows.get((topic, key))
            if known is not None and known.digest == digest:
                del self._rows[(topic, key)]


_staged_digests = _StagedDigests()


class KafkaStagingSink:
    """Stage calls durably on a run topic; thread-safe and synchronous, constructible without a broker.

    Nameable by a framework worker as ``transports.kafka.staging:KafkaStagingSink``.
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        run_id: str | None = None,
        topic: str | None = None,
        delivery_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
        writer_id: str | None = None,
        producer_config: Mapping[str, Any] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        store_dir: str | Path | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        max_event_bytes: int | None = None,
    ) -> None:
        """The topic's ``max_event_bytes`` (``topic_limits``, read for the first stage that needs chunks) bounds
        a stage's encoded size, row, extras and attachments together: a larger stage fails at once, naming both
        sizes, and sends nothing. ``max_event_bytes`` is deprecated: given, it is only checked against the topic's.

        ``store_dir`` (a directory of this process's own) makes ``stage`` also wait until the materializer
        applied the stage and answer with the store's verdict: a different payload already staged under the
        key by any process, or a retired rollout, then fails the stage instead of being dead-lettered after
        an ok. It costs the apply's latency on every stage.
        """
        if not bootstrap_servers:
            raise ConfigError("bootstrap_servers must name at least one broker")
        self._topic = resolve_topic(run_id, topic)
        self._writer_id = writer_id or default_writer_id()
        self._chunk_bytes = chunk_bytes
        self._limits = WriterLimits(
            "KafkaStagingSink",
            bootstrap_servers,
            self._topic,
            client_config=consumer_config or producer_config,
            chunk_bytes=chunk_bytes,
            max_event_bytes=max_event_bytes,
            timeout_s=delivery_timeout_s,
        )
        self._session = uuid.uuid4().hex
        self._chunk_sequence = itertools.count()
        self._bridge = ProducerBridge(
            bootstrap_servers, delivery_timeout_s=delivery_timeout_s, producer_config=producer_config
        )
        self._delivery_timeout_s = delivery_timeout_s
        self._bootstrap_servers = bootstrap_servers
        self._reader_config = (
            dict(consumer_config)
            if consumer_config is not None
            else _connection_settings(producer_config or {})
        )
        self._loop = _LoopThread("tokcap-staging-sink")
        self._projection: CaughtUpStore | None = None
        if store_dir is not None:
            self._projection = CaughtUpStore(
                bootstrap_servers=bootstrap_servers,
                topic=self._topic,
                store_dir=store_dir,
                consumer_config=consumer_config,
            )
        self._store_dir = None if store_dir is None else Path(store_dir)
        self._asker_context = ClientContext(bootstrap_servers, dict(consumer_config or {}))
        self._asker: tuple[Consumer, AuthenticationWatch] | None = None
        self._asker_lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        """Names the topic only: producer settings may hold credentials."""
        return f"KafkaStagingSink(topic={self._topic!r}, writer_id={self._writer_id!r})"

    def _next_chunk_group(self) -> str:
        return f"{self._session}:{next(self._chunk_sequence)}"

    @stage_timed("kafka")
    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Make one staged call durable on the topic and return a ``StageResult`` with its key.

        Ok only once the broker acknowledged every byte of it (``acks=all``); an unreachable broker fails the
        call within ``delivery_timeout_s``. Input that is no valid staged record raises ``InvalidInputError``.
        """
        staged = staged_record_from(record)
        rollout_id, call_id = staged.rollout_id, staged.model_call_id
        blobs = attachment_bytes(rollout_id, call_id, attachments or {})
        key = staging_key(rollout_id, call_id)
        carried: dict[str, bytes] = {}

        def blob(data: bytes) -> StagedBlob:
            sha = hashlib.sha256(data).hexdigest()
            carried[sha] = data
            return StagedBlob(sha256=sha, size=len(data))

        extras = None if staged.extras is None else blob(orjson.dumps(staged.extras))
        event = StageEvent(
            rollout_id=rollout_id,
            writer=self._writer_id,
            staging_key=key,
            model_call_id=call_id,
            row=staged.model_dump(mode="json", exclude={"extras"}),
            extras=extras,
            attachments={name: blob(data) for name, data in blobs.items()},
        ).with_blob_bytes(carried)
        if self._limits.check_first:
            try:
                self._limits.get()
            except TransportError as exc:
                return build("StageResult", {"ok": False, "error": f"staging {key!r} failed: {exc}"})
        digest = sha256_hex(event.stored_line)
        known = _staged_digests.claim(self._topic, key, digest)
        claimed = known is None
        try:
            if known is not None and known.digest != digest:
                refused = self._refusal_from_memory(event, digest, known)
                if refused is not None:
                    return build("StageResult", {"ok": False, "error": refused})
                # The remembered row was removed by a delete: the key is free again, unless another thread of
                # this process staged under it meanwhile.
                claimed = _staged_digests.replace(self._topic, key, known, digest)
                newer = None if claimed else _staged_digests.claim(self._topic, key, digest)
                claimed = claimed or newer is None
                if newer is not None and newer.digest != digest:
                    error = f"{key!r} was already staged with a different payload; the first one stands"
                    return build("StageResult", {"ok": False, "error": error})
            last = self._send(event, f"stage of {key!r}")
            refused = None if self._projection is None else self._verdict(event, digest, last)
        except (TransportError, ConfigError, FutureTimeoutError, EventTooLargeError) as exc:
            if claimed:
                _staged_digests.forget(self._topic, key, digest)
            return build("StageResult", {"ok": False, "error": f"staging {key!r} failed: {exc}"})
        if refused is not None:
            if claimed:
                _staged_digests.forget(self._topic, key, digest)
            return build("StageResult", {"ok": False, "error": refused})
        _staged_digests.settle(self._topic, key, digest, last)
        return build("StageResult", {"ok": True, "staging_key": key})

    def _refusal_from_memory(self, event: StageEvent, digest: str, known: _Staged) -> str | None:
        """Why a key this process staged another payload under refuses the stage now, or ``None`` if it is free.

        The memory answers only while it is true: the projection, or else the log after the remembered row,
        says whether the rollout was deleted (the key is free) or retired (its fence refuses) since. An
        identical repeat is sent without asking: it is a no-op where the row stands and restores it where a
        delete removed it.
        """
        key, rollout_id = event.staging_key, event.rollout_id
        different = f"{key!r} was already staged with a different payload; the first one stands"
        retired = f"rollout {rollout_id!r} is retired; its fence refused the stage of {key!r}"
        if known.landed is None:
            # Still being sent by another thread of this process: nothing can have removed it yet.
            return different
        if self._projection is not None:
            self._projection.catch_up(rollout_id)
            state = self._projection.store.read_state(rollout_id)
            slot = state.staged.get(key)
            if slot is not None:
                return None if slot.digest == digest else different
            return retired if state.retired else None
        removal = removal_after(
            self._bootstrap_servers,
            self._topic,
            rollout_id,
            known.landed.partition,
            known.landed.offset,
            client_config=self._reader_config,
            timeout_s=self._delivery_timeout_s,
        )
        if removal is Removal.RETIRED:
            return retired
        return None if removal is Removal.DELETED else different

    def _send(self, event: Event, what: str) -> Delivered:
        """Send the event's messages; return where the last one (the one the store applies) landed.

        A stage on a topic with a staged-payload topic sends its bytes there first and, once they are
        acknowledged, its reference to the run topic (``staged_payloads``); each send has its own timeout.
        """
        if self._closed:
            raise TransportError(f"{self!r} is closed; {what} was not sent")
        if isinstance(event, StageEvent):
            limits = self._limits.get()
            if limits.staged_payload_topic is not None:
                return self._send_apart(event, limits.staged_payload_topic, limits, what)
        messages = self._limits.encode(
            lambda limits: encode_event_messages(
                event, chunk_bytes=self._chunk_bytes, limits=limits, next_chunk_group=self._next_chunk_group
            )
        )
        return self._deliver(self._topic, messages, what)[-1]

    def _send_apart(self, event: StageEvent, payload_topic: str, limits: TopicLimits, what: str) -> Delivered:
        """Send a stage's bytes to the payload topic, then the reference naming where they landed."""
        payload = encode_staged_payload(event, chunk_bytes=self._chunk_bytes, limits=limits)
        landed = self._deliver(payload_topic, payload.pieces, f"payload of the {what}")
        partitions = {delivered.partition for delivered in landed}
        if len(partitions) != 1:
            raise TransportError(
                f"the pieces of the {what} landed in partitions {sorted(partitions)} of {payload_topic!r}, not "
                "one; was the payload topic's partition count changed? Nothing refers to them"
            )
        reference = encode_staged_reference(
            event, payload, payload_topic, partitions.pop(), [delivered.offset for delivered in landed]
        )
        return self._deliver(self._topic, [reference], what)[-1]

    def _deliver(self, topic: str, messages: list[OutgoingMessage], what: str) -> list[Delivered]:
        """Send messages to ``topic``; return where each landed once the broker acknowledged all of them."""
        # The bridge fails the send within the delivery timeout; the margin only guards a stuck loop.
        sent = self._loop.run(self._bridge.send(topic, messages, what=what), self._delivery_timeout_s + 5.0)
        _SENT.inc(sum(len(message.key) + len(message.value) for message in messages))
        return sent

    def _verdict(self, event: StageEvent, digest: str, last: Delivered) -> str | None:
        """Why the store refused the stage applied at ``last``, or ``None`` when it holds exactly this row."""
        assert self._projection is not None
        self._projection.wait_applied(last.partition, last.offset, event.rollout_id)
        state = self._projection.store.read_state(event.rollout_id)
        slot = state.staged.get(event.staging_key)
        if slot is not None and slot.digest == digest:
            return None
        if state.retired:
            return f"rollout {event.rollout_id!r} is retired; its fence refused the stage of {event.staging_key!r}"
        return f"{event.staging_key!r} was already staged with a different payload; the first one stands"

    def journal_cursor(self, label: str) -> JournalCursor:
        """The end offset of every partition of the topic now (``tokcap.staging.journal``); it writes nothing.

        It asks the broker with ``consumer_config``'s settings (a secured broker needs them).
        """
        with self._asker_lock:
            if self._closed:
                raise TransportError(f"{self!r} is closed; no cursor was taken")
            if self._asker is None:
                watch = AuthenticationWatch(self._asker_context)
                reader = open_reader(self._asker_context, self._topic, purpose="staging-cursor", watch=watch)
                self._asker = (reader, watch)
            reader, watch = self._asker
            ends = end_offsets(reader, watch, self._asker_context, self._topic, self._delivery_timeout_s)
        return kafka_cursor(self._topic, label, ends)

    def record_refusal(self, rollout_id: str, model_call_id: str) -> None:
        """Record that a stage journaled here was not ok, as the failure row Gym's model server records for it.

        Returns once the broker acknowledged the row; raises ``TransportError`` when it did not.
        """
        event = ledger_failure_event(rollout_id, model_call_id, REFUSED_STAGE_REASON).model_copy(
            update={"writer": self._writer_id}
        )
        self._send(event, f"refusal of the stage of call {model_call_id!r}")

    def journal_dir(self) -> Path | None:
        """The ``store_dir`` this sink was given, where cursors taken on it are recorded; else ``None``."""
        return self._store_dir

    def close(self) -> None:
        """Flush what is in flight and close the producer; calling it again is a no-op."""
        with self._asker_lock:
            if self._closed:
                return
            self._closed = True
            asker, self._asker = self._asker, None
        self._bridge.close()
        self._loop.close()
        if self._projection is not None:
            self._projection.close()
        if asker is not None:
            asker[0].close()


class KafkaStagingSource:
    """Fetch staged calls by key from the run topic's projection in ``store_dir``, in any process.

    A staged row is write-once, so a key found in the projection is answered at once; a key not found yet
    is answered after the materializer applied the rollout's partition up to its end, and raises only then.
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        store_dir: str | Path | None = None,
        run_id: str | None = None,
        topic: str | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Without ``store_dir`` the projection lives in a directory this process makes for itself and removes
        at ``close`` (``tokcap.files.private_dirs``), shared by this process's sources of the topic.
        """
        self._topic = resolve_topic(run_id, topic)
        self._private = PrivateProjection.take(store_dir, PROJECTION, bootstrap_servers, self._topic)
        try:
            self._projection = CaughtUpStore(
                bootstrap_servers=bootstrap_servers,
                topic=self._topic,
                store_dir=self._private.store_dir,
                consumer_config=consumer_config,
                timeout_s=timeout_s,
            )
        except BaseException:
            self._private.release()
            raise
        self._files = FileStagingSource(self._private.store_dir)

    def __repr__(self) -> str:
        return f"KafkaStagingSource(topic={self._topic!r})"

    def _current(self, read: Callable[[list[str]], _T], keys: list[str]) -> _T:
        """Read from the projection; a missing key's rollout is caught up once, then the read is tried again."""
        caught_up: set[str] = set()
        while True:
            try:
                return read(keys)
            except StagingKeyNotFoundError as exc:
                if exc.rollout_id is None or exc.rollout_id in caught_up:
                    raise
                caught_up.add(exc.rollout_id)
                self._projection.catch_up(exc.rollout_id)

    @source_timed("kafka", "fetch")
    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One ``StagedCallBaseSnapshot`` per key, in order, without extras; a missing key raises."""
        return self._current(self._files.fetch, list(staging_keys))

    def fetch_full(self, staging_keys: list[str]) -> list[Any]:
        """One ``StagedCallSnapshot`` per key, in order, with its extras exactly as staged."""
        return self._current(self._files.fetch_full, list(staging_keys))

    def fetch_attachments(self, staging_key: str) -> dict[str, bytes]:
        """The attachments staged with the call, by name, as the bytes given (``{}`` when none)."""
        return self._current(lambda keys: self._files.fetch_attachments(keys[0]), [staging_key])

    def journal_store(self) -> TokenCaptureStore:
        """The projection a restage reads (``tokcap.staging.journal``), once it holds every partition up to its end."""
        self._projection.catch_up_all()
        return self._projection.store

    def journal_topic(self) -> str:
        """The run topic: a cursor taken on another topic is refused."""
        return self._topic

    def close(self) -> None:
        """Hand the materializer back (and the private directory); calling it again is a no-op."""
        self._projection.close()
        self._private.release()
