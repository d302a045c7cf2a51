"""Delta records over Kafka: tokcap's capture path stores suffixes through the Kafka sink, and every reader
rebuilds the full prompts from the topic, as from the file store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import tool_use_rollout
from test_gym_lineage import drive_with_tokcap

from tokcap.consumer import trajectories_from_source
from tokcap.lineage import FileLineageResolver
from tokcap.store import TokenCaptureStore
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.lineage import KafkaLineageResolver

pytestmark = pytest.mark.kafka


def test_a_rollout_captured_with_delta_records_over_kafka_is_delivered_as_the_file_store_delivers_it_full(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-kafka-delta")

    async def over_kafka() -> tuple[dict[str, Any], list[bool]]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "k"
        )
        try:
            await drive_with_tokcap(rollout, sink, resolver, delta_records=True)
            built = await trajectories_from_source(
                rollout.rollout_id, source, verified_response=rollout.final_response
            )
            snapshot = await source.freeze(rollout.rollout_id)
        finally:
            await asyncio.gather(sink.close(), resolver.close(), source.close())
        assert built.masked is False, built.mask_reasons
        assert built.response is not None
        ordered = sorted(snapshot.entries, key=lambda entry: entry.model_call_id)
        return built.response, [entry.prompt_is_delta for entry in ordered]

    async def full_in_files() -> dict[str, Any]:
        store = TokenCaptureStore(tmp_path / "f")
        await drive_with_tokcap(rollout, store, FileLineageResolver(tmp_path / "f"))
        built = await trajectories_from_source(
            rollout.rollout_id, store, verified_response=rollout.final_response
        )
        assert built.response is not None
        return built.response

    response, deltas = asyncio.run(over_kafka())
    assert deltas == [False, True, True, True]
    assert response == asyncio.run(full_in_files())
