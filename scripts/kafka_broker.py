"""Local single-node Apache Kafka broker (KRaft, broker+controller) built from Maven Central jars.

``start --secure`` makes it a secured broker instead: one SASL_SSL listener (SCRAM-SHA-512) with a
throwaway CA and broker certificate made with openssl, the StandardAuthorizer (ACLs, nothing allowed
unless granted) and three SCRAM users written into the storage at format time. ``security.json`` in the
state dir then names the CA file and the users' passwords for tests and local runs.

``cluster start`` starts three combined broker+controller nodes on 127.0.0.1 instead (replication
factor 3, ``min.insync.replicas=2``, a 256 MiB heap each), in ``node-1`` … ``node-3`` under the state dir;
each node can be killed and started again on its own ports and data, to test leader loss.

Tests and local runs need a real broker on machines without Docker. This module fetches the
broker jars once into a cache, formats a KRaft data dir, starts the JVM on 127.0.0.1 with free
ports and can stop and restart it on the same ports and data dir. It uses the standard library
only, so it runs before the project's virtualenv exists. It is both a CLI (``scripts/kafka-broker``)
and a module imported by the pytest fixture (``tests/kafka_broker_fixture.py``); its parts live in the
``local_kafka`` package beside it, one concept a module, and every public name is importable from here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The parts are a package beside this script. Run by path, or imported by path as the pytest fixture does, the
# script has no package of its own to import them relative to, so its directory is put on the path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_kafka.cluster import (
    CLUSTER_FILE,
    CLUSTER_HEAP_OPTS,
    CLUSTER_NODES,
    cluster_kill_node,
    cluster_properties,
    cluster_start,
    cluster_start_node,
    cluster_stop,
    node_dir,
    node_port,
)
from local_kafka.errors import BrokerError
from local_kafka.jars import DEPENDENCY_PLUGIN, LOG4J_VERSION, fetch, jar_bytes
from local_kafka.layout import (
    BOOTSTRAP_FILE,
    DATA_DIR,
    ENV_CACHE_DIR,
    ENV_JAVA,
    ENV_STATE_DIR,
    KAFKA_VERSION,
    LOCK_FILE,
    LOG4J_FILE,
    LOGS_DIR,
    OWNER_FILE,
    PID_FILE,
    PROPERTIES_FILE,
    REPO_ROOT,
    SERVER_LOG,
    START_TIMEOUT_S,
    STDOUT_LOG,
    STOP_TIMEOUT_S,
    default_cache_dir,
    default_state_dir,
    libs_dir,
    log_file,
)
from local_kafka.ports import free_port
from local_kafka.probe import answers
from local_kafka.properties import log4j2_properties, read_properties, read_properties_text, server_properties
from local_kafka.security import (
    REAUTHENTICATE_MS,
    SCRAM_MECHANISM,
    SECURE_USERS,
    SECURITY_FILE,
    TLS_DIR,
    make_certificates,
    read_security,
)
from local_kafka.single_node import (
    HEAP_OPTS,
    SECURE_HEAP_OPTS,
    BrokerStatus,
    prune_orphans,
    restart,
    start,
    status,
    stop,
    tail_log,
)
from local_kafka.storage import new_cluster_id

__all__ = [
    "BOOTSTRAP_FILE",
    "CLUSTER_FILE",
    "CLUSTER_HEAP_OPTS",
    "CLUSTER_NODES",
    "DATA_DIR",
    "DEPENDENCY_PLUGIN",
    "ENV_CACHE_DIR",
    "ENV_JAVA",
    "ENV_STATE_DIR",
    "HEAP_OPTS",
    "KAFKA_VERSION",
    "LOCK_FILE",
    "LOG4J_FILE",
    "LOG4J_VERSION",
    "LOGS_DIR",
    "OWNER_FILE",
    "PID_FILE",
    "PROPERTIES_FILE",
    "REAUTHENTICATE_MS",
    "REPO_ROOT",
    "SCRAM_MECHANISM",
    "SECURE_HEAP_OPTS",
    "SECURE_USERS",
    "SECURITY_FILE",
    "SERVER_LOG",
    "START_TIMEOUT_S",
    "STDOUT_LOG",
    "STOP_TIMEOUT_S",
    "TLS_DIR",
    "BrokerError",
    "BrokerStatus",
    "answers",
    "cluster_kill_node",
    "cluster_properties",
    "cluster_start",
    "cluster_start_node",
    "cluster_stop",
    "default_cache_dir",
    "default_state_dir",
    "fetch",
    "free_port",
    "jar_bytes",
    "libs_dir",
    "log4j2_properties",
    "log_file",
    "main",
    "make_certificates",
    "new_cluster_id",
    "node_dir",
    "node_port",
    "prune_orphans",
    "read_properties",
    "read_properties_text",
    "read_security",
    "restart",
    "server_properties",
    "start",
    "status",
    "stop",
    "tail_log",
]


def _cmd_fetch(args: argparse.Namespace) -> int:
    """CLI: fetch jars and print the libs dir."""
    libs = fetch(args.cache_dir)
    print(libs)
    print(f"{jar_bytes(libs) / 1e6:.1f} MB in {len(list(libs.glob('*.jar')))} jars", file=sys.stderr)
    return 0


def _cmd_start(args: argparse.Namespace) -> int:
    """CLI: start (or reuse a running) broker and print its bootstrap."""
    t0 = time.monotonic()
    bootstrap = start(
        args.state_dir,
        reuse=args.reuse,
        cache_dir=args.cache_dir,
        timeout=args.timeout,
        owner_pid=args.owner_pid,
        secure=args.secure,
    )
    print(bootstrap)
    print(f"kafka broker ready at {bootstrap} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    """CLI: stop the broker; succeeds also when none was running."""
    was = stop(args.state_dir)
    print("stopped" if was else "not running", file=sys.stderr)
    return 0


def _cmd_restart(args: argparse.Namespace) -> int:
    """CLI: restart on the same ports and data dir."""
    print(restart(args.state_dir, timeout=args.timeout))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    """CLI: print status; exit 0 only if the broker runs and answers."""
    st = status(args.state_dir)
    print(st.describe())
    return 0 if st.answering else 1


def _cmd_prune(args: argparse.Namespace) -> int:
    """CLI: stop and remove private broker dirs of dead test runs."""
    for path in prune_orphans(args.state_dir):
        print(f"removed orphaned broker dir {path}", file=sys.stderr)
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    """CLI: start or stop the three-node cluster in the state dir."""
    sd = args.state_dir or default_state_dir()
    if args.action == "start":
        print(cluster_start(sd, cache_dir=args.cache_dir, owner_pid=args.owner_pid))
    else:
        cluster_stop(sd)
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    """CLI: print the tail of the broker log."""
    print(tail_log(args.state_dir, args.lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/kafka-broker``."""
    parser = argparse.ArgumentParser(
        prog="kafka-broker", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--state-dir",
        type=lambda s: Path(s).expanduser().resolve(),
        default=None,
        help=f"pid/ports/data/logs dir (env {ENV_STATE_DIR}; default .kafka-broker/ in the repo)",
    )
    parser.add_argument(
        "--cache-dir",
        type=lambda s: Path(s).expanduser().resolve(),
        default=None,
        help=f"jar cache (env {ENV_CACHE_DIR}; default ~/.cache/tokcap/kafka-{KAFKA_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download broker jars into the cache (once)").set_defaults(func=_cmd_fetch)
    p_start = sub.add_parser("start", help="start the broker and print its bootstrap address")
    p_start.add_argument("--reuse", action="store_true", help="keep ports and data of the previous run")
    p_start.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    p_start.add_argument(
        "--owner-pid", type=int, default=None, help="process owning this broker; `prune` stops it once gone"
    )
    p_start.add_argument(
        "--secure",
        action="store_true",
        help="SASL_SSL listener (SCRAM-SHA-512, throwaway CA), ACL authorizer; credentials in security.json",
    )
    p_start.set_defaults(func=_cmd_start)
    sub.add_parser("stop", help="stop the broker (SIGTERM, SIGKILL fallback)").set_defaults(func=_cmd_stop)
    p_restart = sub.add_parser("restart", help="stop, then start on the same ports and data dir")
    p_restart.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    p_restart.set_defaults(func=_cmd_restart)
    sub.add_parser("status", help="exit 0 if running and answering").set_defaults(func=_cmd_status)
    sub.add_parser(
        "prune", help="stop and delete sub-dirs of the state dir whose --owner-pid process is gone"
    ).set_defaults(func=_cmd_prune)
    p_cluster = sub.add_parser("cluster", help="start or stop a three-node KRaft cluster (RF 3, min ISR 2)")
    p_cluster.add_argument("action", choices=["start", "stop"])
    p_cluster.add_argument("--owner-pid", type=int, default=None)
    p_cluster.set_defaults(func=_cmd_cluster)
    p_logs = sub.add_parser("logs", help="print the tail of the broker log")
    p_logs.add_argument("-n", "--lines", type=int, default=50)
    p_logs.set_defaults(func=_cmd_logs)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokerError as exc:
        print(f"kafka-broker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
