"""``build_sink()`` naming ``transports.kafka:KafkaTokenSink`` gives a working sink in a spawned process."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
from store_contract import make_entry

from tokcap.config import token_id_capture_config
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka


def put_through_configured_sink(bootstrap: str, topic: str) -> None:
    """Spawned process: build the sink from a config dict, as a model server would, and write one entry."""
    config = token_id_capture_config(
        {
            "token_id_capture": {
                "enabled": True,
                "sink": "transports.kafka:KafkaTokenSink",
                "allow_unresolved_continuations": True,
                "sink_kwargs": {
                    "bootstrap_servers": bootstrap,
                    "topic": topic,
                    "delivery_timeout_s": 20,
                    "producer_config": {"client.id": "configured-sink"},
                },
            }
        }
    )
    sink = config.build_sink()
    assert isinstance(sink, KafkaTokenSink)

    async def run() -> None:
        await sink.put(make_entry("r-config", "c1"))
        await sink.close()

    asyncio.run(run())


def test_a_sink_built_from_config_in_a_spawned_process_delivers_entries(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    process = multiprocessing.get_context("spawn").Process(
        target=put_through_configured_sink, args=(kafka_bootstrap, kafka_topic)
    )
    process.start()
    process.join(120)
    assert process.exitcode == 0

    async def check() -> None:
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            snapshot = await source.freeze("r-config")
            assert [entry.canonical_json() for entry in snapshot.entries] == [
                make_entry("r-config", "c1").canonical_json()
            ]
        finally:
            await source.close()

    asyncio.run(check())
