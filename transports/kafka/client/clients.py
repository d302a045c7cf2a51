"""Kafka clients as tokcap builds them: who they are, their settings, and the watch on their logins.

Every Kafka client tokcap builds (producer, consumers, admin) is described by a ``ClientContext``: the
bootstrap address and the caller's settings. The context builds the client's configuration (with
librdkafka's log routed through ``ClientLog``) and names the broker, the principal and the SASL mechanism in
errors, while its ``Redactor`` keeps every configured value out of them. ``build_client`` constructs a client
and ``AuthenticationWatch`` is the error callback that ends a wait as soon as a login is refused; both turn
librdkafka's errors into tokcap's through ``error_map``, the one place that decides which error is which.

``open_reader`` opens every private reader of a run topic (a consumer that reads the positions it is given and
commits nothing) with the same settings, and ``assign_reader`` gives one its partitions and waits until the
handle knows their leaders; ``list_topics`` is the metadata wait that a refused login ends early.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from tokcap.errors import TransportError
from transports.kafka.client.client_log import ClientLog
from transports.kafka.client.error_map import (
    Construction,
    Request,
    authentication_failure,
    kafka_error_of,
    scrubbed_cause,
    translated,
)
from transports.kafka.wire.redaction import Redactor, is_secret_key

__all__ = [
    "REFUSAL_FRESH_S",
    "AuthenticationWatch",
    "ClientContext",
    "Reset",
    "assign_reader",
    "build_client",
    "list_topics",
    "open_reader",
]

_KNOWN_MECHANISMS = frozenset({"PLAIN", "GSSAPI", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"})
_KNOWN_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})

_Client = TypeVar("_Client")


@dataclass(frozen=True, repr=False)
class ClientContext:
    """What tokcap knows about one client: where it connects and the caller's (possibly secret) settings."""

    bootstrap: str
    config: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """Names the broker only: the settings may hold credentials."""
        return f"ClientContext(bootstrap={self.bootstrap!r})"

    @property
    def redactor(self) -> Redactor:
        """Scrubs this client's configured values from librdkafka's text."""
        return Redactor(self.config)

    def settings(
        self, fixed: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The librdkafka configuration: defaults, the caller's settings, tokcap's fixed ones, log routing."""
        return {
            **dict(defaults or {}),
            **dict(self.config),
            **dict(fixed or {}),
            "logger": ClientLog(self.redactor),
            "bootstrap.servers": self.bootstrap,
        }

    @property
    def mechanism(self) -> str:
        """The SASL mechanism as configured, or a placeholder when the value is not a mechanism's name."""
        for key in ("sasl.mechanism", "sasl.mechanisms"):
            value = str(self.config.get(key, "")).strip()
            if value:
                return value if value.upper() in _KNOWN_MECHANISMS else f"(unrecognised value of {key})"
        return "GSSAPI (librdkafka's default)"

    @property
    def principal(self) -> str:
        """The principal the broker sees, as its ACLs name it, when the settings say; never a secret.

        A SASL login is ``User:<sasl.username>``. The name is shown only when it is not also the value of a
        key that names a secret (a password typed into the wrong field).
        """
        username = self.config.get("sasl.username")
        if isinstance(username, str) and username.strip():
            secrets = {str(value) for key, value in self.config.items() if is_secret_key(key)}
            if username not in secrets:
                return f"User:{username.strip()}"
        return "the client's principal"

    @property
    def security_protocol(self) -> str:
        """The configured security protocol, shown only when it is one of the four valid names."""
        value = str(self.config.get("security.protocol", "PLAINTEXT")).strip()
        return value if value.upper() in _KNOWN_PROTOCOLS else "(unrecognised security.protocol)"

    def scrub(self, text: str) -> str:
        """``text`` without any configured value that could be a secret."""
        return self.redactor.scrub(text)


def build_client(
    factory: Callable[[dict[str, Any]], _Client], settings: dict[str, Any], context: ClientContext, what: str
) -> _Client:
    """Construct a confluent-kafka client; a refused setting becomes a ``ConfigError`` naming the property."""
    with translated(context, Construction(what)):
        return factory(settings)


REFUSAL_FRESH_S = 10.0
"""How long a refused login fails new requests at once. librdkafka retries a refused login at least every
10 s (its ``reconnect.backoff.max.ms``) and reports each refusal again, so a lasting refusal stays fresh; once the
credential is valid again the reports stop and requests go through without a restart."""


class AuthenticationWatch:
    """An ``error_cb`` that remembers the latest refused login or TLS handshake, so waits can end early.

    librdkafka reports a refused login only through the error callback and keeps retrying; without this a
    request waits out its whole timeout and then says only that no broker answered. A refusal is held only
    while it is fresh: a password rotated back or an ACL granted again must not leave a client refusing work
    until it is restarted.
    """

    def __init__(
        self,
        context: ClientContext,
        also: Callable[[KafkaError], None] | None = None,
        *,
        fresh_s: float = REFUSAL_FRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self._also = also
        self._fresh_s = fresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failure: TransportError | None = None
        self._cause: KafkaException | None = None
        self._seen_at = 0.0

    def __repr__(self) -> str:
        """Says whether a fresh failure is held."""
        return f"AuthenticationWatch(failed={self.failure is not None})"

    def __call__(self, error: KafkaError) -> None:
        """librdkafka's error callback."""
        failure = authentication_failure(error, self._context)
        if failure is not None:
            cause = scrubbed_cause(error, self._context)
            with self._lock:
                self._failure, self._cause, self._seen_at = failure, cause, self._clock()
        if self._also is not None:
            self._also(error)

    def _fresh(self) -> tuple[TransportError | None, KafkaException | None]:
        with self._lock:
            if self._failure is not None and self._clock() - self._seen_at > self._fresh_s:
                self._failure = self._cause = None
            return self._failure, self._cause

    @property
    def failure(self) -> TransportError | None:
        """The translated failure while it is fresh, else ``None``."""
        if self._failure is None:  # the common case, without the lock
            return None
        return self._fresh()[0]

    def clear(self) -> None:
        """Forget the refusal: something the broker accepted since proves the login works again."""
        if self._failure is None:
            return
        with self._lock:
            self._failure = self._cause = None

    def raise_if_failed(self) -> None:
        """Raise the fresh failure, if any, chained to the scrubbed librdkafka error."""
        if self._failure is None:
            return
        failure, cause = self._fresh()
        if failure is not None:
            raise type(failure)(str(failure)) from cause


_METADATA_SLICE_S = 0.5
"""How often a metadata wait checks whether the broker refused the login meanwhile."""

_RETRIED = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT})
"""A metadata slice that failed so is asked again until the wait's deadline: the broker may still answer."""


