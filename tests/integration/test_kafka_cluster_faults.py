"""A three-node cluster (replication 3, min.insync.replicas=2) losing nodes under load loses nothing acknowledged.

Sinks in three processes write while the test SIGKILLs the leader of the run topic's partition, then a
second node, then restarts both. Every put a sink acknowledged must be in its rollout's frozen snapshot,
no put may be in the log twice, a rollout whose put failed must be masked, and writing must resume.
The figures are printed (``-s``) for docs/operations.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kafka_broker_fixture import load_broker_module

from tokcap.errors import DeliveryTimeoutError
from tokcap.log.events import PutEvent
from tokcap.protocols import TokenCaptureSnapshot
from transports.kafka import KafkaTokenSource, TopicSettings, ensure_topic, topic_for_run
from transports.kafka.timeline import read_log
from transports.kafka.wire.codec import decode_event_value, headers_to_dict
from transports.kafka.wire.topic_limits import is_limits_record

pytestmark = pytest.mark.kafka

TESTS_DIR = Path(__file__).resolve().parent.parent
DELIVERY_TIMEOUT_S = 8.0
WAIT_S = 180.0
FREEZE_ATTEMPTS = 3
"""The longest any phase may take before the test fails; phases end on events, not on this."""


@dataclass
class Cluster:
    state_dir: Path
    bootstrap: str
    module: Any

    def leader(self, topic: str) -> int:
        from confluent_kafka.admin import AdminClient

        metadata = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(topic=topic, timeout=30)
        return int(metadata.topics[topic].partitions[0].leader)

    def resident_mb(self) -> dict[int, int]:
        """Resident memory of each running node, for the figures."""
        sizes: dict[int, int] = {}
        for node in (1, 2, 3):
            try:
                pid = (self.module.node_dir(self.state_dir, node) / "broker.pid").read_text().strip()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            kilobytes = next(
                int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
            )
            sizes[node] = kilobytes // 1024
        return sizes

    def kill(self, node: int) -> None:
        self.module.cluster_kill_node(self.state_dir, node)

    def start(self, node: int) -> None:
        self.module.cluster_start_node(self.state_dir, node)


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[Cluster]:
    module = load_broker_module()
    root = Path(module.default_state_dir())
    module.prune_orphans(root)
    state_dir = root / f"cluster-{os.getpid()}"
    try:
        bootstrap = module.cluster_start(state_dir, owner_pid=os.getpid())
    except Exception as exc:
        module.cluster_stop(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
        pytest.fail(f"the three-node Kafka cluster could not be started: {exc}")
    try:
        yield Cluster(state_dir, bootstrap, module)
    finally:
        module.cluster_stop(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)


@dataclass
class Writers:
    """Three writer processes and what they reported, with a condition to wait on their reports."""

    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    condition: threading.Condition = field(default_factory=threading.Condition)

    def start(self, bootstrap: str, run_id: str, count: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent)])}
        for number in range(count):
            process = subprocess.Popen(
                [sys.executable, str(TESTS_DIR / "cluster_writer.py"), bootstrap, run_id, f"w{number}",
                 str(DELIVERY_TIMEOUT_S)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            )  # fmt: skip
            self.processes.append(process)
            threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                with self.condition:
                    self.reports.append(json.loads(line))
                    self.condition.notify_all()

    def wait(self, what: str, done: Callable[[list[dict[str, Any]]], bool]) -> None:
        with self.condition:
            if not self.condition.wait_for(lambda: done(self.reports), WAIT_S):
                raise AssertionError(
                    f"writers did not reach: {what} within {WAIT_S:g} s; last: {self.reports[-5:]}"
                )

    def snapshot(self) -> list[dict[str, Any]]:
        with self.condition:
            return list(self.reports)

    def stop(self) -> None:
        """Close each writer's stdin (it stops after its current call) and wait for a clean exit."""
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            assert process.wait(timeout=WAIT_S) == 0

    def kill(self) -> None:
        """After a failed test: end the writers that are still running."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()


def acks(reports: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["ack"], r["call"]) for r in reports if "ack" in r]


async def _freeze_as_a_trainer_does(
    source: KafkaTokenSource, rollout: str, figures: dict[str, Any]
) -> TokenCaptureSnapshot:
    """Freeze, asking again after a delivery timeout, as a trainer does while the cluster elects a new leader.

    How long the election takes depends on the machine's load, and a freeze that timed out changed nothing
    the next one could be told apart from (a freeze is answered at its own position).
    """
    for attempt in range(FREEZE_ATTEMPTS):
        try:
            return await source.freeze(rollout)
        except DeliveryTimeoutError:
            figures["freezes_timed_out_during_the_election"] = (
                figures.get("freezes_timed_out_during_the_election", 0) + 1
            )
            if attempt == FREEZE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def test_losing_the_leader_and_then_a_quorum_loses_no_acknowledged_put(
    kafka_cluster: Cluster, tmp_path: Path
) -> None:
    run_id = f"cluster-{os.getpid()}"
    topic = topic_for_run(run_id)
    ensure_topic(
        kafka_cluster.bootstrap,
        topic,
        TopicSettings(partitions=1, replication_factor=3, config={"min.insync.replicas": "2"}),
    )
    writers = Writers()
    figures: dict[str, Any] = {}

    async def scenario() -> dict[str, Any]:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_cluster.bootstrap,
            run_id=run_id,
            store_dir=tmp_path / "store",
            delivery_timeout_s=DELIVERY_TIMEOUT_S,
            timeout_s=WAIT_S,
        )
        try:
            writers.start(kafka_cluster.bootstrap, run_id, 3)
            await asyncio.to_thread(writers.wait, "30 acknowledged puts", lambda r: len(acks(r)) >= 30)

            figures["resident_mb_under_load"] = kafka_cluster.resident_mb()
            leader = kafka_cluster.leader(topic)
            before_kill = len(acks(writers.snapshot()))
            killed_at = time.monotonic()
            kafka_cluster.kill(leader)
            done_before = [r["done"] for r in writers.snapshot() if "done" in r]
            frozen_during = [
                await _freeze_as_a_trainer_does(source, rollout, figures) for rollout in done_before[:6]
            ]
            assert all(not s.incomplete and len(s.entries) == 3 for s in frozen_during)
            await asyncio.to_thread(
                writers.wait, "30 more puts after the leader died", lambda r: len(acks(r)) >= before_kill + 30
            )
            figures["leader_kill"] = {
                "killed_node": leader,
                "acked_before": before_kill,
                "failed_puts": sum(1 for r in writers.snapshot() if "failed" in r),
                "seconds_to_30_more_acks": round(time.monotonic() - killed_at, 1),
            }

            second = next(n for n in (1, 2, 3) if n != leader)
            kafka_cluster.kill(second)
            await asyncio.to_thread(
                writers.wait,
                "a failed put in every writer",
                lambda r: {x["failed"].split("-")[0] for x in r if "failed" in x} >= {"w0", "w1", "w2"},
            )
            failures = [r for r in writers.snapshot() if "failed" in r]
            figures["quorum_loss"] = {
                "killed_node": second,
                "failed_puts": len(failures),
                "slowest_failure_s": round(max(r["seconds"] for r in failures), 1),
            }
            # The sink's bound: librdkafka's message timeout, or at most the bridge's 5 s answer grace after it
            # (plus a second for a loaded machine's scheduling).
            assert all(r["seconds"] <= DELIVERY_TIMEOUT_S + 6.0 for r in failures), failures

            kafka_cluster.start(leader)
            kafka_cluster.start(second)
            resumed_from = len(acks(writers.snapshot()))
            await asyncio.to_thread(
                writers.wait, "30 puts after both nodes returned", lambda r: len(acks(r)) >= resumed_from + 30
            )
            await asyncio.to_thread(writers.stop)

            reports = writers.snapshot()
            acknowledged = acks(reports)
            masked = {r["masked"] for r in reports if "masked" in r}
            failed = {r["failed"] for r in reports if "failed" in r}
            assert failed == masked, "every rollout whose put failed got its incomplete marker acknowledged"
            rollouts = sorted({rollout for rollout, _ in acknowledged} | failed)
            snapshots = {rollout: await source.freeze(rollout) for rollout in rollouts}
        finally:
            writers.kill()
            await source.close()
        lost = [(r, c) for r, c in acknowledged if c not in {e.model_call_id for e in snapshots[r].entries}]
        unmasked = [r for r in failed if not snapshots[r].incomplete]
        return {"acknowledged": acknowledged, "lost": lost, "unmasked": unmasked, "failed": failed}

    outcome = asyncio.run(scenario())
    puts = Counter()
    for message in read_log(kafka_cluster.bootstrap, topic, timeout_s=30):
        headers = headers_to_dict(list(message.headers))
        if message.value is not None and not is_limits_record(headers):
            event = decode_event_value(message.value, headers)
            if isinstance(event, PutEvent):
                puts[(event.rollout_id, event.entry.model_call_id)] += 1
    duplicated = {key: n for key, n in puts.items() if n > 1}
    figures["totals"] = {
        "acknowledged_puts": len(outcome["acknowledged"]),
        "puts_in_log": sum(puts.values()),
        "lost": len(outcome["lost"]),
        "duplicated": len(duplicated),
        "failed_rollouts_masked": f"{len(outcome['failed']) - len(outcome['unmasked'])}/{len(outcome['failed'])}",
    }
    print("cluster fault figures:", json.dumps(figures))
    assert outcome["lost"] == []
    assert duplicated == {}
    assert outcome["unmasked"] == []
