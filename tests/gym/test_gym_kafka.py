"""Gym 0.7.0's middleware writes Gym entries through ``KafkaTokenSink``; Gym's builder and delivery read
``KafkaTokenSource`` snapshots (a real broker).

tokcap has no lineage store over Kafka yet, so Gym's middleware here resolves parents with Gym's own
``FileLineageStore`` over a reference directory that Gym's own store fills with the same entries (the
``_Both`` sink below is test scaffolding, not a tokcap feature). What is checked is the transport: Gym
objects go in as they are, and Gym's builder and delivery rebuild from the Kafka snapshots exactly what
they rebuild from Gym's own store.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from gym_rollouts import Rollout, drive, tool_use_rollout, with_lost_call, without_snapshot_identity
from gym_wheel import GymModules, needs_gym_build_sink

from bench.kafka_external import start_materializer_process
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka


class _Both:
    """Writes each call to Gym's reference store, then to the Kafka sink under test."""

    def __init__(self, reference: Any, kafka: KafkaTokenSink) -> None:
        self.reference = reference
        self.kafka = kafka

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self.reference.begin_call(rollout_id, model_call_id)
        await self.kafka.begin_call(rollout_id, model_call_id)

    async def put(self, entry: Any) -> None:
        await self.reference.put(entry)
        await self.kafka.put(entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self.reference.mark_incomplete(rollout_id, model_call_id)
        await self.kafka.mark_incomplete(rollout_id, model_call_id)

    async def close(self) -> None:
        await self.kafka.close()


async def _capture(gym: GymModules, rollout: Rollout, bootstrap: str, topic: str, reference_dir: Path) -> Any:
    reference = gym.store.TokenCaptureStore(reference_dir)
    lineage = gym.lineage.FileLineageStore(reference_dir)
    sink = _Both(reference, KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic))
    try:
        await drive(gym, rollout, sink, lineage)
    finally:
        await sink.close()
        await lineage.close()
    return reference


def test_gym_builds_the_same_trajectory_from_a_kafka_snapshot_as_from_its_own_store(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout = tool_use_rollout("kafka-tool-use-1")

    async def run() -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        reference = await _capture(gym, rollout, kafka_bootstrap, kafka_topic, tmp_path / "gym")
        expected = await gym.consumer.trajectories_from_source(
            rollout.rollout_id, reference, model="policy", verified_response=rollout.final_response
        )
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "kafka"
        )
        try:
            built = await gym.consumer.trajectories_from_source(
                rollout.rollout_id, source, model="policy", verified_response=rollout.final_response
            )
            snapshot = await source.freeze(rollout.rollout_id)
        finally:
            await source.close()
        gym_snapshot = reference.freeze_now(rollout.rollout_id)
        return (
            expected,
            built,
            [sorted(e.model_dump(mode="json").items()) for e in gym_snapshot.entries]
            + [sorted(e.model_dump(mode="json").items()) for e in snapshot.entries],
        )

    expected, built, dumps = asyncio.run(run())
    assert built["mask_sample"] is False, built.get("metrics")
    assert without_snapshot_identity(built) == without_snapshot_identity(expected)
    gym.builder.assert_prefix_contiguity(built["rebuilt_response"])
    half = len(dumps) // 2
    assert sorted(dumps[half:]) == sorted(dumps[:half]), "the Kafka snapshot carries Gym's entries unchanged"


@pytest.mark.parametrize("materializer", ["in the trainer", "in its own process"])
def test_gyms_delivery_over_kafka_masks_a_lost_call_and_retires_a_clean_rollout(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path, materializer: str
) -> None:
    clean = tool_use_rollout("kafka-tool-use-2")
    lost = with_lost_call(tool_use_rollout("kafka-tool-use-3"), "call-3")
    clean_result, lost_result = clean.result(), lost.result()
    own_process = materializer == "in its own process"

    async def run() -> tuple[bool, bool]:
        await _capture(gym, clean, kafka_bootstrap, kafka_topic, tmp_path / "gym")
        await _capture(gym, lost, kafka_bootstrap, kafka_topic, tmp_path / "gym")
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            store_dir=tmp_path / "kafka",
            external_materializer=own_process,
        )
        try:
            built = await gym.delivery.finalize_rollout_token_capture(clean_result, source)
            with pytest.warns(UserWarning, match="masking"):
                masked = await gym.delivery.finalize_rollout_token_capture(lost_result, source)
            retired = await gym.delivery.retire_rollout_token_capture(clean.rollout_id, source, built)
            kept = await gym.delivery.retire_rollout_token_capture(lost.rollout_id, source, masked)
            return retired, kept
        finally:
            await source.close()

    # A materializer in its own process: the trainer's source follows it through the directory's files.
    process = (
        start_materializer_process(
            kafka_bootstrap, kafka_topic, tmp_path / "kafka", tmp_path / "materializer.log"
        )
        if own_process
        else None
    )
    try:
        retired, kept = asyncio.run(run())
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
    assert "mask_sample" not in clean_result
    assert clean_result["_ng_token_capture"]["n_calls"] == 4
    assert [
        item["generation_token_ids"]
        for item in clean_result["response"]["output"]
        if "generation_token_ids" in item
    ] == [
        [101, 102, 103],
        [104, 105],
        [109, 110],
    ]
    assert lost_result["mask_sample"] is True
    assert lost_result["_ng_token_capture"]["capture_incomplete"] is True
    assert retired is True
    assert kept is False


@needs_gym_build_sink
def test_a_gym_user_with_the_documented_kafka_block_gets_single_call_rollouts_delivered_and_multi_call_masked(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    block = {
        "token_id_capture": {
            "enabled": True,
            "sink": "transports.kafka:KafkaTokenSink",
            "sink_kwargs": {"bootstrap_servers": kafka_bootstrap, "topic": kafka_topic},
            "allow_unresolved_continuations": True,
            "rebuild_response": False,
        }
    }
    single = tool_use_rollout("kafka-docs-single", retry_last=False)
    single.calls[:] = single.calls[:1]
    multi = tool_use_rollout("kafka-docs-multi", retry_last=False)
    single_result, multi_result = single.result(), multi.result()

    async def run() -> None:
        config = gym.config.token_id_capture_config(block)
        sink = config.build_sink()
        assert config.build_lineage_store() is None
        try:
            await drive(gym, single, sink, None)
            await drive(gym, multi, sink, None)
        finally:
            await sink.close()
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            await gym.delivery.finalize_rollout_token_capture(single_result, source)
            with pytest.warns(UserWarning, match="masking"):
                await gym.delivery.finalize_rollout_token_capture(multi_result, source)
        finally:
            await source.close()

    asyncio.run(run())
    assert "mask_sample" not in single_result
    assert single_result["response"]["output"][0]["generation_token_ids"] == [101, 102, 103]
    # Without a lineage store every continuation is unresolved, and Gym masks the rollout.
    assert multi_result["mask_sample"] is True
    assert multi_result["_ng_token_capture"]["unresolved_parent_calls"] == 2
