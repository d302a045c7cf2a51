"""Delta records over Kafka: tokcap's capture path stores suffixes through the Kafka sink, and every reader
rebuilds the full prompts from the topic, as from the file store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap
from gym_rollouts import tool_use_rollout
from test_gym_lineage import drive_with_tokcap

from tokcap.consumer import trajectories_from_source
from tokcap.delta_records import store_as_delta
from tokcap.lineage import FileLineageResolver
from tokcap.records import ParentResolutionStatus, TokenEntry, stamp_lineage
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


def _orphan_delta(rollout_id: str) -> TokenEntry:
    """A delta record whose parent was never stored: no reader can rebuild its prompt."""
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id="orphan",
        prompt_token_ids=[1, 2, 3, 4],
        generation_token_ids=[5],
        generation_log_probs=[-0.5],
    )
    cumulative = store_as_delta(entry, [1, 2, 3])
    return stamp_lineage(
        entry, "never-stored", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=cumulative
    )


def test_log_and_replay_rebuild_delta_prompts_from_the_topic_and_name_a_chain_that_cannot_be_rebuilt(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("r-readers")

    async def write() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        resolver = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        try:
            await drive_with_tokcap(rollout, sink, resolver, delta_records=True)
            await sink.put(_orphan_delta("r-orphan"))
        finally:
            await asyncio.gather(sink.close(), resolver.close())

    asyncio.run(write())
    logged = tokcap(
        "log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "r-readers", "--json"
    )
    assert logged.returncode == 0, logged.stderr
    lineage = logged.json()["lineage"]
    assert (lineage["delta_records"], lineage["sound"]) == (3, True)
    assert lineage["full_prompt_tokens"]["call-3"] == 14
    orphan = tokcap("log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "r-orphan")
    assert "orphan stores a delta prompt that cannot be rebuilt" in orphan.stdout

    replayed = tokcap(
        "replay",
        "--bootstrap",
        kafka_bootstrap,
        "--topic",
        kafka_topic,
        "--dir",
        str(tmp_path / "replay"),
        "--json",
    )
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.json()["lineage"] == {"delta_records": 4, "unproven_calls": {"r-orphan": ["orphan"]}}
    store = TokenCaptureStore(tmp_path / "replay")
    built = asyncio.run(trajectories_from_source("r-orphan", store))
    assert built.masked and "broken-delta-chain" in built.mask_reasons
