"""A source answering from a directory that a separate materializer process feeds."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from store_contract import make_entry

from tokcap.errors import ConfigError, DeliveryTimeoutError
from tokcap.files.layout import RolloutPaths
from transports.kafka import KafkaTokenSink, KafkaTokenSource, Materializer
from transports.kafka import source as source_module
from transports.kafka.client.admin import watermarks
from transports.kafka.errors import MaterializerFailedError

pytestmark = pytest.mark.kafka


def start_materializer_process(
    bootstrap: str, topic: str, store_dir: Path, log: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "transports.kafka.materializer", "--bootstrap", bootstrap]
    command += ["--topic", topic, "--dir", str(store_dir)]
    with log.open("ab") as handle:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle)
    deadline = time.monotonic() + 60
    while b"materializer ready" not in log.read_bytes():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return process


async def scripted_run(bootstrap: str, topic: str, store_dir: Path) -> dict[str, Any]:
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(
        bootstrap_servers=bootstrap,
        topic=topic,
        store_dir=store_dir,
        external_materializer=True,
        timeout_s=30,
    )
    outcome: dict[str, Any] = {}
    try:
        for call in ("c1", "c2"):
            await sink.begin_call("kept", call)
            await sink.put(make_entry("kept", call))
        snapshot = await source.freeze("kept")
        outcome["entries"] = sorted(e.model_call_id for e in snapshot.entries)
        outcome["incomplete"] = snapshot.incomplete
        outcome["refreeze_same"] = await source.freeze("kept") == snapshot
        outcome["dropped"] = await source.drop("kept", snapshot.snapshot_id, snapshot.version)

        await sink.put(make_entry("raced", "c1"))
        raced = await source.freeze("raced")
        await sink.put(make_entry("raced", "late"))
        outcome["stale_drop"] = await source.drop("raced", raced.snapshot_id, raced.version)

        await sink.put(make_entry("to-retire", "c1"))
        outcome["retire"] = (await source.retire(["to-retire", "never-written"])).to_dict()
        outcome["delete"] = (await source.delete(["to-retire", "never-written-2"])).to_dict()
    finally:
        await sink.close()
        await source.close()
    return outcome


def test_a_source_answers_through_a_materializer_running_in_another_process(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("external", partitions=2)
    store_dir = tmp_path / "store"
    process = start_materializer_process(kafka_bootstrap, topic, store_dir, tmp_path / "materializer.log")
    try:
        outcome = asyncio.run(scripted_run(kafka_bootstrap, topic, store_dir))
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert outcome["entries"] == ["c1", "c2"]
    assert outcome["incomplete"] is False
    assert outcome["refreeze_same"] is True
    assert outcome["dropped"] is True
    assert outcome["stale_drop"] is False
    assert outcome["retire"] == {"removed": ["to-retire"], "not_found": ["never-written"]}
    assert outcome["delete"] == {"removed": ["to-retire"], "not_found": ["never-written-2"]}


def test_without_a_running_materializer_a_command_times_out_naming_rollout_and_offset(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    async def freeze_alone() -> None:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            store_dir=tmp_path,
            external_materializer=True,
            timeout_s=1.0,
        )
        try:
            await source.freeze("lonely")
        finally:
            await source.close()

    with pytest.raises(DeliveryTimeoutError, match=r"'lonely'.*partition 0 offset 0"):
        asyncio.run(freeze_alone())


def test_an_external_source_has_no_in_process_materializer(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    async def probe() -> None:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            store_dir=tmp_path,
            external_materializer=True,
        )
        try:
            with pytest.raises(ConfigError, match="external materializer"):
                _ = source.materializer
        finally:
            await source.close()

    asyncio.run(probe())


def test_a_second_materializer_of_the_same_partitions_and_directory_is_refused_until_the_first_stops(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("owners", partitions=2)
    first = Materializer(kafka_bootstrap, topic, tmp_path)
    first.start()
    try:
        with pytest.raises(MaterializerFailedError, match="already being materialized"):
            Materializer(kafka_bootstrap, topic, tmp_path, partitions=[1]).start()
    finally:
        first.stop()
    halves = [Materializer(kafka_bootstrap, topic, tmp_path, partitions=[p]) for p in (0, 1)]
    for half in halves:
        half.start()
    try:
        assert [set(half.applied_offsets()) for half in halves] == [{0}, {1}]
        for partition in (0, 1):
            with pytest.raises(MaterializerFailedError, match=f"partition {partition} .*already being"):
                Materializer(kafka_bootstrap, topic, tmp_path, partitions=[partition]).start()
    finally:
        for half in halves:
            half.stop()
    whole = Materializer(kafka_bootstrap, topic, tmp_path)
    whole.start()
    try:
        assert set(whole.applied_offsets()) == {0, 1}, "a stopped materializer kept its partitions"
    finally:
        whole.stop()


def _wait_for_end_offset(bootstrap: str, topic: str, end: int) -> None:
    """Block until partition 0 of ``topic`` holds ``end`` messages: the last command has been published."""
    deadline = time.monotonic() + 60
    while watermarks(bootstrap, topic)[0][1] < end:
        assert time.monotonic() < deadline, f"offset {end - 1} was never published"
        time.sleep(0.05)


async def commands_followed_by_later_events(bootstrap: str, topic: str, store_dir: Path) -> dict[str, Any]:
    """Commands applied while their sources wait on another materializer, each followed by another of its rollout."""
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    sources = [
        KafkaTokenSource(
            bootstrap_servers=bootstrap,
            topic=topic,
            store_dir=store_dir,
            external_materializer=True,
            timeout_s=60,
        )
        for _ in range(2)
    ]
    mine, other = sources
    outcome: dict[str, Any] = {}
    try:
        first = Materializer(bootstrap, topic, store_dir)
        first.start()
        try:
            await sink.put(make_entry("r", "c1"))
            await sink.put(make_entry("r2", "c1"))
            snapshot = await mine.freeze("r2")
        finally:
            first.stop()
        # No materializer runs now: every command below is published before anything after it is applied.
        commands: list[Callable[[], Coroutine[Any, Any, Any]]] = [
            lambda: mine.drop("r2", snapshot.snapshot_id, snapshot.version),
            lambda: other.delete(["r"]),
            lambda: mine.delete(["r"]),
            lambda: other.delete(["r2"]),
            lambda: other.retire(["r"]),
        ]
        waiting: list[asyncio.Task[Any]] = []
        for offset, command in enumerate(commands, start=3):
            waiting.append(asyncio.create_task(command()))
            await asyncio.to_thread(_wait_for_end_offset, bootstrap, topic, offset + 1)
        second = Materializer(bootstrap, topic, store_dir)
        second.start()
        try:
            dropped, *removals = await asyncio.gather(*waiting)
        finally:
            second.stop()
        outcome["dropped"] = dropped
        outcome["removals"] = [removal.to_dict() for removal in removals]
    finally:
        await sink.close()
        for source in sources:
            await source.close()
    return outcome


def test_a_following_source_reads_its_own_commands_verdict_though_later_events_of_the_rollout_were_applied(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    outcome = asyncio.run(commands_followed_by_later_events(kafka_bootstrap, kafka_topic, tmp_path / "store"))
    assert outcome["dropped"] is True
    assert outcome["removals"] == [
        {"removed": ["r"], "not_found": []},
        {"removed": [], "not_found": ["r"]},
        {"removed": ["r2"], "not_found": []},
        {"removed": [], "not_found": ["r"]},
    ]


def test_a_small_rollouts_freeze_is_answered_on_the_event_loop_and_a_larger_ones_on_a_thread(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trip to a worker thread costs a busy process tens of milliseconds; reading a small answer about one."""
    topic = kafka_topic_factory("inline-answers")
    store_dir = tmp_path / "store"
    trips: list[str] = []
    thread_trip = asyncio.to_thread

    async def counted_trip(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        trips.append(getattr(func, "__name__", repr(func)))
        return await thread_trip(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted_trip)
    materializer = Materializer(kafka_bootstrap, topic, store_dir)
    materializer.start()

    async def run() -> tuple[int, int, list[str], list[str]]:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=topic)
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=topic,
            store_dir=store_dir,
            external_materializer=True,
            timeout_s=30,
        )
        try:
            await sink.put(make_entry("small", "c1"))
            for call in ("c1", "c2", "c3"):
                await sink.put(make_entry("larger", call))
            small = await source.freeze("small")
            small_trips = list(trips)
            entries = RolloutPaths.of(store_dir, "small").entries
            monkeypatch.setattr(source_module, "_INLINE_ANSWER_BYTES", entries.stat().st_size)
            larger = await source.freeze("larger")
            return len(small.entries), len(larger.entries), small_trips, trips[len(small_trips) :]
        finally:
            await sink.close()
            await source.close()

    try:
        small_entries, larger_entries, small_trips, larger_trips = asyncio.run(run())
    finally:
        materializer.stop()
    assert (small_entries, larger_entries) == (1, 3)
    assert "_answer_from_files" not in small_trips
    assert "_answer_from_files" in larger_trips
