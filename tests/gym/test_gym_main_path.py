"""Gym main's package path: with Gym 0.7.0's modules importable as ``nemo_gym.models.token_capture`` too (the
same module objects, so Gym's type checks hold), tokcap takes Gym's classes from there and the staging
conformance passes on both transports (over Kafka on a topic made with its staged payloads apart)."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gym_wheel import GymModules
from kafka_broker_fixture import TopicFactory
from staged_layout import keys_staged_apart
from test_gym_staging_conformance import ALL_CHECKS

from tokcap.gym_package import GYM_PACKAGES, gym_module, gym_package
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource
from tokcap.staging.conformance import run_staging_conformance
from tokcap.staging.example_calls import staged_record
from tokcap.staging.gym_types import staging_records_module
from tokcap.staging.records import staging_key

MAIN, RELEASED = GYM_PACKAGES


@pytest.fixture
def gym_under_mains_path(gym: GymModules, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every module of Gym 0.7.0's capture package, also registered under Gym main's path."""
    package_dir = gym.source_dir / "nemo_gym" / "token_id_capture"
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            importlib.import_module(f"{RELEASED}.{name}" if name else RELEASED)
        except ImportError:
            continue  # a module needing what this environment lacks (a server framework) is not aliased
    monkeypatch.setitem(sys.modules, "nemo_gym.models", importlib.util.module_from_spec(_namespace()))
    for name, module in list(sys.modules.items()):
        if module is not None and (name == RELEASED or name.startswith(f"{RELEASED}.")):
            monkeypatch.setitem(sys.modules, MAIN + name[len(RELEASED) :], module)
    yield


def _namespace() -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec("nemo_gym.models", None, is_package=True)


def test_with_both_paths_importable_tokcap_takes_gyms_classes_from_mains_path(
    gym_under_mains_path: None,
) -> None:
    assert gym_package() == MAIN
    main_records = sys.modules[f"{MAIN}.staging.records"]
    assert gym_module("staging.records") is main_records
    assert staging_records_module() is main_records
    assert main_records is sys.modules[f"{RELEASED}.staging.records"]


def test_without_mains_path_tokcap_takes_gyms_classes_from_0_7_0s(gym: GymModules) -> None:
    assert MAIN not in sys.modules
    assert gym_package() == RELEASED
    assert staging_records_module() is sys.modules[f"{RELEASED}.staging.records"]


def test_the_file_transport_passes_every_staging_check_under_mains_path(
    gym_under_mains_path: None, tmp_path: Path
) -> None:
    passed = asyncio.run(
        run_staging_conformance(
            lambda: FileStagingSink(tmp_path),
            lambda: FileStagingSource(tmp_path),
            lambda: FileLineageResolver(tmp_path),
        )
    )
    assert passed == ALL_CHECKS
    record, _ = staged_record("r-main-path", "c0", [1, 2], [3], None)
    main_records = sys.modules[f"{MAIN}.staging.records"]
    assert isinstance(record, main_records.StagedCallRecord)
    assert FileStagingSink(tmp_path).stage(record).ok
    (snapshot,) = FileStagingSource(tmp_path).fetch([staging_key("r-main-path", "c0")])
    assert isinstance(snapshot, main_records.StagedCallBaseSnapshot)


def test_the_kafka_transport_passes_every_staging_check_under_mains_path(
    gym_under_mains_path: None, kafka_topic_factory: TopicFactory, tmp_path: Path
) -> None:
    from transports.kafka.lineage import KafkaLineageResolver
    from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

    topic = kafka_topic_factory.staged_apart()
    where = {"bootstrap_servers": kafka_topic_factory.bootstrap, "topic": topic}
    passed = asyncio.run(
        run_staging_conformance(
            lambda: KafkaStagingSink(**where),
            lambda: KafkaStagingSource(**where, store_dir=tmp_path),
            lambda: KafkaLineageResolver(**where, store_dir=tmp_path),
        )
    )
    assert passed == ALL_CHECKS
    assert keys_staged_apart(kafka_topic_factory.bootstrap, topic)
