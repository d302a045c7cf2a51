"""One idempotent Kafka producer whose delivery reports resolve asyncio futures.

librdkafka reports deliveries from ``poll()``; a background thread polls, collects the reports of each
``poll()``, and hands them to each owning event loop with one ``call_soon_threadsafe``, which resolves
their futures.
Awaiting callers therefore never block the loop, and many concurrent sends share batches.
Failures are translated by ``transports.kafka.client.error_map``. A refused login or TLS handshake fails every
waiting send at once, instead of after ``delivery_timeout_s``, since retrying cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from tokcap.errors import ConfigError, DeliveryError, DeliveryTimeoutError
from transports.kafka.client.client_log import ClientLog
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, build_client
from transports.kafka.client.error_map import Delivery, authentication_failure, translated
from transports.kafka.wire.codec import OutgoingMessage

__all__ = [
    "DEFAULT_DELIVERY_TIMEOUT_S",
    "Delivered",
    "ProducerBridge",
    "logger",
]

logger = logging.getLogger(__name__)

DEFAULT_DELIVERY_TIMEOUT_S = 10.0
"""How long a send may wait for the broker's acknowledgement; librdkafka's own default is 300 s."""

_ANSWER_GRACE_S = 5.0
"""Extra time past librdkafka's own timeout before giving up on a delivery report that never came."""

_ENFORCED = {"enable.idempotence": True, "acks": "all"}
_DEFAULTS: dict[str, Any] = {"compression.type": "zstd", "linger.ms": 1}
"""Overridable defaults. Each rollout awaits its calls in sequence, so linger adds to every call's latency:
on the bench, 8 concurrent rollouts put 523/s with 5 ms of linger and 991/s with 1 ms, and 64 rollouts
were no slower (concurrent sends still share batches)."""
_TIMEOUT_KEYS = ("message.timeout.ms", "delivery.timeout.ms")


_Settled = tuple["asyncio.Future[Delivered]", KafkaError | None, "Delivered | None"]
"""One delivery report for its event loop: the future, and the error or where the message was stored."""


@dataclass(frozen=True)
class Delivered:
    """Where the broker stored an acknowledged message."""

    partition: int
    offset: int


def _resolve(
    future: asyncio.Future[Delivered], error: KafkaError | None, delivered: Delivered | None
) -> None:
    """Runs on the event loop: settle the future unless its caller already gave up."""
    if future.done():
        return
    if error is not None:
        future.set_exception(KafkaException(error))
    else:
        assert delivered is not None
        future.set_result(delivered)


class _ReportOverdueError(Exception):
    """Set on a send's pending reports when its bound passes; the send raises ``DeliveryTimeoutError``."""


def _fail_overdue(futures: Sequence[asyncio.Future[Delivered]]) -> None:
    """Runs on the event loop when a send's bound passed: fail the reports still pending."""
    for future in futures:
        if not future.done():
            future.set_exception(_ReportOverdueError())


def _abandon(futures: Sequence[asyncio.Future[Delivered]]) -> None:
    """A send given up (timed out or cancelled): its pending reports are cancelled, the settled ones read.

    A report settled with a failure nobody reads would be logged as never retrieved when collected.
    """
    for future in futures:
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()


def _resolve_all(reports: Sequence[_Settled]) -> None:
    """Runs on the event loop: settle the futures of one poll's reports, in the order they came."""
    for future, error, delivered in reports:
        _resolve(future, error, delivered)


