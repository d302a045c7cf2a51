"""Kafka clients as tokcap builds them: who they are, their settings, and the watch on their logins.

Every Kafka client tokcap builds (producer, consumers, admin) is described by a ``ClientContext``: the
bootstrap address and the caller's settings. The context builds the client's configuration (with
librdkafka's log routed through ``ClientLog``) and names the broker, the principal and the SASL mechanism in
errors, while its ``Redactor`` keeps every configured value out of them. ``build_client`` constructs a client
and ``AuthenticationWatch`` is the error callback that ends a wait as soon as a login is refused; both turn
librdkafka's errors into tokcap's through ``error_map``, the one place that decides which error is which.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from tokcap.errors import TransportError
from transports.kafka.client_log import ClientLog
from transports.kafka.error_map import Construction, authentication_failure, scrubbed_cause, translated
from transports.kafka.redaction import Redactor, is_secret_key

__all__ = [
    "REFUSAL_FRESH_S",
    "AuthenticationWatch",
    "ClientContext",
    "build_client",
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
