"""The one place where confluent-kafka's errors become tokcap errors.

Every Kafka client tokcap builds (producer, consumers, admin) is described by a ``ClientContext``: the
bootstrap address and the caller's settings. The context builds the client's configuration (with
librdkafka's log routed through ``ClientLog``) and names the broker and SASL mechanism in errors, while
its ``Redactor`` keeps every configured value out of them. Callers raise what these functions return
``from`` the original; the original is itself rebuilt with scrubbed text, so a traceback shows no secret.

Which tokcap error a librdkafka error becomes:

- an invalid client setting (``-X``, ``producer_config``) → ``ConfigError`` naming the property;
- a refused SASL login → ``BrokerAuthenticationError`` naming broker, user and mechanism;
- a failed TLS handshake (untrusted certificate, hostname mismatch) → ``BrokerTlsError``;
- an ACL refusal → ``BrokerAuthorizationError`` naming the principal and the operation;
- no answer at all → ``BrokerUnreachableError``; a missing topic → ``TopicNotFoundError``;
- a delivery that timed out → ``DeliveryTimeoutError``; any other delivery failure → ``DeliveryError``;
- a consumer that lost its place in the log → ``MaterializerFailedError``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from tokcap.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    BrokerTlsError,
    BrokerUnreachableError,
    ConfigError,
    DeliveryError,
    DeliveryTimeoutError,
    MaterializerFailedError,
    TopicNotFoundError,
    TransportError,
)
from transports.kafka.client_log import ClientLog
from transports.kafka.redaction import Redactor, is_secret_key

__all__ = [
    "REFUSAL_FRESH_S",
    "AuthenticationWatch",
    "ClientContext",
    "authentication_failure",
    "build_client",
    "delivery_error",
    "kafka_error_of",
    "logger",
    "read_error",
    "request_error",
    "scrubbed_cause",
]

logger = logging.getLogger(__name__)

_KNOWN_MECHANISMS = frozenset({"PLAIN", "GSSAPI", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"})
_KNOWN_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
_AUTHENTICATION_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED})
_TRANSPORT_FAILURE = "Local: Broker transport failure"
"""What librdkafka's ``_AUTHENTICATION`` text holds when the connection, not the broker, ended the handshake."""
_AUTHORIZATION_CODES = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)
_UNREACHABLE_CODES = frozenset(
    {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._RESOLVE}
)
_LOST_PLACE_CODES = frozenset({KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE})
_NO_SUCH_PROPERTY = re.compile(r'No such configuration property: "([^"]+)"')
_INVALID_VALUE = re.compile(r'Invalid value .* for configuration property "([^"]+)"')

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


