"""Scale-out: ``tokcap materialize --workers N`` into one directory, and partition subsets on several "nodes".

Workers apply disjoint partition subsets into one directory, which ends byte-identical to one worker's and
to a clean replay's. Materializers owning partition subsets in separate directories together cover every
rollout, and ``PartitionedTokenSource`` freezes each rollout through the directory owning its partition.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap
from filelock import FileLock
from kafka_broker_fixture import TopicFactory
from store_contract import directory_contents, make_entry
from test_kafka_replay import mixed_run

from tests.topic_replay import replay_topic
from transports.kafka import KafkaTokenSink, KafkaTokenSource, Materializer, PartitionedTokenSource
from transports.kafka.cli.options import parse_partitions
from transports.kafka.errors import PartitionOwnerMissingError, PartitionOwnershipConflictError
from transports.kafka.materializer.ownership import OWNER_LOCK_PREFIX, owned_partitions
from transports.kafka.materializer.workers import MaterializerWorkers

pytestmark = pytest.mark.kafka

_PARTITIONS = 4


@pytest.fixture(scope="module")
def filled_topic(kafka_broker: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A 4-partition topic holding a mixed run (chunks, conflicts, late writes, removals) and its live store."""
    topics = TopicFactory(kafka_broker, "scale-out")
    try:
        topic = topics("workers", partitions=_PARTITIONS)
        live = tmp_path_factory.mktemp("scale-out") / "live"
        asyncio.run(mixed_run(kafka_broker.bootstrap, topic, live, rollouts=16))
        yield topic, live
    finally:
        topics.cleanup()


def _materialize(bootstrap: str, topic: str, directory: Path, *extra: str) -> Any:
    return tokcap(
        "materialize", "--bootstrap", bootstrap, "--topic", topic, "--dir", str(directory),
        "--until-caught-up", *extra,
    )  # fmt: skip


def _locks_free(directory: Path) -> bool:
    """Every partition lock of the directory can be taken: no worker still holds one."""
    for partition in range(_PARTITIONS):
        lock = FileLock(directory / f"{OWNER_LOCK_PREFIX}{partition}.lock", timeout=0)
        lock.acquire()
        lock.release()
    return True