class ProducerBridge:
    """A thread-safe idempotent producer whose ``send`` is awaitable."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        if delivery_timeout_s <= 0:
            raise ConfigError(f"delivery_timeout_s must be positive, got {delivery_timeout_s}")
        extra = dict(producer_config or {})
        for key, value in _ENFORCED.items():
            if key in extra and str(extra[key]).lower() != str(value).lower():
                raise ConfigError(f"producer_config may not change {key}; tokcap needs {key}={value}")
        if any(key in extra for key in _TIMEOUT_KEYS):
            raise ConfigError("set the delivery bound with delivery_timeout_s, not producer_config")
        self._delivery_timeout_s = delivery_timeout_s
        self._context = ClientContext(bootstrap_servers, extra)
        self._watch = AuthenticationWatch(self._context, also=self._on_error)
        # librdkafka reports the same connection error on every retry: log it rate-limited and scrubbed.
        self._error_log = ClientLog(self._context.redactor, target=logger)
        self._config: dict[str, Any] = self._context.settings(
            fixed={
                **_ENFORCED,
                "message.timeout.ms": int(delivery_timeout_s * 1000),
                "error_cb": self._watch,
            },
            defaults=_DEFAULTS,
        )
        self._produce_lock = threading.Lock()
        self._unposted_lock = threading.Lock()
        self._unposted: list[tuple[asyncio.AbstractEventLoop, _Settled]] = []
        """Reports served by ``poll()`` or ``flush()`` and not yet handed to their event loops."""
        self._fatal: KafkaError | None = None
        self._waiting: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Delivered]]] = set()
        self._producer = build_client(Producer, self._config, self._context, "producer")
        self._stopping = threading.Event()
        self._closed = False
        self._poller = threading.Thread(
            target=self._poll_forever, name="tokcap-kafka-producer-poll", daemon=True
        )
        self._poller.start()

    @property
    def delivery_timeout_s(self) -> float:
        """The bound on one acknowledgement."""
        return self._delivery_timeout_s

    def __repr__(self) -> str:
        """Names the broker only: producer settings may hold credentials."""
        return f"ProducerBridge(bootstrap={self._context.bootstrap!r})"

    def _on_error(self, error: KafkaError) -> None:
        """Client-level errors: a refused login fails every waiting send, a fatal one retires the producer."""
        refused = authentication_failure(error, self._context)
        if refused is not None:
            self._error_log.log(logging.ERROR, "kafka producer: %s", refused)
            with self._produce_lock:
                waiting, self._waiting = self._waiting, set()
            for loop, future in waiting:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve, future, error, None)
        elif error.fatal():
            self._fatal = error
            logger.error(
                "kafka producer hit a fatal error and will be recreated: %s", self._context.scrub(error.str())
            )
        else:
            self._error_log.log(logging.WARNING, "kafka producer: %s", error.str())

    def _poll_forever(self) -> None:
        while not self._stopping.is_set():
            producer = self._producer
            try:
                producer.poll(0.1)
            except KafkaException as exc:
                logger.error("kafka producer poll failed: %s", self._context.scrub(str(exc)))
            self._post_reports()

    def _on_delivery(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Delivered],
        error: KafkaError | None,
        message: Message,
    ) -> None:
        """Runs inside ``poll()`` or ``flush()``: keep the report until that call returns."""
        if error is None:
            delivered: Delivered | None = Delivered(int(message.partition() or 0), int(message.offset() or 0))
            self._watch.clear()  # the broker took a message, so the login works again
        else:
            delivered = None
        with self._unposted_lock:
            self._unposted.append((loop, (future, error, delivered)))

    def _post_reports(self) -> None:
        """Hand the reports collected so far to their event loops, one wake-up per loop.

        librdkafka serves every report ready at once (a batch acknowledged together), and each
        ``call_soon_threadsafe`` writes to the loop's pipe and costs the loop one more callback.
        """
        with self._unposted_lock:
            reports, self._unposted = self._unposted, []
        by_loop: dict[asyncio.AbstractEventLoop, list[_Settled]] = {}
        for loop, settled in reports:
            by_loop.setdefault(loop, []).append(settled)
        for loop, reports_of_loop in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_all, reports_of_loop)
            except RuntimeError:
                logger.debug(
                    "%d delivery reports arrived after their event loop closed", len(reports_of_loop)
                )

    def _producer_for_send(self) -> Producer:
        """The live producer; a producer that hit a fatal error is replaced first (its messages already failed)."""
        if self._fatal is not None:
            old, self._producer = (
                self._producer,
                build_client(Producer, self._config, self._context, "producer"),
            )
            self._fatal = None
            old.flush(0)
            self._post_reports()
        return self._producer

    async def send(self, topic: str, messages: Sequence[OutgoingMessage], *, what: str) -> list[Delivered]:
        """Produce the messages in order and return once the broker acknowledged all of them.

        Raises ``DeliveryTimeoutError`` when the bound passes, ``DeliveryError`` on any other failure.
        """
        if self._closed:
            raise DeliveryError(f"{what} cannot be sent: the Kafka producer is closed")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Delivered]] = []
        sent = Delivery(what, topic)
        with self._produce_lock, translated(self._context, sent):
            # Checked under the lock that _on_error takes: a send either sees the failure or is failed by it.
            self._watch.raise_if_failed()
            producer = self._producer_for_send()
            for message in messages:
                future: asyncio.Future[Delivered] = loop.create_future()
                producer.produce(
                    topic,
                    value=message.value,
                    key=message.key,
                    headers=list(message.headers),
                    on_delivery=partial(self._on_delivery, loop, future),
                    # -1 is librdkafka's "let the partitioner choose".
                    partition=-1 if message.partition is None else message.partition,
                )
                futures.append(future)
                self._waiting.add((loop, future))
        outcomes = await self._reports(loop, futures, what=what, topic=topic)
        delivered: list[Delivered] = []
        with translated(self._context, sent):
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
                delivered.append(outcome)
        return delivered

    async def _reports(
        self,
        loop: asyncio.AbstractEventLoop,
        futures: list[asyncio.Future[Delivered]],
        *,
        what: str,
        topic: str,
    ) -> list[Delivered | BaseException]:
        """Every future's report, in order, failures included; the reports are waited for under one bound.

        The futures are awaited one after another, not through ``wait_for(gather(...))``: each layer of those
        settles on a later turn of the event loop, and under load a turn takes milliseconds, so an
        acknowledgement reached its caller three turns after its report, where a plain await takes one.
        """
        outcomes: list[Delivered | BaseException] = []
        bound = self._delivery_timeout_s + _ANSWER_GRACE_S
        # One timer for the send, which fails its pending reports when it fires: cheaper than a timeout scope,
        # which cancels the waiting task and turns the cancellation back into a timeout.
        overdue = loop.call_at(loop.time() + bound, _fail_overdue, futures)
        finished = False
        try:
            for future in futures:
                try:
                    outcomes.append(await future)
                except KafkaException as exc:
                    outcomes.append(exc)
            finished = True
        except _ReportOverdueError as exc:
            raise DeliveryTimeoutError(
                f"{what} got no delivery report within {bound:.0f} s for topic {topic!r}"
            ) from exc
        finally:
            overdue.cancel()
            self._forget(loop, futures)
            if not finished:
                _abandon(futures)
        return outcomes

    def _forget(self, loop: asyncio.AbstractEventLoop, futures: Sequence[asyncio.Future[Delivered]]) -> None:
        with self._produce_lock:
            for future in futures:
                self._waiting.discard((loop, future))

    def close(self, timeout_s: float | None = None) -> int:
        """Flush, stop polling and return how many messages were still undelivered; idempotent."""
        if self._closed:
            return 0
        self._closed = True
        wait_s = self._delivery_timeout_s if timeout_s is None else timeout_s
        if self._watch.failure is not None:
            wait_s = (
                0.0  # refused by the broker: nothing queued can be delivered, and its senders already failed
            )
        remaining = int(self._producer.flush(wait_s))
        self._stopping.set()
        self._poller.join()
        self._post_reports()  # what the flush served after the poll thread's last round
        if remaining:
            logger.error(
                "kafka producer closed with %d undelivered messages; their senders saw a failure", remaining
            )
        return remaining
