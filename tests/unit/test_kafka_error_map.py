"""Every confluent-kafka error maps to one tokcap error class, in one module, with no configured value in it."""

from __future__ import annotations

import logging
import traceback

import pytest
from confluent_kafka import KafkaError, KafkaException

from tokcap.errors import ConfigError, DeliveryError, DeliveryTimeoutError, TokcapError, TransportError
from transports.kafka.client.clients import AuthenticationWatch, ClientContext
from transports.kafka.client.error_map import (
    Construction,
    Delivery,
    Operation,
    Request,
    read_failure,
    scrubbed_cause,
    translated,
)
from transports.kafka.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    BrokerTlsError,
    BrokerUnreachableError,
    MaterializerFailedError,
    TopicNotFoundError,
)

SECRET = "s3cret-value-xyz"
CONTEXT = ClientContext("127.0.0.1:9093", {"sasl.mechanism": "SCRAM-SHA-512", "sasl.password": SECRET})

SECRETS = {
    "sasl.password": "pw-Tr0ub4dor-3",
    "ssl.key.password": "key-pass-93Xq",
    "sasl.oauthbearer.client.secret": "oauth-secret-7Hd",
    "ssl.endpoint.identification.algorithm": "typed-in-the-wrong-field-4Kp",
}
"""Secrets under the keys that name them, and one under a key that does not (a password in the wrong field)."""
SECRET_CONTEXT = ClientContext(
    "127.0.0.1:9093", {"sasl.username": "writer", "sasl.mechanism": "SCRAM-SHA-512", **SECRETS}
)

EVERY_CODE = sorted(
    {
        value
        for name, value in vars(KafkaError).items()
        if name.lstrip("_")[:1].isupper() and name.lstrip("_").isupper() and isinstance(value, int)
    }
)
"""Every error code confluent-kafka names: librdkafka's local ones (``_ALL_BROKERS_DOWN``) and the broker's."""

RAISING: list[Operation] = [
    Request("read the cluster metadata", 5.0),
    Request("delete topic 'tokcap.run'", 5.0, "tokcap.run"),
    Delivery("put of call 'c1'", "tokcap.run"),
    Construction("producer"),
]


def raised_from(
    operation: Operation, failure: BaseException, context: ClientContext = CONTEXT
) -> BaseException:
    """What leaves a translated block inside which ``failure`` was raised."""
    with pytest.raises(BaseException) as caught, translated(context, operation):
        raise failure
    return caught.value


def everything_shown(exc: BaseException) -> str:
    """The message, the chained causes and the full traceback, as a log handler would print them."""
    return "".join(traceback.format_exception(exc))


def test_the_codes_iterated_are_every_code_confluent_kafka_names() -> None:
    assert len(EVERY_CODE) > 150
    assert {KafkaError._ALL_BROKERS_DOWN, KafkaError._MSG_TIMED_OUT, KafkaError.UNKNOWN_TOPIC_OR_PART} <= set(
        EVERY_CODE
    )
    assert {KafkaError._BAD_MSG, KafkaError._SSL, KafkaError.TOPIC_AUTHORIZATION_FAILED} <= set(EVERY_CODE)


SAID = "broker said: " + ", ".join(f"{key}={value}" for key, value in SECRETS.items())
"""librdkafka's text of an error, echoing every configured value (it does echo some, such as a mechanism)."""


def _mistranslation(operation: Operation, code: int, fatal: bool) -> str | None:
    """What is wrong with the error leaving a translated block for this code, or ``None``."""
    raised = raised_from(operation, KafkaException(KafkaError(code, SAID, fatal=fatal)), SECRET_CONTEXT)
    expected = ConfigError if isinstance(operation, Construction) else TransportError
    if not isinstance(raised, expected) or isinstance(raised, KafkaException):
        return f"{type(raised).__name__}, not a {expected.__name__}"
    cause = raised.__cause__
    if not (isinstance(cause, KafkaException) and cause.args[0].code() == code):
        return f"chained to {cause!r}, not to a copy of the error"
    leaked = [key for key, value in SECRETS.items() if value in everything_shown(raised)]
    return f"shows the value of {leaked}" if leaked else None


