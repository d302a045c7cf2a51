"""Gym 0.7.0's conformance kit (``run_conformance``) against tokcap's transports and tokcap's lineage resolvers.

Plain constructors, no adapter, and no Gym class on tokcap's side: the lineage checks run with
``tokcap.lineage.FileLineageResolver`` and ``transports.kafka.lineage.KafkaLineageResolver``.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from gym_wheel import GymModules
from kafka_broker_fixture import TopicFactory

from tokcap.lineage import FileLineageResolver
from tokcap.store import TokenCaptureStore
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.lineage import KafkaLineageResolver

FILE_STORE_CHECKS = [
    "put_then_freeze_visibility",
    "idempotent_reput",
    "conflicting_reput",
    "mark_incomplete_durability",
    "freeze_idempotency",
    "post_freeze_write_safety",
    "conditional_retirement",
    "lineage_visibility",
    "fresh_client_lineage_visibility",
    "begin_call_custody",
]


def test_the_file_store_passes_every_check_of_gyms_conformance_kit_with_tokcaps_resolver(
    gym: GymModules, tmp_path: Path
) -> None:
    passed = asyncio.run(
        gym.conformance.run_conformance(
            lambda: TokenCaptureStore(tmp_path),
            lambda: TokenCaptureStore(tmp_path),
            lambda: FileLineageResolver(tmp_path),
        )
    )
    assert passed == FILE_STORE_CHECKS


def test_the_file_store_passes_every_check_of_gyms_conformance_kit_with_gyms_resolver(
    gym: GymModules, tmp_path: Path
) -> None:
    passed = asyncio.run(
        gym.conformance.run_conformance(
            lambda: TokenCaptureStore(tmp_path),
            lambda: TokenCaptureStore(tmp_path),
            lambda: gym.lineage.FileLineageStore(tmp_path),
        )
    )
    assert passed == FILE_STORE_CHECKS


@pytest.mark.kafka
def test_the_kafka_transport_passes_every_check_of_gyms_conformance_kit_with_tokcaps_resolver(
    gym: GymModules, kafka_bootstrap: str, kafka_topic_factory: TopicFactory, tmp_path: Path
) -> None:
    # Several partitions, so the resolver must find the rollout's partition as the producer chose it.
    topic = kafka_topic_factory("lineage-conformance", partitions=3)
    directories = (tmp_path / f"source-{n}" for n in itertools.count())
    passed = asyncio.run(
        gym.conformance.run_conformance(
            lambda: KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic),
            lambda: KafkaTokenSource(
                bootstrap_servers=kafka_bootstrap, topic=topic, store_dir=next(directories)
            ),
            lambda: KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=topic),
        )
    )
    assert passed == FILE_STORE_CHECKS


@pytest.mark.kafka
def test_the_kafka_transport_passes_every_check_of_gyms_conformance_kit_with_a_directory_per_source(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    directories = (tmp_path / f"source-{n}" for n in itertools.count())
    passed = asyncio.run(
        gym.conformance.run_conformance(
            lambda: KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic),
            lambda: KafkaTokenSource(
                bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=next(directories)
            ),
        )
    )
    assert passed == [name for name in FILE_STORE_CHECKS if "lineage" not in name]


@pytest.mark.kafka
def test_the_kafka_transport_passes_gyms_conformance_kit_with_every_source_on_one_directory(
    gym: GymModules, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    passed = asyncio.run(
        gym.conformance.run_conformance(
            lambda: KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic),
            lambda: KafkaTokenSource(
                bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path
            ),
        )
    )
    assert passed == [name for name in FILE_STORE_CHECKS if "lineage" not in name]
