"""Every confluent-kafka error maps to one tokcap error class, in one module, with no configured value in it."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from tokcap.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    BrokerTlsError,
    BrokerUnreachableError,
    DeliveryError,
    DeliveryTimeoutError,
    MaterializerFailedError,
    TopicNotFoundError,
    TransportError,
)
from transports.kafka.client_errors import (
    AuthenticationWatch,
    ClientContext,
    delivery_error,
    read_error,
    request_error,
    scrubbed_cause,
)

SECRET = "s3cret-value-xyz"
CONTEXT = ClientContext("127.0.0.1:9093", {"sasl.mechanism": "SCRAM-SHA-512", "sasl.password": SECRET})


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
    translated = delivery_error(error, what="put of call 'c1'", topic="tokcap.run", context=CONTEXT)
    assert type(translated) is expected
    assert SECRET not in str(translated)


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
    translated = request_error(
        exc, doing="delete topic 'tokcap.run'", context=CONTEXT, timeout_s=5, topic="tokcap.run"
    )
    assert type(translated) is expected


def test_a_reader_stops_on_a_lost_position_or_refusal_and_continues_on_transient_errors() -> None:
    assert read_error(KafkaError(KafkaError._PARTITION_EOF), topic="t", context=CONTEXT) is None
    assert read_error(KafkaError(KafkaError._TRANSPORT, "down"), topic="t", context=CONTEXT) is None
    lost = read_error(KafkaError(KafkaError.OFFSET_OUT_OF_RANGE, "gone"), topic="t", context=CONTEXT)
    assert isinstance(lost, MaterializerFailedError)
    refused = read_error(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "no"), topic="t", context=CONTEXT)
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
    denied = delivery_error(
        KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied"), what="a put", topic="t", context=writer
    )
    assert "does not allow User:writer to write to topic 't'" in str(denied)
    refused = AuthenticationWatch(writer)
    refused(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"))
    with pytest.raises(BrokerAuthenticationError, match="refused the login of User:writer with SASL"):
        refused.raise_if_failed()
    swapped = ClientContext("127.0.0.1:9093", {"sasl.username": SECRET, "sasl.password": SECRET})
    assert SECRET not in swapped.principal and swapped.principal == "the client's principal"
