"""A broker's settings files: ``server.properties`` and the Log4j 2 config, written and read back.

The format is the simple ``key=value`` one this tool writes (no escapes or continuations), so reading it
back needs no Java properties parser.
"""

from __future__ import annotations

from pathlib import Path

from .layout import DATA_DIR, LOGS_DIR, SERVER_LOG
from .security import secure_properties


def server_properties(
    state_dir: Path, broker_port: int, controller_port: int, security: dict[str, object] | None = None
) -> str:
    """Single-node combined broker+controller settings; internal topics sized for one node."""
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{broker_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(state_dir / DATA_DIR),
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "3",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "3",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "share.coordinator.state.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
    }
    if security is not None:
        secure_properties(props, broker_port, security)
    lines = ["# Written by scripts/kafka-broker; regenerated on a fresh start, kept on --reuse."]
    lines += [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


def log4j2_properties(state_dir: Path) -> str:
    """Log4j 2 config: the published jars ship none, and without it the broker logs nothing at all."""
    log_path = state_dir / LOGS_DIR / SERVER_LOG
    return "\n".join(
        [
            "status = warn",
            "name = tokcap-kafka-broker",
            "# Kafka's own shutdown hook logs the clean shutdown; Log4j's hook would close the file first.",
            "shutdownHook = disable",
            "appender.file.type = File",
            "appender.file.name = FILE",
            f"appender.file.fileName = {log_path}",
            "appender.file.append = true",
            "appender.file.layout.type = PatternLayout",
            "appender.file.layout.pattern = [%d] %p %m (%c)%n",
            "rootLogger.level = INFO",
            "rootLogger.appenderRef.file.ref = FILE",
            "logger.request.name = kafka.request.logger",
            "logger.request.level = WARN",
            "logger.statechange.name = state.change.logger",
            "logger.statechange.level = WARN",
            "logger.authorizer.name = kafka.authorizer.logger",
            "logger.authorizer.level = WARN",
            "",
        ]
    )


def read_properties(path: Path) -> dict[str, str]:
    """Parse a server.properties file written by this module."""
    return read_properties_text(path.read_text())


def read_properties_text(text: str) -> dict[str, str]:
    """Parse the simple key=value format this module writes (no escapes or continuations needed)."""
    result: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        result[key.strip()] = value.strip()
    return result


def ports_from_properties(path: Path) -> tuple[int, int]:
    """Recover (broker_port, controller_port) so a restart reuses the same addresses."""
    props = read_properties(path)
    broker = int(props["advertised.listeners"].rsplit(":", 1)[1])
    controller = int(props["controller.quorum.voters"].rsplit(":", 1)[1])
    return broker, controller