@pytest.mark.parametrize(
    "operation", RAISING, ids=["request", "request-naming-its-topic", "delivery", "construction"]
)
def test_every_kafka_error_code_leaves_a_translated_block_as_a_tokcap_error_without_a_secret(
    operation: Operation,
) -> None:
    wrong = {
        f"{KafkaError(code).name()}{' (fatal)' if fatal else ''}": problem
        for code in EVERY_CODE
        for fatal in (False, True)
        if (problem := _mistranslation(operation, code, fatal)) is not None
    }
    assert not wrong


def test_every_kafka_error_code_a_reader_sees_stops_it_with_a_tokcap_error_or_lets_it_go_on_never_echoing_a_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrong: dict[str, str] = {}
    for code in EVERY_CODE:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            failure = read_failure(KafkaError(code, SAID), SECRET_CONTEXT, "tokcap.run")
        if not (failure is None or isinstance(failure, TransportError)):
            wrong[KafkaError(code).name()] = f"{type(failure).__name__}, not a TransportError"
        leaked = [key for key, value in SECRETS.items() if value in str(failure) + caplog.text]
        if leaked:
            wrong[KafkaError(code).name()] = f"shows the value of {leaked}"
    assert not wrong


@pytest.mark.parametrize(
    ("operation", "code", "expected"),
    [
        (Request("list topics", 5.0), KafkaError._ALL_BROKERS_DOWN, BrokerUnreachableError),
        (Request("list topics", 5.0), KafkaError._TRANSPORT, BrokerUnreachableError),
        (Request("list topics", 5.0), KafkaError._TIMED_OUT, BrokerUnreachableError),
        (Request("list topics", 5.0), KafkaError._RESOLVE, BrokerUnreachableError),
        (Request("list topics", 5.0), KafkaError._SSL, BrokerTlsError),
        (Request("list topics", 5.0), KafkaError._AUTHENTICATION, BrokerAuthenticationError),
        (Request("list topics", 5.0), KafkaError.SASL_AUTHENTICATION_FAILED, BrokerAuthenticationError),
        (Request("list topics", 5.0), KafkaError.CLUSTER_AUTHORIZATION_FAILED, BrokerAuthorizationError),
        (Request("list topics", 5.0), KafkaError.GROUP_AUTHORIZATION_FAILED, BrokerAuthorizationError),
        (Request("list topics", 5.0), KafkaError.UNKNOWN_TOPIC_OR_PART, TransportError),
        (Request("describe topic 't'", 5.0, "t"), KafkaError.UNKNOWN_TOPIC_OR_PART, TopicNotFoundError),
        (Request("describe topic 't'", 5.0, "t"), KafkaError._UNKNOWN_TOPIC, TopicNotFoundError),
        (
            Request("describe topic 't'", 5.0, "t"),
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            BrokerAuthorizationError,
        ),
        (Request("describe topic 't'", 5.0, "t"), KafkaError._BAD_MSG, TransportError),
        (Delivery("a put", "t"), KafkaError._MSG_TIMED_OUT, DeliveryTimeoutError),
        (Delivery("a put", "t"), KafkaError._ALL_BROKERS_DOWN, DeliveryError),
        (Delivery("a put", "t"), KafkaError._UNKNOWN_TOPIC, DeliveryError),
        (Delivery("a put", "t"), KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, BrokerAuthorizationError),
        (Delivery("a put", "t"), KafkaError.SASL_AUTHENTICATION_FAILED, BrokerAuthenticationError),
        (Delivery("a put", "t"), KafkaError._SSL, BrokerTlsError),
        (Construction("consumer"), KafkaError._INVALID_ARG, ConfigError),
        (Construction("consumer"), KafkaError._SSL, ConfigError),
    ],
)
def test_the_important_kafka_errors_become_their_specific_tokcap_error(
    operation: Operation, code: int, expected: type[TokcapError]
) -> None:
    assert type(raised_from(operation, KafkaException(KafkaError(code, "refused")))) is expected


