"""No secret from a Kafka client configuration ever appears in an error, a traceback, a repr or a log line."""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any

import pytest
from factories import make_entry

from tokcap.errors import ConfigError, DeliveryTimeoutError, TokcapError
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.client.client_log import ClientLog
from transports.kafka.wire.redaction import Redactor

SECRET = "Tr0ub4dor&3-correct-horse"


def everything_shown(exc: BaseException) -> str:
    """The message, the chained causes and the full traceback, as a log handler would print them."""
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize(
    "config",
    [
        {"security.protocol": "SASL_SSL", "sasl.mechanism": SECRET},
        {"security.protocol": "SASL_SSL", "sasl.mechanisms": SECRET},
        {"security.protocol": SECRET},
        {"sasl.username": "writer", "sasl.password": SECRET, "compression.type": SECRET},
        {"ssl.endpoint.identification.algorithm": SECRET},
    ],
)
def test_a_secret_under_a_wrong_key_is_not_echoed_by_the_sink(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        KafkaTokenSink(bootstrap_servers="127.0.0.1:1", run_id="r", producer_config=config)
    shown = everything_shown(caught.value)
    assert SECRET not in shown
    assert "redacted" in shown or "not valid" in shown


def test_a_secret_under_a_wrong_key_is_not_echoed_by_the_source(tmp_path: Any) -> None:
    with pytest.raises(TokcapError) as caught:
        KafkaTokenSource(
            bootstrap_servers="127.0.0.1:1",
            run_id="r",
            store_dir=tmp_path,
            consumer_config={"security.protocol": "SASL_SSL", "sasl.mechanism": SECRET},
        )
    assert SECRET not in everything_shown(caught.value)


def test_an_unknown_client_property_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"'no\.such\.prop' is not a Kafka client property"):
        KafkaTokenSink(bootstrap_servers="127.0.0.1:1", run_id="r", producer_config={"no.such.prop": "1"})


def test_librdkafka_log_lines_reach_python_logging_not_stderr(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    async def put_to_nowhere() -> None:
        sink = KafkaTokenSink(
            bootstrap_servers="127.0.0.1:1",
            run_id="r",
            delivery_timeout_s=1.0,
            producer_config={"sasl.username": "writer", "sasl.password": SECRET, "debug": "broker"},
        )
        try:
            with pytest.raises(DeliveryTimeoutError):
                await sink.put(make_entry("r1", "c1"))
        finally:
            await sink.close()

    with caplog.at_level(logging.DEBUG, logger="transports.kafka.librdkafka"):
        asyncio.run(put_to_nowhere())
    librdkafka = [r for r in caplog.records if r.name == "transports.kafka.librdkafka"]
    assert librdkafka, "no librdkafka line reached Python logging"
    assert all(SECRET not in r.getMessage() for r in caplog.records)
    assert "rdkafka" not in capfd.readouterr().err


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_librdkafka_log_is_rate_limited_and_says_how_much_it_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    target = logging.getLogger("tests.client_log")
    log = ClientLog(Redactor({}), target=target, limit=3, window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="tests.client_log"):
        for n in range(50):
            log.log(logging.WARNING, "%s [%s] %s", "FAIL", "rdkafka#producer-1", f"connect failed {n}")
        clock.now = 11.0
        log.log(logging.WARNING, "%s", "after the window")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"FAIL [rdkafka#producer-1] connect failed {n}" for n in range(3)]
    assert lines[3] == "librdkafka: 47 more log lines in the last 10 s were not shown"
    assert lines[4:] == ["after the window"]


def test_every_configured_value_that_could_be_a_secret_is_scrubbed_from_log_lines() -> None:
    redactor = Redactor({"sasl.mechanism": SECRET, "sasl.password": "pw", "acks": "all", "linger.ms": 5})
    scrubbed = redactor.scrub(f"Unsupported SASL mechanism: {SECRET}; acks all; linger 5")
    assert SECRET not in scrubbed and "<value of sasl.mechanism, redacted>" in scrubbed
    assert scrubbed.endswith("acks all; linger 5")
    assert SECRET not in repr(redactor) and "pw" not in repr(redactor)


def test_reprs_of_kafka_objects_hold_no_configured_value(tmp_path: Any) -> None:
    config = {"sasl.username": "writer", "sasl.password": SECRET}
    sink = KafkaTokenSink(bootstrap_servers="127.0.0.1:1", run_id="r", producer_config=config)
    try:
        shown = repr(sink) + repr(sink._bridge) + repr(sink._bridge._context) + repr(sink._bridge._watch)
        assert SECRET not in shown
    finally:
        asyncio.run(sink.close())
