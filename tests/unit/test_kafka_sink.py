"""The Kafka sink's own guarantees, against librdkafka's in-process mock cluster or no broker at all."""

from __future__ import annotations

import asyncio
import logging

import pytest
from store_contract import make_entry

from tokcap.errors import ConfigError, ConflictingEntryError, DeliveryTimeoutError, InvalidRolloutIdError
from transports.kafka import KafkaTokenSink

MOCK_CLUSTER = {"test.mock.num.brokers": 1}


def test_a_conflicting_payload_for_a_call_this_sink_wrote_fails_fast_and_the_same_payload_is_accepted() -> (
    None
):
    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers="mock:9092", topic="t", producer_config=MOCK_CLUSTER)
        try:
            await sink.put(make_entry("r1", "c1"))
            await sink.put(make_entry("r1", "c1"))
            with pytest.raises(ConflictingEntryError) as raised:
                await sink.put(make_entry("r1", "c1", salt=1))
            assert (raised.value.rollout_id, raised.value.model_call_id) == ("r1", "c1")
        finally:
            await sink.close()

    asyncio.run(scenario())


def test_an_unreachable_broker_fails_the_put_within_the_delivery_timeout_and_frees_the_call_id() -> None:
    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers="127.0.0.1:1", topic="t", delivery_timeout_s=0.5)
        try:
            with pytest.raises(DeliveryTimeoutError) as raised:
                await sink.put(make_entry("r1", "c1"))
            assert "r1" in str(raised.value) and "c1" in str(raised.value)
            with pytest.raises(DeliveryTimeoutError):
                await sink.put(make_entry("r1", "c1", salt=1))
        finally:
            await sink.close()

    asyncio.run(scenario())


def test_the_sink_refuses_settings_that_would_weaken_acknowledgement() -> None:
    for config in ({"acks": "1"}, {"enable.idempotence": False}, {"message.timeout.ms": 300000}):
        with pytest.raises(ConfigError):
            KafkaTokenSink(bootstrap_servers="127.0.0.1:1", topic="t", producer_config=config)


def test_invalid_rollout_ids_are_refused_before_anything_is_published() -> None:
    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers="127.0.0.1:1", topic="t", delivery_timeout_s=0.5)
        try:
            with pytest.raises(InvalidRolloutIdError):
                await sink.begin_call("../escape", "c1")
        finally:
            await sink.close()

    asyncio.run(scenario())


def test_secrets_in_producer_config_never_reach_repr_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        config = {
            "sasl.username": "user",
            "sasl.password": "hunter2-secret",
            "security.protocol": "sasl_plaintext",
        }
        config["sasl.mechanism"] = "PLAIN"
        with caplog.at_level(logging.DEBUG):
            sink = KafkaTokenSink(bootstrap_servers="127.0.0.1:1", topic="t", producer_config=config)
            assert "hunter2" not in repr(sink)
            await sink.close()
            await sink.close()

    asyncio.run(scenario())
    assert "hunter2" not in caplog.text
