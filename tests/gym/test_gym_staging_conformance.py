"""The staging conformance kit passes on both tokcap transports (the file store and Kafka), with tokcap's ledger
and with Gym's ``FileLineageStore`` as the ledger, and fails on implementations that break the contract.

Over Kafka it runs on topics made as ``tokcap topic create`` makes them (staged payloads on a topic of their
own) and once on an older topic (stages inline), and checks from the topics' headers where the stages went."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from gym_wheel import GymModules
from kafka_broker_fixture import TopicFactory
from staged_layout import keys_staged_apart, stage_messages_inline

from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource
from tokcap.staging.conformance import StagingConformanceError, run_staging_conformance

ALL_CHECKS = [
    "stage_then_fetch_by_a_fresh_source",
    "extras_and_attachments_come_back_exactly",
    "repeat_is_ok_and_conflict_is_refused",
    "fetch_keeps_order_and_missing_keys_raise",
    "concurrent_stages_lose_nothing",
    "ledger_records_once_and_refuses_changes",
    "ledger_failures_poison_the_manifest",
    "ledger_resolves_parents_by_fingerprint",
    "a_staged_rollout_verifies_end_to_end",
]


def _run(sink: Any, source: Any, ledger: Any) -> list[str]:
    return asyncio.run(run_staging_conformance(sink, source, ledger))


def test_the_file_transport_passes_every_staging_check_with_gyms_classes(
    gym: GymModules, tmp_path: Path
) -> None:
    passed = _run(
        lambda: FileStagingSink(tmp_path),
        lambda: FileStagingSource(tmp_path),
        lambda: FileLineageResolver(tmp_path),
    )
    assert passed == ALL_CHECKS


def test_the_file_transport_passes_with_gyms_file_lineage_store_as_the_ledger(
    gym: GymModules, tmp_path: Path
) -> None:
    ledger_dir = tmp_path / "gym-ledger"
    passed = _run(
        lambda: FileStagingSink(tmp_path / "staged"),
        lambda: FileStagingSource(tmp_path / "staged"),
        lambda: gym.lineage.FileLineageStore(ledger_dir),
    )
    assert passed == ALL_CHECKS


@pytest.mark.parametrize("payloads", ["apart", "inline"])
def test_the_kafka_transport_passes_every_staging_check_with_gyms_classes(
    gym: GymModules, kafka_topic_factory: TopicFactory, tmp_path: Path, payloads: str
) -> None:
    """On a topic made now (payloads apart) and on an older one (stages inline)."""
    from transports.kafka.lineage import KafkaLineageResolver
    from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

    topic = kafka_topic_factory.staged_apart() if payloads == "apart" else kafka_topic_factory()
    where = {"bootstrap_servers": kafka_topic_factory.bootstrap, "topic": topic}
    passed = _run(
        lambda: KafkaStagingSink(**where),
        lambda: KafkaStagingSource(**where, store_dir=tmp_path),
        lambda: KafkaLineageResolver(**where, store_dir=tmp_path),
    )
    assert passed == ALL_CHECKS
    if payloads == "apart":
        assert keys_staged_apart(kafka_topic_factory.bootstrap, topic)
    else:
        assert stage_messages_inline(kafka_topic_factory.bootstrap, topic)


def test_the_kafka_transport_passes_every_staging_check_with_no_store_dir_anywhere(
    gym: GymModules, kafka_topic_factory: TopicFactory
) -> None:
    from transports.kafka.lineage import KafkaLineageResolver
    from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

    topic = kafka_topic_factory.staged_apart()
    where = {"bootstrap_servers": kafka_topic_factory.bootstrap, "topic": topic}
    passed = _run(
        lambda: KafkaStagingSink(**where),
        lambda: KafkaStagingSource(**where),
        lambda: KafkaLineageResolver(**where),
    )
    assert passed == ALL_CHECKS
    assert keys_staged_apart(kafka_topic_factory.bootstrap, topic)


class _Float32Source(FileStagingSource):
    """A source that narrows log probs to float32, as a float32 column store would."""

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        import struct

        narrowed = []
        for snapshot in super().fetch(staging_keys):
            values = [struct.unpack("f", struct.pack("f", v))[0] for v in snapshot.generation_log_probs_delta]
            narrowed.append(snapshot.model_copy(update={"generation_log_probs_delta": values}))
        return narrowed


class _SilentConflictSink(FileStagingSink):
    """A sink that acknowledges a conflicting payload."""

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        result = super().stage(record, attachments=attachments)
        return (
            result
            if result.ok
            else type(result)(ok=True, staging_key=f"{record.rollout_id}/{record.model_call_id}")
        )


class _LenientLedger(FileLineageResolver):
    """A ledger that ignores what differs in a repeated commit."""

    async def record(self, commit: Any) -> None:
        with contextlib.suppress(ValueError):
            await super().record(commit)


@pytest.mark.parametrize(
    ("sink", "source", "ledger", "failing"),
    [
        (FileStagingSink, _Float32Source, FileLineageResolver, "stage_then_fetch_by_a_fresh_source"),
        (_SilentConflictSink, FileStagingSource, FileLineageResolver, "repeat_is_ok_and_conflict_is_refused"),
        (FileStagingSink, FileStagingSource, _LenientLedger, "ledger_records_once_and_refuses_changes"),
    ],
    ids=["float32-log-probs", "acknowledged-conflict", "lenient-ledger"],
)
def test_the_kit_names_the_check_a_broken_implementation_fails(
    gym: GymModules, tmp_path: Path, sink: Any, source: Any, ledger: Any, failing: str
) -> None:
    with pytest.raises(StagingConformanceError, match=failing):
        _run(lambda: sink(tmp_path), lambda: source(tmp_path), lambda: ledger(tmp_path))
