"""A three-node KRaft cluster on 127.0.0.1, each node killed and started again on its own, to test leader loss.

``cluster start`` starts three combined broker+controller nodes (replication factor 3,
``min.insync.replicas=2``, a 256 MiB heap each), in ``node-1`` … ``node-3`` under the state dir; each node
can be killed and started again on its own ports and data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from .errors import BrokerError
from .jars import fetch
from .layout import (
    LOG4J_FILE,
    LOGS_DIR,
    OWNER_FILE,
    PID_FILE,
    PROPERTIES_FILE,
    START_TIMEOUT_S,
    STDOUT_LOG,
    STOP_TIMEOUT_S,
    libs_dir,
)
from .ports import free_port
from .probe import wait_port
from .processes import CHILDREN, is_our_broker, java_binary, locked, read_pid, terminate, wait_gone
from .properties import log4j2_properties, ports_from_properties, read_properties_text, server_properties
from .single_node import tail_log
from .storage import new_cluster_id, storage_format

CLUSTER_NODES = 3
CLUSTER_HEAP_OPTS = ("-Xms64m", "-Xmx256m")
CLUSTER_FILE = "cluster.json"


def cluster_properties(node_dir: Path, node: int, ports: dict[int, tuple[int, int]]) -> str:
    """One node of a three-node KRaft cluster: every node is a voter; internal topics replicated 3 / ISR 2."""
    voters = ",".join(f"{n}@127.0.0.1:{controller}" for n, (_, controller) in sorted(ports.items()))
    broker_port, controller_port = ports[node]
    text = server_properties(node_dir, broker_port, controller_port)
    props = read_properties_text(text)
    props.update(
        {
            "node.id": str(node),
            "controller.quorum.voters": voters,
            "default.replication.factor": "3",
            "min.insync.replicas": "2",
            "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3",
            "transaction.state.log.min.isr": "2",
            "share.coordinator.state.topic.replication.factor": "3",
            "share.coordinator.state.topic.min.isr": "2",
            "unclean.leader.election.enable": "false",
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
            # Fail over fast: a killed node's partitions move once its session with the controller lapses.
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "500",
            "replica.lag.time.max.ms": "5000",
        }
    )
    lines = ["# Written by scripts/kafka-broker cluster start."] + [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


def node_dir(state_dir: Path, node: int) -> Path:
    """The state dir of one cluster node."""
    return state_dir / f"node-{node}"


def _launch(node_sd: Path, java: str, libs: Path, heap: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """Start one broker JVM in the background and record its pid; the caller waits for readiness."""
    cmd = [
        java,
        *heap,
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:TieredStopAtLevel=1",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={node_sd / LOG4J_FILE}",
        f"-Dkafka.logs.dir={node_sd / LOGS_DIR}",
        "-cp",
        f"{libs}/*",
        "kafka.Kafka",
        str(node_sd / PROPERTIES_FILE),
    ]
    (node_sd / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    with open(node_sd / LOGS_DIR / STDOUT_LOG, "ab") as out:
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=node_sd,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise BrokerError(f"cannot run {java}: {exc}") from exc
    CHILDREN[proc.pid] = proc
    (node_sd / PID_FILE).write_text(f"{proc.pid}\n")
    return proc


def _cluster_bootstrap(state_dir: Path) -> str:
    ports = json.loads((state_dir / CLUSTER_FILE).read_text())["ports"]
    return ",".join(f"127.0.0.1:{broker}" for broker, _ in ports.values())


def cluster_start(
    state_dir: Path,
    *,
    cache_dir: Path | None = None,
    timeout: float = START_TIMEOUT_S,
    owner_pid: int | None = None,
) -> str:
    """Start a fresh three-node cluster and return its bootstrap list once every node answers."""
    sd = state_dir.resolve()
    with locked(sd):
        libs = fetch(cache_dir, quiet=True)
        java = java_binary()
        taken: set[int] = set()
        ports: dict[int, tuple[int, int]] = {}
        for node in range(1, CLUSTER_NODES + 1):
            broker = free_port(frozenset(taken))
            taken.add(broker)
            controller = free_port(frozenset(taken))
            taken.add(controller)
            ports[node] = (broker, controller)
        cluster_id = new_cluster_id()
        (sd / CLUSTER_FILE).write_text(json.dumps({"cluster_id": cluster_id, "ports": ports}) + "\n")
        if owner_pid is not None:
            (sd / OWNER_FILE).write_text(f"{owner_pid}\n")
        for node in ports:
            nd = node_dir(sd, node)
            shutil.rmtree(nd, ignore_errors=True)
            (nd / LOGS_DIR).mkdir(parents=True)
            (nd / PROPERTIES_FILE).write_text(cluster_properties(nd, node, ports))
            (nd / LOG4J_FILE).write_text(log4j2_properties(nd))
            storage_format(java, libs, nd, cluster_id)
        for node in ports:
            _launch(node_dir(sd, node), java, libs, CLUSTER_HEAP_OPTS)
    for node in ports:
        cluster_start_node(sd, node, timeout=timeout, launch=False)
    return _cluster_bootstrap(sd)


def cluster_start_node(
    state_dir: Path, node: int, *, timeout: float = START_TIMEOUT_S, launch: bool = True
) -> str:
    """Start one stopped node again on its ports and data; return its address once it answers."""
    sd = state_dir.resolve()
    nd = node_dir(sd, node)
    if launch:
        pid = read_pid(nd)
        if pid is None or not is_our_broker(pid, nd):
            _launch(nd, java_binary(), libs_dir(), CLUSTER_HEAP_OPTS)
    pid = read_pid(nd)
    address = f"127.0.0.1:{ports_from_properties(nd / PROPERTIES_FILE)[0]}"
    if not wait_port(address, pid, nd, timeout):
        raise BrokerError(f"cluster node {node} did not become ready at {address}\n{tail_log(nd, 40)}")
    return address


def cluster_kill_node(state_dir: Path, node: int) -> None:
    """SIGKILL one node, as a crash would: no clean shutdown, no leadership handed over."""
    nd = node_dir(state_dir.resolve(), node)
    pid = read_pid(nd)
    if pid is None or not is_our_broker(pid, nd):
        return
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, nd, STOP_TIMEOUT_S)
    child = CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def cluster_stop(state_dir: Path) -> None:
    """Stop every node of the cluster (SIGTERM, SIGKILL after a short wait: the data is thrown away)."""
    sd = state_dir.resolve()
    for node in range(1, CLUSTER_NODES + 1):
        nd = node_dir(sd, node)
        pid = read_pid(nd)
        if pid is not None:
            terminate(pid, nd, 10.0)
        (nd / PID_FILE).unlink(missing_ok=True)


def node_port(state_dir: Path, node: int) -> int:
    """The client port of one node."""
    return ports_from_properties(node_dir(state_dir.resolve(), node) / PROPERTIES_FILE)[0]