def kafka_error_of(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a ``KafkaException`` carries, if any."""
    error = exc.args[0] if exc.args else None
    return error if isinstance(error, KafkaError) else None


def _sentence(error: KafkaError | BaseException, context: ClientContext) -> str:
    """librdkafka's own sentence for an error, without the ``KafkaError{...}`` wrapping, scrubbed."""
    inner = error if isinstance(error, KafkaError) else kafka_error_of(error)
    text = inner.str() if inner is not None else str(error)
    return context.scrub(text)


def scrubbed_cause(error: KafkaError | BaseException, context: ClientContext) -> KafkaException:
    """A ``KafkaException`` like the original but with scrubbed text, to chain with ``raise ... from``."""
    inner = error if isinstance(error, KafkaError) else kafka_error_of(error)
    if inner is None:
        return KafkaException(KafkaError(KafkaError._FAIL, _sentence(error, context)))
    return KafkaException(
        KafkaError(inner.code(), _sentence(inner, context), fatal=inner.fatal(), retriable=inner.retriable())
    )


def _config_error(error: KafkaError, context: ClientContext, what: str) -> ConfigError:
    text = error.str()
    unknown = _NO_SUCH_PROPERTY.search(text)
    if unknown:
        return ConfigError(
            f"{unknown.group(1)!r} is not a Kafka client property (given with -X, producer_config or "
            "consumer_config); check its spelling against librdkafka's CONFIGURATION.md"
        )
    invalid = _INVALID_VALUE.search(text)
    if invalid:
        return ConfigError(f"the value of Kafka client property {invalid.group(1)!r} is not valid")
    return ConfigError(f"the Kafka {what} settings are not valid: {context.scrub(text)}")


def build_client(
    factory: Callable[[dict[str, Any]], _Client], settings: dict[str, Any], context: ClientContext, what: str
) -> _Client:
    """Construct a confluent-kafka client; a refused setting becomes a ``ConfigError`` naming the property."""
    try:
        return factory(settings)
    except KafkaException as exc:
        error = kafka_error_of(exc)
        if error is None:
            raise ConfigError(f"the Kafka {what} could not be created: {context.scrub(str(exc))}") from None
        raise _config_error(error, context, what) from scrubbed_cause(error, context)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the Kafka {what} settings are not valid: {context.scrub(str(exc))}") from None


def authentication_failure(error: KafkaError, context: ClientContext) -> TransportError | None:
    """The tokcap error for a refused login or TLS handshake, or ``None`` when ``error`` is neither."""
    code = error.code()
    sentence = _sentence(error, context)
    if (
        code == KafkaError._SSL
        or "SSL handshake failed" in sentence
        or "certificate verify failed" in sentence
    ):
        return BrokerTlsError(
            f"the TLS handshake with the broker at {context.bootstrap} failed ({sentence}); check that "
            "ssl.ca.location names the CA that signed the broker's certificate and that the certificate "
            "names the host in the bootstrap address"
        )
    if code == KafkaError._AUTHENTICATION and _TRANSPORT_FAILURE in sentence:
        # The connection dropped during the SASL handshake, before the broker said anything about the login
        # ("broker's supported mechanisms: (n/a)"): librdkafka reconnects, and a refusal would end a run that
        # can go on (seen once on a busy machine, right after the broker answered the same client).
        return None
    if code in _AUTHENTICATION_CODES:
        return BrokerAuthenticationError(
            f"the broker at {context.bootstrap} refused the login of {context.principal} with SASL mechanism "
            f"{context.mechanism} "
            f"({sentence}); check sasl.username and sasl.password and that the user exists on the broker"
        )
    return None


def _authorization_failure(error: KafkaError, context: ClientContext, doing: str) -> TransportError | None:
    if error.code() not in _AUTHORIZATION_CODES:
        return None
    return BrokerAuthorizationError(
        f"the broker at {context.bootstrap} does not allow {context.principal} to {doing} "
        f"({error.name()}: {_sentence(error, context)}); docs/operations.md lists the ACLs each role needs"
    )


def delivery_error(error: KafkaError, *, what: str, topic: str, context: ClientContext) -> TransportError:
    """The tokcap error for a failed send of ``what`` to ``topic``."""
    code = error.code()
    special = authentication_failure(error, context) or _authorization_failure(
        error, context, f"write to topic {topic!r}"
    )
    if special is not None:
        return special
    if code == KafkaError._MSG_TIMED_OUT:
        return DeliveryTimeoutError(
            f"{what} was not acknowledged by the broker for topic {topic!r} in time "
            f"({_sentence(error, context)}); check that the broker is reachable, or raise delivery_timeout_s"
        )
    if code == KafkaError.MSG_SIZE_TOO_LARGE:
        return DeliveryError(
            f"{what} is larger than the broker accepts for topic {topic!r} ({_sentence(error, context)})"
        )
    if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        return DeliveryError(
            f"topic {topic!r} does not exist ({_sentence(error, context)}); create it before writing"
        )
    fatal = " (fatal: the producer will be recreated)" if error.fatal() else ""
    return DeliveryError(
        f"{what} failed for topic {topic!r}: {error.name()}: {_sentence(error, context)}{fatal}"
    )


def request_error(
    exc: BaseException,
    *,
    doing: str,
    context: ClientContext,
    timeout_s: float,
    topic: str | None = None,
) -> TransportError:
    """The tokcap error for a failed admin or metadata request (``doing`` says what was asked)."""
    error = kafka_error_of(exc)
    if error is not None:
        special = authentication_failure(error, context) or _authorization_failure(error, context, doing)
        if special is not None:
            return special
        if topic is not None and error.code() in (
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError._UNKNOWN_TOPIC,
        ):
            return TopicNotFoundError(f"topic {topic!r} does not exist on {context.bootstrap}")
        if error.code() in _UNREACHABLE_CODES:
            return BrokerUnreachableError(
                f"no Kafka broker answered at {context.bootstrap} within {timeout_s:g} s "
                f"({_sentence(error, context)}); check the address, that the broker is running, and the "
                "security settings passed with -X"
            )
    return TransportError(f"could not {doing} on {context.bootstrap}: {_sentence(exc, context)}")


def read_error(error: KafkaError, *, topic: str, context: ClientContext) -> TransportError | None:
    """The tokcap error that must stop a reader of ``topic``, or ``None`` for an error librdkafka recovers from.

    The end of a partition and transient broker trouble return ``None`` (the latter is logged here).
    """
    if error.code() == KafkaError._PARTITION_EOF:
        return None
    special = authentication_failure(error, context) or _authorization_failure(
        error, context, f"read topic {topic!r}"
    )
    if special is not None:
        return special
    if error.fatal() or error.code() in _LOST_PLACE_CODES:
        return MaterializerFailedError(
            f"cannot keep reading topic {topic!r}: {_sentence(error, context)}. If the log was truncated by "
            "retention, the projection cannot be rebuilt; replay into a new directory from a complete topic"
        )
    logger.warning("reading topic %s: %s", topic, _sentence(error, context))
    return None


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