def _hands_out_messages(client: AdminClient | Consumer) -> bool:
    """Whether the client's ``poll`` could take a fetched message: a consumer with partitions assigned.

    An admin client's ``poll`` only serves callbacks, and so does a consumer's while nothing is assigned to it.
    Once it reads, a consumer's ``poll`` hands out the next fetched message as well, which its reader then never
    sees: a read of the log stalled on it, or went on without it. Such a consumer is not polled; its reader's
    next read serves its callbacks.
    """
    assignment = getattr(client, "assignment", None)
    return assignment is not None and bool(assignment())


def list_topics(
    client: AdminClient | Consumer,
    watch: AuthenticationWatch,
    context: ClientContext,
    timeout_s: float,
    topic: str | None = None,
) -> Any:
    """The cluster metadata, waiting in short slices so a refused login ends the wait within a second.

    librdkafka reports a refused login only to the error callback, which runs from ``poll``; a single
    ``list_topics(timeout)`` would wait the whole timeout and then only say that no broker answered. A reader
    (``_hands_out_messages``) is not polled, so it is asked once for the whole wait: its request waits behind a
    fetch in flight (the broker answers a connection's requests in order, and a fetch at the end of a partition
    waits up to ``fetch.wait.max.ms``), which would time out short slices one after the other.
    """
    reader = _hands_out_messages(client)
    deadline = time.monotonic() + timeout_s
    doing = "read the cluster metadata" if topic is None else f"read the metadata of {topic!r}"
    with translated(context, Request(doing, timeout_s)):
        while True:
            watch.raise_if_failed()
            remaining = deadline - time.monotonic()
            wait_s = max(0.05, remaining if reader else min(_METADATA_SLICE_S, remaining))
            try:
                if topic is None:
                    return client.list_topics(timeout=wait_s)
                return client.list_topics(topic=topic, timeout=wait_s)
            except KafkaException as exc:
                error = kafka_error_of(exc)
                retryable = error is not None and error.code() in _RETRIED
                if not reader:
                    client.poll(0)
                watch.raise_if_failed()
                if not retryable or time.monotonic() >= deadline:
                    raise