@pytest.mark.parametrize(
    ("operation", "failure", "expected"),
    [
        (Request("read the id of topic 't'", 5.0, "t"), TimeoutError(), TransportError),
        (Delivery("a put", "t"), BufferError("Local: Queue full"), DeliveryError),
        (Construction("producer"), TypeError(f"expected str, got {SECRET}"), ConfigError),
        (Construction("producer"), ValueError(f"bad value {SECRET}"), ConfigError),
    ],
)
def test_the_failures_a_client_call_raises_of_its_own_are_translated_too(
    operation: Operation, failure: BaseException, expected: type[TokcapError]
) -> None:
    raised = raised_from(operation, failure)
    assert type(raised) is expected
    assert type(raised.__cause__) is type(failure)
    assert SECRET not in everything_shown(raised)


def test_a_request_not_answered_in_time_says_so() -> None:
    raised = raised_from(Request("read the id of topic 't'", 5.0, "t"), TimeoutError())
    assert str(raised) == "could not read the id of topic 't' on 127.0.0.1:9093: no answer within 5 s"


def test_a_full_producer_queue_says_the_broker_is_not_keeping_up() -> None:
    raised = raised_from(Delivery("put of call 'c1'", "t"), BufferError("Local: Queue full"))
    assert "put of call 'c1' cannot be queued: the local producer queue is full" in str(raised)


@pytest.mark.parametrize(
    "failure",
    [ConfigError("already ours"), KeyError("not a client's failure"), TimeoutError("not a request's")],
)
def test_tokcap_errors_and_failures_no_client_raised_leave_a_translated_block_unchanged(
    failure: BaseException,
) -> None:
    operation = Delivery("a put", "t") if isinstance(failure, TimeoutError) else RAISING[0]
    assert raised_from(operation, failure) is failure


def test_a_translated_block_that_raises_nothing_returns_its_value() -> None:
    def read() -> int:
        with translated(CONTEXT, RAISING[0]):
            return 7

    assert read() == 7


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (KafkaError._MSG_TIMED_OUT, DeliveryTimeoutError),
        (KafkaError.MSG_SIZE_TOO_LARGE, DeliveryError),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, DeliveryError),
        (KafkaError._AUTHENTICATION, BrokerAuthenticationError),
        (KafkaError.SASL_AUTHENTICATION_FAILED, BrokerAuthenticationError),
        (KafkaError._SSL, BrokerTlsError),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, BrokerAuthorizationError),
        (KafkaError.NOT_ENOUGH_REPLICAS, DeliveryError),
    ],
)
def test_a_failed_delivery_becomes_the_matching_tokcap_error(
    code: int, expected: type[TransportError]
) -> None:
    error = KafkaError(code, f"broker said no to {SECRET}")
    translated_error = raised_from(Delivery("put of call 'c1'", "tokcap.run"), KafkaException(error))
    assert type(translated_error) is expected
    assert SECRET not in str(translated_error)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (KafkaError._TRANSPORT, BrokerUnreachableError),
        (KafkaError._TIMED_OUT, BrokerUnreachableError),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, TopicNotFoundError),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, BrokerAuthorizationError),
        (KafkaError._AUTHENTICATION, BrokerAuthenticationError),
        (KafkaError.INVALID_CONFIG, TransportError),
    ],
)
def test_a_failed_request_becomes_the_matching_tokcap_error(
    code: int, expected: type[TransportError]
) -> None:
    exc = KafkaException(KafkaError(code, "refused"))
    translated_error = raised_from(Request("delete topic 'tokcap.run'", 5, "tokcap.run"), exc)
    assert type(translated_error) is expected


def test_a_reader_stops_on_a_lost_position_or_refusal_and_continues_on_transient_errors() -> None:
    assert read_failure(KafkaError(KafkaError._PARTITION_EOF), CONTEXT, "t") is None
    assert read_failure(KafkaError(KafkaError._TRANSPORT, "down"), CONTEXT, "t") is None
    lost = read_failure(KafkaError(KafkaError.OFFSET_OUT_OF_RANGE, "gone"), CONTEXT, "t")
    assert isinstance(lost, MaterializerFailedError)
    refused = read_failure(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "no"), CONTEXT, "t")
    assert isinstance(refused, BrokerAuthorizationError)