def test_two_workers_write_the_same_bytes_as_one_worker_and_as_a_clean_replay(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, live = filled_topic
    two, one, replayed = tmp_path / "two", tmp_path / "one", tmp_path / "replayed"
    completed = _materialize(kafka_bootstrap, topic, two, "--workers", "2")
    assert completed.returncode == 0, completed.stderr
    assert "worker 0 (pid" in completed.stderr and "applies partitions [0, 2]" in completed.stderr
    assert "applies partitions [1, 3]" in completed.stderr
    assert _materialize(kafka_bootstrap, topic, one).returncode == 0
    replay_topic(kafka_bootstrap, topic, replayed)
    written = directory_contents(two)
    assert any(name.endswith(".tokens.state.json") for name in written)
    assert sorted(owned_partitions(two, topic)) == list(range(_PARTITIONS))
    assert written == directory_contents(one)
    assert written == directory_contents(replayed)
    assert written == directory_contents(live)


def test_workers_with_small_durable_blocks_write_the_same_bytes_as_one_worker_with_the_default(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, _ = filled_topic
    small, default = tmp_path / "small", tmp_path / "default"
    completed = _materialize(kafka_bootstrap, topic, small, "--workers", "2", "--block-messages", "7")
    assert completed.returncode == 0, completed.stderr
    assert _materialize(kafka_bootstrap, topic, default).returncode == 0
    assert directory_contents(small) == directory_contents(default)
    refused = _materialize(kafka_bootstrap, topic, tmp_path / "refused", "--block-messages", "0")
    assert refused.returncode == 2 and "--block-messages" in refused.stderr


def test_each_worker_applies_in_the_block_size_it_was_given(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, _ = filled_topic
    supervisor = MaterializerWorkers(
        kafka_bootstrap, topic, tmp_path / "d", list(range(_PARTITIONS)), 2, block_messages=7
    )
    try:
        supervisor.start()
        deadline = time.monotonic() + 60
        while None in supervisor.ready_reports() and time.monotonic() < deadline:
            supervisor.poll(0.2)
    finally:
        supervisor.stop()
    texts = [report.text if report is not None else None for report in supervisor.ready_reports()]
    assert texts == ["blocks of up to 7 messages"] * 2


def test_more_workers_than_partitions_is_refused_in_one_line(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, _ = filled_topic
    completed = _materialize(kafka_bootstrap, topic, tmp_path / "d", "--workers", "3", "--partitions", "0-1")
    assert completed.returncode == 1
    assert "--workers 3 is more than the 2 partitions" in completed.stderr


def test_workers_refuse_a_directory_where_another_materializer_applies_one_of_their_partitions(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, _ = filled_topic
    store = tmp_path / "store"
    holder = Materializer(kafka_bootstrap, topic, store, [3])
    holder.start()
    try:
        completed = _materialize(kafka_bootstrap, topic, store, "--workers", "2")
    finally:
        holder.stop()
    assert completed.returncode == 1
    lines = completed.stderr.strip().splitlines()
    assert lines[-1].startswith("tokcap: error: ") and "partition 3" in lines[-1]
    assert "already being materialized" in lines[-1]
    assert _locks_free(store)


def _start_workers(
    bootstrap: str, topic: str, directory: Path, log: Path
) -> tuple[subprocess.Popen[bytes], list[int]]:
    command = [sys.executable, "-m", "tokcap.cli", "materialize", "--bootstrap", bootstrap, "--topic", topic]
    command += ["--dir", str(directory), "--workers", "2", "--interval", "0.5"]
    with log.open("wb") as handle:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while len(pids := [int(p) for p in re.findall(rb"\(pid (\d+)\)", log.read_bytes())]) < 2:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return process, pids


def _caught_up(directory: Path, live: Path) -> bool:
    expected = {name: data for name, data in directory_contents(live).items() if "checkpoint" in name}
    return all(
        (directory / name).exists() and (directory / name).read_bytes() == data
        for name, data in expected.items()
    )


def test_sigterm_stops_every_worker_cleanly_with_the_checkpoints_written(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, live = filled_topic
    store = tmp_path / "store"
    process, pids = _start_workers(kafka_bootstrap, topic, store, tmp_path / "log")
    try:
        deadline = time.monotonic() + 60
        while not _caught_up(store, live) and time.monotonic() < deadline:
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, (tmp_path / "log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert "stopped; checkpoint written" in (tmp_path / "log").read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _locks_free(store)
    assert directory_contents(store) == directory_contents(live)


def test_a_worker_that_dies_is_reported_and_the_other_workers_stop_cleanly(
    filled_topic: tuple[str, Path], kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, live = filled_topic
    store = tmp_path / "store"
    log = tmp_path / "log"
    process, pids = _start_workers(kafka_bootstrap, topic, store, log)
    try:
        os.kill(pids[1], signal.SIGKILL)
        assert process.wait(timeout=60) == 1, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("tokcap: error: materializer worker 1 (partitions [1, 3])"), last
    assert (
        "exited with code -9" in last and "the other workers stopped with their checkpoints written" in last
    )
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
    assert _locks_free(store)
    # Restarting resumes every partition from its checkpoint and ends with the same store.
    assert _materialize(kafka_bootstrap, topic, store, "--workers", "2").returncode == 0
    assert directory_contents(store) == directory_contents(live)


class _Node:
    """A long-running ``tokcap materialize --partitions`` process, standing for one node."""

    def __init__(self, bootstrap: str, topic: str, directory: Path, partitions: str, log: Path) -> None:
        command = [
            sys.executable,
            "-m",
            "tokcap.cli",
            "materialize",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
        ]
        command += ["--dir", str(directory), "--partitions", partitions]
        with log.open("wb") as handle:
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=handle, env=dict(os.environ)
            )
        deadline = time.monotonic() + 120
        # The owner records are written once the partitions' locks are held, before anything is applied.
        while owned_partitions(directory, topic) != set(parse_partitions(partitions) or []):
            assert self.process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


async def _freeze_each(
    bootstrap: str, topic: str, directories: list[Path], rollouts: list[str]
) -> dict[str, Any]:
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = PartitionedTokenSource(
        bootstrap_servers=bootstrap, topic=topic, store_dirs=directories, timeout_s=30
    )
    try:
        for rollout_id in rollouts:
            await sink.put(make_entry(rollout_id, "c1"))
        frozen = {rid: await source.freeze(rid) for rid in rollouts}
        removed = await source.retire(rollouts[::-1])
        return {
            "entries": {rid: [e.model_call_id for e in snapshot.entries] for rid, snapshot in frozen.items()},
            "owner": {rid: source.owner_of(rid) for rid in rollouts},
            "partition": {rid: source.partition_of(rid) for rid in rollouts},
            "removed": removed.removed,
        }
    finally:
        await sink.close()
        await source.close()


def test_two_nodes_partition_subsets_cover_every_rollout_and_the_source_freezes_each_at_its_owner(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("nodes", partitions=_PARTITIONS)
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    nodes = [
        _Node(kafka_bootstrap, topic, node_a, "0-1", tmp_path / "a.log"),
        _Node(kafka_bootstrap, topic, node_b, "2-3", tmp_path / "b.log"),
    ]
    rollouts = [f"r{n}" for n in range(16)]
    try:
        seen = asyncio.run(_freeze_each(kafka_bootstrap, topic, [node_a, node_b], rollouts))
    finally:
        for node in nodes:
            node.stop()
    assert seen["entries"] == {rid: ["c1"] for rid in rollouts}
    assert seen["removed"] == tuple(rollouts[::-1])
    assert {seen["partition"][rid] for rid in rollouts} == set(range(_PARTITIONS))
    for rid in rollouts:
        owner = node_a if seen["partition"][rid] < 2 else node_b
        other = node_b if owner == node_a else node_a
        assert seen["owner"][rid] == owner
        assert (owner / f"{rid}.tokens.state.json").exists()
        assert not any(other.glob(f"{rid}.tokens.*"))
    assert sorted(owned_partitions(node_a, topic)) == [0, 1]
    assert sorted(owned_partitions(node_b, topic)) == [2, 3]


def test_overlapping_partition_subsets_in_two_directories_are_refused_naming_the_partition(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("overlap", partitions=_PARTITIONS)
    assert _materialize(kafka_bootstrap, topic, tmp_path / "a", "--partitions", "0-2").returncode == 0
    assert _materialize(kafka_bootstrap, topic, tmp_path / "b", "--partitions", "2-3").returncode == 0
    with pytest.raises(
        PartitionOwnershipConflictError, match=r"partition 2 of .* is owned by both .*/a and .*/b"
    ):
        PartitionedTokenSource(bootstrap_servers=kafka_bootstrap, topic=topic, parent_dir=tmp_path)


async def _freeze_one(bootstrap: str, topic: str, directory: Path, rollout_id: str) -> None:
    source = PartitionedTokenSource(
        bootstrap_servers=bootstrap, topic=topic, store_dirs=[directory], timeout_s=300
    )
    try:
        await source.freeze(rollout_id)
    finally:
        await source.close()


def test_a_rollout_whose_partition_no_directory_owns_is_a_typed_error_naming_the_partition(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("missing", partitions=_PARTITIONS)
    assert _materialize(kafka_bootstrap, topic, tmp_path / "a", "--partitions", "0-1").returncode == 0
    from transports.kafka.wire.partitioner import partition_of_rollout

    orphan = next(f"r{n}" for n in range(100) if partition_of_rollout(f"r{n}", _PARTITIONS) >= 2)
    partition = partition_of_rollout(orphan, _PARTITIONS)
    with pytest.raises(PartitionOwnerMissingError, match=rf"no materializer owns partition {partition} of "):
        asyncio.run(_freeze_one(kafka_bootstrap, topic, tmp_path / "a", orphan))


async def _freeze_through_a_directory_owning_nothing(bootstrap: str, topic: str, directory: Path) -> None:
    source = KafkaTokenSource(
        bootstrap_servers=bootstrap,
        topic=topic,
        store_dir=directory,
        external_materializer=True,
        timeout_s=300,
        owns_partition=lambda partition: False,
    )
    try:
        await source.freeze("r1")
    finally:
        await source.close()


def test_a_command_landing_on_a_partition_its_directory_does_not_own_is_refused_at_once(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    with pytest.raises(
        PartitionOwnerMissingError, match=r"freeze of rollout 'r1' landed on partition 0 of .*does not own"
    ):
        asyncio.run(_freeze_through_a_directory_owning_nothing(kafka_bootstrap, kafka_topic, tmp_path / "d"))
