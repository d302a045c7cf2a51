"""The one map from confluent-kafka's errors to tokcap's error tree.

A call into a Kafka client runs inside ``translated(context, operation)``: a ``KafkaException`` raised inside
leaves it as the tokcap error the map picks, chained to a copy of the original whose text is scrubbed of every
configured value, so a traceback shows no secret. The operation (``Request``, ``Delivery``, ``Construction``)
says what the client was asked, which the message names. An error that arrives as a value rather than an
exception (a topic's metadata, a delivery report) is raised inside the block so it takes the same path. Errors
reported on the side are read through ``read_failure`` (a consumer's error message, which may be recoverable)
and ``authentication_failure`` (the client's error callback).

Which tokcap error a librdkafka error becomes, whatever a connected client was asked (a request, a delivery,
a read):

- a failed TLS handshake (untrusted certificate, hostname mismatch) → ``BrokerTlsError``;
- a refused SASL login → ``BrokerAuthenticationError`` naming broker, principal and mechanism;
- an ACL refusal → ``BrokerAuthorizationError`` naming the principal and the operation.

Then by what was asked:

- a request: no answer → ``BrokerUnreachableError``; a missing topic it names → ``TopicNotFoundError``; a
  future that was not answered in time, or anything else → ``TransportError``;
- a delivery: timed out → ``DeliveryTimeoutError``; a full local queue, a message too large, a missing topic
  or anything else → ``DeliveryError``;
- a client's construction: an invalid setting (``-X``, ``producer_config``) → ``ConfigError`` naming the
  property;
- a consumer's error message: a lost place in the log or a fatal error → ``MaterializerFailedError``; the end
  of a partition and transient trouble are recoverable (``None``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException

from tokcap.errors import ConfigError, DeliveryError, DeliveryTimeoutError, TokcapError, TransportError
from transports.kafka.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    BrokerTlsError,
    BrokerUnreachableError,
    MaterializerFailedError,
    TopicNotFoundError,
)

__all__ = [
    "ClientFacts",
    "Construction",
    "Delivery",
    "Operation",
    "Request",
    "authentication_failure",
    "kafka_error_of",
    "logger",
    "read_failure",
    "scrubbed_cause",
    "translate",
    "translated",
]

logger = logging.getLogger(__name__)

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
_UNKNOWN_TOPIC_CODES = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
_LOST_PLACE_CODES = frozenset({KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE})
_NO_SUCH_PROPERTY = re.compile(r'No such configuration property: "([^"]+)"')
_INVALID_VALUE = re.compile(r'Invalid value .* for configuration property "([^"]+)"')


class ClientFacts(Protocol):
    """What a message may say about the client that failed, and how to keep its secrets out of the text."""

    @property
    def bootstrap(self) -> str:
        """The address the client connects to."""
        ...

    @property
    def principal(self) -> str:
        """The principal the broker's ACLs name; never a secret."""
        ...

    @property
    def mechanism(self) -> str:
        """The SASL mechanism, or a placeholder when the value is not a mechanism's name."""
        ...

    def scrub(self, text: str) -> str:
        """``text`` without any configured value that could be a secret."""
        ...


@dataclass(frozen=True)
class Request:
    """An admin, metadata, offset or read request the caller waits on.

    ``doing`` completes "could not ..." and "does not allow ... to ...". ``topic``, when given, turns an unknown
    topic into ``TopicNotFoundError``; a request that may create or list topics leaves it out.
    """

    doing: str
    timeout_s: float
    topic: str | None = None


@dataclass(frozen=True)
class Delivery:
    """A send of ``what`` (a put, a freeze, a batch of events) to ``topic``."""

    what: str
    topic: str


@dataclass(frozen=True)
class Construction:
    """The construction of a client (``what``: "producer", "consumer", "admin client") from its settings."""

    what: str


Operation = Request | Delivery | Construction