def test_a_refused_login_names_broker_and_mechanism_but_not_a_mechanism_value_that_is_a_secret() -> None:
    error = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error")
    named = AuthenticationWatch(CONTEXT)
    named(error)
    with pytest.raises(BrokerAuthenticationError, match=r"127\.0\.0\.1:9093 .* SCRAM-SHA-512"):
        named.raise_if_failed()
    misplaced = ClientContext("127.0.0.1:9093", {"sasl.mechanism": SECRET})
    watch = AuthenticationWatch(misplaced)
    watch(error)
    with pytest.raises(BrokerAuthenticationError) as caught:
        watch.raise_if_failed()
    assert SECRET not in str(caught.value) and "unrecognised value of sasl.mechanism" in str(caught.value)


def test_a_handshake_cut_by_the_connection_is_not_a_refused_login_but_a_refusal_still_is() -> None:
    cut = KafkaError(
        KafkaError._AUTHENTICATION,
        "sasl_ssl://127.0.0.1:9093/1: SASL SCRAM-SHA-512 mechanism handshake failed: Local: Broker transport "
        "failure: broker's supported mechanisms: (n/a) (after 0ms in state DOWN)",
    )
    watch = AuthenticationWatch(CONTEXT)
    watch(cut)
    watch.raise_if_failed()
    assert watch.failure is None
    refused = KafkaError(
        KafkaError._AUTHENTICATION,
        "sasl_ssl://127.0.0.1:9093/1: SASL authentication error: Authentication failed during authentication "
        "due to invalid credentials with SASL mechanism SCRAM-SHA-512 (after 3ms in state AUTH_REQ)",
    )
    watch(refused)
    with pytest.raises(BrokerAuthenticationError, match="refused the login"):
        watch.raise_if_failed()


def test_the_chained_cause_carries_the_code_but_not_the_secret() -> None:
    cause = scrubbed_cause(
        KafkaException(KafkaError(KafkaError._INVALID_ARG, f"Unsupported: {SECRET}")), CONTEXT
    )
    error = cause.args[0]
    assert error.code() == KafkaError._INVALID_ARG and SECRET not in error.str() and SECRET not in repr(cause)
    assert SECRET not in repr(CONTEXT)


def test_a_refused_login_fails_requests_only_while_fresh_or_until_the_broker_accepts_something() -> None:
    now = [100.0]
    watch = AuthenticationWatch(CONTEXT, fresh_s=10.0, clock=lambda: now[0])
    refused = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: invalid credentials")
    watch(refused)
    now[0] += 9.0
    with pytest.raises(BrokerAuthenticationError):
        watch.raise_if_failed()
    watch(refused)  # librdkafka's next retry of the login reports it again: still fresh
    now[0] += 9.0
    assert isinstance(watch.failure, BrokerAuthenticationError)
    now[0] += 1.5  # no report for longer than the window: the credential works again
    assert watch.failure is None
    watch.raise_if_failed()
    watch(refused)
    watch.clear()  # a delivery the broker acknowledged
    watch.raise_if_failed()
    assert watch.failure is None


def test_errors_name_the_sasl_principal_but_never_a_secret_typed_as_the_user_name() -> None:
    writer = ClientContext("127.0.0.1:9093", {"sasl.username": "writer", "sasl.password": SECRET})
    denied = raised_from(
        Delivery("a put", "t"),
        KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied")),
        writer,
    )
    assert "does not allow User:writer to write to topic 't'" in str(denied)
    refused = AuthenticationWatch(writer)
    refused(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"))
    with pytest.raises(BrokerAuthenticationError, match="refused the login of User:writer with SASL"):
        refused.raise_if_failed()
    swapped = ClientContext("127.0.0.1:9093", {"sasl.username": SECRET, "sasl.password": SECRET})
    assert SECRET not in swapped.principal and swapped.principal == "the client's principal"
