"""The Kafka staging sink is built without a broker and fails a stage it cannot deliver, quickly."""

from __future__ import annotations

import inspect
import socket
import time

from staging_calls import staged_call

from transports.kafka.staging import KafkaStagingSink


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_stage_to_a_broker_that_cannot_be_reached_fails_within_its_delivery_timeout() -> None:
    sink = KafkaStagingSink(
        bootstrap_servers=f"127.0.0.1:{_closed_port()}", run_id="nobody", delivery_timeout_s=1.5
    )
    try:
        began = time.monotonic()
        result = sink.stage(staged_call("r-unreachable", "call-0", [1, 2], [3]))
        took = time.monotonic() - began
    finally:
        sink.close()
    assert result.ok is False
    assert "r-unreachable/call-0" in result.error
    assert took < 4.0, took


def test_the_default_delivery_timeout_of_a_stage_is_well_under_twenty_seconds() -> None:
    default = inspect.signature(KafkaStagingSink).parameters["delivery_timeout_s"].default
    assert default <= 10.0