_FOREIGN: dict[type[Operation], tuple[type[BaseException], ...]] = {
    Request: (TimeoutError,),
    Delivery: (BufferError,),
    Construction: (TypeError, ValueError),
}
"""Besides ``KafkaException``, what each operation's client call raises for a failure of its own: an admin
future not answered in time, a full local producer queue, a setting of the wrong Python type."""


def kafka_error_of(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a ``KafkaException`` carries, if any."""
    error = exc.args[0] if exc.args else None
    return error if isinstance(error, KafkaError) else None


def _sentence(error: KafkaError | BaseException, context: ClientFacts) -> str:
    """librdkafka's own sentence for an error, without the ``KafkaError{...}`` wrapping, scrubbed."""
    inner = error if isinstance(error, KafkaError) else kafka_error_of(error)
    text = inner.str() if inner is not None else str(error)
    return context.scrub(text)


def scrubbed_cause(error: KafkaError | BaseException, context: ClientFacts) -> KafkaException:
    """A ``KafkaException`` like the original but with scrubbed text, to chain with ``raise ... from``."""
    inner = error if isinstance(error, KafkaError) else kafka_error_of(error)
    if inner is None:
        return KafkaException(KafkaError(KafkaError._FAIL, _sentence(error, context)))
    return KafkaException(
        KafkaError(inner.code(), _sentence(inner, context), fatal=inner.fatal(), retriable=inner.retriable())
    )


def authentication_failure(error: KafkaError, context: ClientFacts) -> TransportError | None:
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


def _refusal(error: KafkaError, context: ClientFacts, doing: str) -> TransportError | None:
    """The rows every operation shares: a refused handshake or login, or an ACL that does not allow ``doing``."""
    refused = authentication_failure(error, context)
    if refused is not None or error.code() not in _AUTHORIZATION_CODES:
        return refused
    return BrokerAuthorizationError(
        f"the broker at {context.bootstrap} does not allow {context.principal} to {doing} "
        f"({error.name()}: {_sentence(error, context)}); docs/operations.md lists the ACLs each role needs"
    )


def _request_failure(failure: BaseException, context: ClientFacts, asked: Request) -> TransportError:
    error = kafka_error_of(failure)
    if error is not None:
        refused = _refusal(error, context, asked.doing)
        if refused is not None:
            return refused
        if asked.topic is not None and error.code() in _UNKNOWN_TOPIC_CODES:
            return TopicNotFoundError(f"topic {asked.topic!r} does not exist on {context.bootstrap}")
        if error.code() in _UNREACHABLE_CODES:
            return BrokerUnreachableError(
                f"no Kafka broker answered at {context.bootstrap} within {asked.timeout_s:g} s "
                f"({_sentence(error, context)}); check the address, that the broker is running, and the "
                "security settings passed with -X"
            )
    elif isinstance(failure, TimeoutError):
        return TransportError(
            f"could not {asked.doing} on {context.bootstrap}: no answer within {asked.timeout_s:g} s"
        )
    return TransportError(f"could not {asked.doing} on {context.bootstrap}: {_sentence(failure, context)}")


def _delivery_failure(failure: BaseException, context: ClientFacts, sent: Delivery) -> TransportError:
    what, topic = sent.what, sent.topic
    if isinstance(failure, BufferError):
        return DeliveryError(
            f"{what} cannot be queued: the local producer queue is full; the broker is not keeping up"
        )
    error = kafka_error_of(failure) or KafkaError(KafkaError._FAIL, _sentence(failure, context))
    refused = _refusal(error, context, f"write to topic {topic!r}")
    if refused is not None:
        return refused
    code = error.code()
    if code == KafkaError._MSG_TIMED_OUT:
        return DeliveryTimeoutError(
            f"{what} was not acknowledged by the broker for topic {topic!r} in time "
            f"({_sentence(error, context)}); check that the broker is reachable, or raise delivery_timeout_s"
        )
    if code == KafkaError.MSG_SIZE_TOO_LARGE:
        return DeliveryError(
            f"{what} is larger than the broker accepts for topic {topic!r} ({_sentence(error, context)})"
        )
    if code in _UNKNOWN_TOPIC_CODES:
        return DeliveryError(
            f"topic {topic!r} does not exist ({_sentence(error, context)}); create it before writing"
        )
    fatal = " (fatal: the producer will be recreated)" if error.fatal() else ""
    return DeliveryError(
        f"{what} failed for topic {topic!r}: {error.name()}: {_sentence(error, context)}{fatal}"
    )


def _construction_failure(failure: BaseException, context: ClientFacts, built: Construction) -> ConfigError:
    if not isinstance(failure, KafkaException):
        return ConfigError(f"the Kafka {built.what} settings are not valid: {context.scrub(str(failure))}")
    error = kafka_error_of(failure)
    if error is None:
        return ConfigError(f"the Kafka {built.what} could not be created: {context.scrub(str(failure))}")
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
    return ConfigError(f"the Kafka {built.what} settings are not valid: {context.scrub(text)}")


def translate(failure: BaseException, context: ClientFacts, operation: Operation) -> TokcapError:
    """The tokcap error for ``failure``, raised by a client asked to do ``operation``; never ``None``."""
    if isinstance(operation, Request):
        return _request_failure(failure, context, operation)
    if isinstance(operation, Delivery):
        return _delivery_failure(failure, context, operation)
    return _construction_failure(failure, context, operation)


def read_failure(error: KafkaError, context: ClientFacts, topic: str) -> TransportError | None:
    """The tokcap error a consumer's error message means for a reader of ``topic``, or ``None`` if it can go on.

    The end of a partition and transient broker trouble return ``None`` (the latter is logged here).
    """
    if error.code() == KafkaError._PARTITION_EOF:
        return None
    refused = _refusal(error, context, f"read topic {topic!r}")
    if refused is not None:
        return refused
    if error.fatal() or error.code() in _LOST_PLACE_CODES:
        return MaterializerFailedError(
            f"cannot keep reading topic {topic!r}: {_sentence(error, context)}. If the log was truncated by "
            "retention, the projection cannot be rebuilt; replay into a new directory from a complete topic"
        )
    logger.warning("reading topic %s: %s", topic, _sentence(error, context))
    return None


class _Translation:
    """The context manager ``translated`` returns; its exit never swallows an exception, so type checkers know."""

    __slots__ = ("_context", "_foreign", "_operation")

    def __init__(self, context: ClientFacts, operation: Operation) -> None:
        self._context = context
        self._operation = operation
        self._foreign = _FOREIGN[type(operation)]

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        failure: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if failure is None or isinstance(failure, TokcapError):
            return
        if isinstance(failure, KafkaException):
            cause: BaseException = scrubbed_cause(failure, self._context)
        elif isinstance(failure, self._foreign):
            # Their text may echo a setting's value: the cause is a scrubbed copy, as for librdkafka's errors
            # (of the builtin itself where it is one, whose constructor takes the text alone).
            raised = type(failure)
            text = self._context.scrub(str(failure))
            cause = raised(text) if raised in self._foreign else scrubbed_cause(failure, self._context)
        else:
            return
        raise translate(failure, self._context, self._operation) from cause


def translated(context: ClientFacts, operation: Operation) -> _Translation:
    """A block whose confluent-kafka errors leave it as tokcap errors (the httpx ``map_httpcore_exceptions`` shape).

    ``KafkaException`` and the operation's own failures (``TimeoutError`` of a request's future, ``BufferError``
    of a full producer queue, ``TypeError``/``ValueError`` of a setting) become the error ``translate`` picks,
    chained to a scrubbed copy of the original. Tokcap's own errors and anything else pass through unchanged.
    """
    return _Translation(context, operation)