Reset = Literal["error", "earliest"]
"""What a reader does when its offset is no longer in the log: fail (``error``), or start at the first one
still held (``earliest``, for a reader that asked for the first held offset itself). Never ``latest``, which
would skip what is there without a word."""


def open_reader(
    context: ClientContext,
    topic: str,
    assignment: Mapping[int, int] | None = None,
    *,
    purpose: str,
    watch: AuthenticationWatch,
    timeout_s: float = 30.0,
    reset: Reset = "error",
    fixed: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    factory: Callable[[dict[str, Any]], Consumer] = Consumer,
) -> Consumer:
    """A private reader of ``topic``: a consumer of a group of its own that commits nothing.

    With ``assignment`` (partition to first offset), it is assigned there and knows their leaders when it is
    returned (``assign_reader``); without, it is assigned later, or only asks the broker questions (offsets,
    metadata). ``purpose`` names its group (``tokcap-<purpose>-<random>``), so the broker's view of its
    clients says who reads. ``watch`` is its error callback: a refused login ends its waits at once.
    ``fixed`` settings win over the caller's, ``defaults`` give way to them. ``factory`` builds the consumer
    from its settings (a test passes a topic double).
    """
    settings = context.settings(
        {
            **dict(fixed or {}),
            "group.id": f"tokcap-{purpose}-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": reset,
            "error_cb": watch,
        },
        defaults=defaults,
    )
    consumer = build_client(factory, settings, context, "consumer")
    if assignment is not None:
        try:
            assign_reader(consumer, context, watch, topic, assignment, timeout_s)
        except BaseException:
            consumer.close()
            raise
    return consumer


def assign_reader(
    consumer: Consumer,
    context: ClientContext,
    watch: AuthenticationWatch,
    topic: str,
    assignment: Mapping[int, int],
    timeout_s: float,
    *,
    incremental: bool = False,
) -> None:
    """Assign the reader these partitions at these offsets, then teach the handle their leaders.

    librdkafka learns the leaders of a topic first assigned on a handle only at its next topic scan, up to a
    second later, and fetches nothing until then; asking for the topic's metadata on the handle right after
    the assignment starts the fetches at once. ``incremental`` adds to what the handle already reads. When the
    metadata cannot be read the assignment is taken back, so a caller that tries again assigns again.
    """
    wanted = [TopicPartition(topic, partition, offset) for partition, offset in sorted(assignment.items())]
    with translated(context, Request(f"assign partitions {sorted(assignment)} of {topic!r}", timeout_s)):
        if incremental:
            consumer.incremental_assign(wanted)
        else:
            consumer.assign(wanted)
    try:
        list_topics(consumer, watch, context, timeout_s, topic)
    except BaseException:
        # The metadata failure is what the caller must see; a handle that cannot be unassigned either is
        # assigned again, or closed, by the caller's next step.
        with contextlib.suppress(KafkaException, RuntimeError):
            if incremental:
                consumer.incremental_unassign(wanted)
            else:
                consumer.assign([])
        raise
