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
and a module imported by the pytest fixture (``tests/kafka_broker_fixture.py``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.24.3"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
HEAP_OPTS = ("-Xms128m", "-Xmx512m")
SECURE_HEAP_OPTS = ("-Xms64m", "-Xmx256m")
"""A secured broker runs next to the session's plain one: a smaller heap keeps both within CI's memory."""

ENV_STATE_DIR = "TOKCAP_KAFKA_STATE_DIR"
ENV_CACHE_DIR = "TOKCAP_KAFKA_CACHE_DIR"
ENV_JAVA = "TOKCAP_KAFKA_JAVA"

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0

PID_FILE = "broker.pid"
BOOTSTRAP_FILE = "bootstrap"
PROPERTIES_FILE = "server.properties"
LOG4J_FILE = "log4j2.properties"
DATA_DIR = "data"
LOGS_DIR = "logs"
SERVER_LOG = "server.log"
STDOUT_LOG = "stdout.log"
LOCK_FILE = ".lock"
OWNER_FILE = "owner.pid"
SECURITY_FILE = "security.json"
TLS_DIR = "tls"
SCRAM_MECHANISM = "SCRAM-SHA-512"
SECURE_USERS = ("admin", "writer", "trainer")
"""SCRAM users of a secured broker: ``admin`` is a super user; the others get only the ACLs a test grants."""


class BrokerError(RuntimeError):
    """Raised when the broker cannot be fetched, started or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerStatus:
    """What a state dir says about its broker, checked against the live process and port."""

    state_dir: Path
    pid: int | None
    running: bool
    answering: bool
    bootstrap: str | None

    def describe(self) -> str:
        """One line for humans, used by the ``status`` subcommand."""
        if self.running:
            health = "answering" if self.answering else "NOT answering"
            return f"running pid={self.pid} bootstrap={self.bootstrap} ({health}) state={self.state_dir}"
        return f"stopped state={self.state_dir}"


# ---------------------------------------------------------------------------- locations


def default_cache_dir() -> Path:
    """Jar cache shared by every checkout, so the ~45 MB download happens once per machine."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "tokcap" / f"kafka-{KAFKA_VERSION}"


def default_state_dir() -> Path:
    """Per-checkout state (pid, ports, data, logs) so two checkouts never share a broker by accident."""
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(env).expanduser().resolve()
    return REPO_ROOT / ".kafka-broker"


def libs_dir(cache_dir: Path | None = None) -> Path:
    """Where the runtime jars live inside the cache."""
    return (cache_dir or default_cache_dir()) / "libs"


def log_file(state_dir: Path | None = None) -> Path:
    """The broker's main log file, shown by ``logs`` and by the pytest failure hook."""
    return (state_dir or default_state_dir()) / LOGS_DIR / SERVER_LOG


def _java() -> str:
    """Pick the java binary: explicit override, then JAVA_HOME, then PATH."""
    override = os.environ.get(ENV_JAVA)
    if override:
        if not os.access(override, os.X_OK):
            raise BrokerError(f"{ENV_JAVA}={override} is not an executable java")
        return override
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise BrokerError("java not found: install a Java 17+ runtime (e.g. apt-get install openjdk-17-jre)")
    return found


# ---------------------------------------------------------------------------- fetch

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>tokcap.local</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>{log4j}</version>
    </dependency>
  </dependencies>
</project>
"""

_COMPLETE_MARKER = ".complete"


def fetch(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Copy the broker's runtime jars into the cache once; later calls return the cached dir at once.

    A marker file is written only after Maven succeeded, so an interrupted download is redone.
    """
    cache = cache_dir or default_cache_dir()
    libs = libs_dir(cache)
    if (libs / _COMPLETE_MARKER).is_file():
        return libs
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "mvn not found: install Maven 3.8+ (e.g. apt-get install maven) to fetch Kafka jars"
        )
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="libs.", dir=cache))
    try:
        with tempfile.TemporaryDirectory(prefix="kafka-pom.") as project:
            (Path(project) / "pom.xml").write_text(_POM.format(kafka=KAFKA_VERSION, log4j=LOG4J_VERSION))
            cmd = [
                mvn,
                "-B",
                "-q",
                f"{DEPENDENCY_PLUGIN}:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={staging}",
            ]
            if not quiet:
                print(f"fetching Kafka {KAFKA_VERSION} jars into {libs} ...", file=sys.stderr)
            proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise BrokerError(
                    f"maven failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
                )
        if not any(staging.glob(f"kafka_2.13-{KAFKA_VERSION}.jar")):
            raise BrokerError(f"maven finished but kafka_2.13-{KAFKA_VERSION}.jar is missing in {staging}")
        (staging / _COMPLETE_MARKER).write_text(f"kafka {KAFKA_VERSION} log4j {LOG4J_VERSION}\n")
        if libs.exists():
            shutil.rmtree(libs)
        staging.rename(libs)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return libs


def jar_bytes(libs: Path) -> int:
    """Total size of the cached jars, reported in docs/broker.md."""
    return sum(p.stat().st_size for p in libs.glob("*.jar"))


# ---------------------------------------------------------------------------- config


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    """True if nothing holds 127.0.0.1:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(exclude: frozenset[int] = frozenset()) -> int:
    """A free loopback port for the broker, chosen in Python so the config holds a fixed port.

    Ports are drawn below the kernel's ephemeral range when possible: a restart rebinds the same
    port, and a port inside the range could meanwhile be taken by the local end of some client's
    outgoing connection (e.g. a producer reconnecting to the stopped broker).
    """
    lo, _ = _ephemeral_range()
    if lo > 12000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(10000, lo)
            if port not in exclude and _bindable(port):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port


def new_cluster_id() -> str:
    """KRaft cluster id: 16 random bytes, base64url without padding; avoids a JVM launch for random-uuid."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).decode("ascii").rstrip("=")
        if not cid.startswith("-"):
            return cid


def _openssl(*args: str, cwd: Path) -> None:
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BrokerError(f"cannot run openssl (needed for --secure): {exc}") from exc
    if proc.returncode != 0:
        raise BrokerError(f"openssl {args[0]} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def make_certificates(directory: Path, keystore_password: str) -> None:
    """A throwaway CA and a broker certificate for 127.0.0.1/localhost signed by it, as a PKCS12 keystore.

    Everything lives two days: it only has to outlast one test session.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=tokcap throwaway test CA", cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
        "-subj", "/CN=localhost", cwd=directory,
    )  # fmt: skip
    (directory / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "broker.pem", "-days", "2", "-extfile", "broker.ext", cwd=directory,
    )  # fmt: skip
    _openssl(
        "pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-certfile", "ca.pem",
        "-name", "broker", "-out", "broker.p12", "-passout", f"pass:{keystore_password}", cwd=directory,
    )  # fmt: skip


def _new_security(state_dir: Path) -> dict[str, object]:
    """Fresh certificates and passwords for a secured broker, recorded in ``security.json``."""
    tls = state_dir / TLS_DIR
    shutil.rmtree(tls, ignore_errors=True)
    keystore_password = secrets.token_urlsafe(16)
    make_certificates(tls, keystore_password)
    security: dict[str, object] = {
        "mechanism": SCRAM_MECHANISM,
        "ca_location": str(tls / "ca.pem"),
        "keystore_location": str(tls / "broker.p12"),
        "keystore_password": keystore_password,
        "users": {name: secrets.token_urlsafe(16) for name in SECURE_USERS},
    }
    path = state_dir / SECURITY_FILE
    path.write_text(json.dumps(security, indent=2) + "\n")
    path.chmod(0o600)
    return security


def read_security(state_dir: Path) -> dict[str, object] | None:
    """The CA file and users of a secured broker's state dir, or None for a plain broker."""
    try:
        loaded = json.loads((state_dir / SECURITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


REAUTHENTICATE_MS = 4000
"""How long a secured broker's SASL session lasts before the client must log in again."""


def _secure_properties(props: dict[str, str], broker_port: int, security: dict[str, object]) -> None:
    """Turn the client listener into SASL_SSL with SCRAM, and deny everything not granted by an ACL."""
    users = security["users"]
    assert isinstance(users, dict)
    jaas = (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
        f'password="{users["admin"]}";'
    )
    props.update(
        {
            "listeners": f"SASL_SSL://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:"
            + props["controller.quorum.voters"].rsplit(":", 1)[1],
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{broker_port}",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(security["keystore_location"]),
            "ssl.keystore.password": str(security["keystore_password"]),
            "ssl.key.password": str(security["keystore_password"]),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(security["ca_location"]),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # The controller listener is plaintext on loopback; its principal is ANONYMOUS.
            "super.users": "User:admin;User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
            # Sessions re-authenticate every few seconds (KIP-368), so a rotated password or a removed user
            # reaches live connections mid-run, as on a production broker that sets this.
            "connections.max.reauth.ms": str(REAUTHENTICATE_MS),
        }
    )


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
        _secure_properties(props, broker_port, security)
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


def _ports_from_properties(path: Path) -> tuple[int, int]:
    """Recover (broker_port, controller_port) so a restart reuses the same addresses."""
    props = read_properties(path)
    broker = int(props["advertised.listeners"].rsplit(":", 1)[1])
    controller = int(props["controller.quorum.voters"].rsplit(":", 1)[1])
    return broker, controller


# ---------------------------------------------------------------------------- process helpers


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialize start/stop on one state dir across processes (e.g. two pytest sessions)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Brokers started by this process: reaping them through Popen avoids zombies that look alive.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _read_pid(state_dir: Path) -> int | None:
    """Pid from the pid file, or None if absent or garbled."""
    try:
        return int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _is_our_broker(pid: int, state_dir: Path) -> bool:
    """True if pid is alive and is the broker JVM of this state dir (guards against pid reuse).

    Right after launch the java launcher's /proc/PID/cmdline reads empty for a few milliseconds,
    so a child we started is judged by poll(), and an empty cmdline is read again.
    """
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    for _ in range(40):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            return False
        if cmdline:
            return "kafka.Kafka" in cmdline and str(state_dir / PROPERTIES_FILE) in cmdline
        time.sleep(0.05)
    return False


def _wait_gone(pid: int, state_dir: Path, timeout: float) -> bool:
    """Poll until the broker process has exited (reaping it if it is our child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_our_broker(pid, state_dir):
            return True
        time.sleep(0.1)
    return not _is_our_broker(pid, state_dir)


def _api_versions_ok(host: str, port: int, timeout: float = 2.0) -> bool:
    """Send a Kafka ApiVersions v0 request and check the broker answers without error.

    A TCP connect already implies readiness for a fixed port, but a real protocol round trip also
    catches a foreign process that happens to hold the port.
    """
    client_id = b"tokcap-probe"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exact(s, 4)
            (size,) = struct.unpack(">i", header)
            payload = _recv_exact(s, min(size, 65536))
    except OSError:
        return False
    if len(payload) < 6:
        return False
    correlation_id, error_code = struct.unpack(">ih", payload[:6])
    return bool(correlation_id == 7 and error_code == 0)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    """Read exactly n bytes or raise, since recv may return short reads."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf.extend(chunk)
    return bytes(buf)


def answers(bootstrap: str, timeout: float = 2.0) -> bool:
    """True if a Kafka broker at host:port answers an ApiVersions request."""
    host, _, port = bootstrap.rpartition(":")
    try:
        return _api_versions_ok(host or "127.0.0.1", int(port), timeout)
    except ValueError:
        return False


def _port_open(port: int) -> bool:
    """A successful TCP connect to the fixed broker port means the broker is unfenced and serving."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- lifecycle


def status(state_dir: Path | None = None) -> BrokerStatus:
    """Inspect the state dir and the live process; never changes anything."""
    sd = state_dir or default_state_dir()
    pid = _read_pid(sd)
    running = pid is not None and _is_our_broker(pid, sd)
    bootstrap: str | None = None
    with contextlib.suppress(OSError):
        bootstrap = (sd / BOOTSTRAP_FILE).read_text().strip() or None
    # A secured listener does not answer a plaintext ApiVersions request; an open port must do.
    if read_security(sd) is not None:
        ok = running and bootstrap is not None and _port_open(int(bootstrap.rsplit(":", 1)[1]))
    else:
        ok = running and bootstrap is not None and answers(bootstrap)
    return BrokerStatus(sd, pid if running else None, running, ok, bootstrap if running else None)


def _storage_format(java: str, libs: Path, state_dir: Path, cluster_id: str | None = None) -> None:
    """Format the KRaft data dir once; a formatted dir is kept across restarts.

    A secured broker's SCRAM users are written into the metadata here, so the broker can log in to itself.
    """
    security = read_security(state_dir)
    scram: list[str] = []
    if security is not None:
        users = security["users"]
        assert isinstance(users, dict)
        for name, password in users.items():
            scram += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
    cmd = [
        java,
        "-Xmx256m",
        f"-Dlog4j2.configurationFile={state_dir / LOG4J_FILE}",
        "-cp",
        f"{libs}/*",
        "kafka.tools.StorageTool",
        "format",
        "--ignore-formatted",
        "-t",
        cluster_id or new_cluster_id(),
        "-c",
        str(state_dir / PROPERTIES_FILE),
        *scram,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BrokerError(f"cannot run {java}: {exc}") from exc
    if proc.returncode != 0:
        raise BrokerError(
            f"kafka StorageTool format failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )


def start(
    state_dir: Path | None = None,
    *,
    reuse: bool = False,
    cache_dir: Path | None = None,
    timeout: float = START_TIMEOUT_S,
    owner_pid: int | None = None,
    secure: bool = False,
) -> str:
    """Start the broker and return its bootstrap ``127.0.0.1:PORT`` once it accepts connections.

    ``secure=True`` (for a fresh start) makes it the secured broker of the module docstring; a restart
    keeps whatever the state dir was.

    If a broker of this state dir is already running, its bootstrap is returned unchanged.
    ``reuse=True`` keeps the ports and data of the previous run (a restart); otherwise the data
    dir is wiped and new free ports are chosen. ``owner_pid`` marks a private state dir whose
    broker :func:`prune_orphans` may stop once that process is gone (e.g. a killed test run).
    """
    sd = (state_dir or default_state_dir()).resolve()
    with _locked(sd):
        current = status(sd)
        if current.running and current.bootstrap:
            if not _wait_port(current.bootstrap, current.pid, sd, timeout):
                raise BrokerError(f"broker pid {current.pid} runs but does not answer at {current.bootstrap}")
            return current.bootstrap
        libs = fetch(cache_dir, quiet=True)
        java = _java()
        props_path = sd / PROPERTIES_FILE
        if reuse and props_path.is_file() and (sd / DATA_DIR / "meta.properties").is_file():
            broker_port, controller_port = _ports_from_properties(props_path)
        else:
            for name in (DATA_DIR, LOGS_DIR):
                shutil.rmtree(sd / name, ignore_errors=True)
            (sd / SECURITY_FILE).unlink(missing_ok=True)
            security = _new_security(sd) if secure else None
            broker_port = free_port()
            controller_port = free_port(frozenset({broker_port}))
            props_path.write_text(server_properties(sd, broker_port, controller_port, security))
        (sd / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        (sd / LOG4J_FILE).write_text(log4j2_properties(sd))
        (sd / BOOTSTRAP_FILE).unlink(missing_ok=True)
        if not (sd / DATA_DIR / "meta.properties").is_file():
            _storage_format(java, libs, sd)
        bootstrap = f"127.0.0.1:{broker_port}"
        cmd = [
            java,
            *(SECURE_HEAP_OPTS if read_security(sd) is not None else HEAP_OPTS),
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={sd / LOG4J_FILE}",
            f"-Dkafka.logs.dir={sd / LOGS_DIR}",
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(props_path),
        ]
        with open(sd / LOGS_DIR / STDOUT_LOG, "ab") as out:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=sd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BrokerError(f"cannot run {java}: {exc}") from exc
        _CHILDREN[proc.pid] = proc
        (sd / PID_FILE).write_text(f"{proc.pid}\n")
        if owner_pid is not None:
            (sd / OWNER_FILE).write_text(f"{owner_pid}\n")
        t0 = time.monotonic()
        if not _wait_port(bootstrap, proc.pid, sd, timeout):
            waited = time.monotonic() - t0
            exit_code = proc.poll()
            _terminate(proc.pid, sd, STOP_TIMEOUT_S)
            how = f"exited with {exit_code}" if exit_code is not None else "still running, not answering"
            raise BrokerError(
                f"broker did not become ready at {bootstrap} after {waited:.1f}s ({how})\n{tail_log(sd, 40)}"
            )
        (sd / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
        return bootstrap


def _wait_port(bootstrap: str, pid: int | None, state_dir: Path, timeout: float) -> bool:
    """Wait for the listening socket, then confirm with a protocol round trip; fail fast if the JVM died."""
    port = int(bootstrap.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not _is_our_broker(pid, state_dir):
            return False
        if _port_open(port) and (read_security(state_dir) is not None or answers(bootstrap)):
            return True
        time.sleep(0.1)
    return False


def _terminate(pid: int, state_dir: Path, timeout: float) -> None:
    """SIGTERM (runs Kafka's clean shutdown hook), then SIGKILL if it hangs."""
    if not _is_our_broker(pid, state_dir):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, state_dir, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, state_dir, 10.0)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def stop(state_dir: Path | None = None, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop the broker of this state dir; returns True if one was running. Data and ports are kept."""
    sd = (state_dir or default_state_dir()).resolve()
    with _locked(sd):
        pid = _read_pid(sd)
        was_running = pid is not None and _is_our_broker(pid, sd)
        if pid is not None:
            _terminate(pid, sd, timeout)
        (sd / PID_FILE).unlink(missing_ok=True)
        (sd / BOOTSTRAP_FILE).unlink(missing_ok=True)
        return was_running


def _pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def prune_orphans(root: Path | None = None) -> list[Path]:
    """Stop and delete private broker dirs under root whose owner process has died.

    Test runs give each session its own broker in ``<root>/<name>/`` with an owner pid, so
    parallel runs never stop or restart each other's broker; this reclaims the ones a killed
    run left behind.
    """
    base = root or default_state_dir()
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    for child in sorted(base.iterdir()):
        owner_file = child / OWNER_FILE
        if not child.is_dir() or not owner_file.is_file():
            continue
        try:
            owner = int(owner_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if _pid_alive(owner):
            continue
        stop(child)
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def restart(state_dir: Path | None = None, timeout: float = START_TIMEOUT_S) -> str:
    """Stop and start again on the same ports and data dir (used to test surviving a broker restart)."""
    sd = state_dir or default_state_dir()
    stop(sd)
    return start(sd, reuse=True, timeout=timeout)


def tail_log(state_dir: Path | None = None, lines: int = 50) -> str:
    """Last lines of the broker log (and the JVM's stdout if the log is empty, e.g. early crashes)."""
    sd = state_dir or default_state_dir()
    chunks: list[str] = []
    for path in (sd / LOGS_DIR / SERVER_LOG, sd / LOGS_DIR / STDOUT_LOG):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if text.strip():
            chunks.append(f"==> {path} <==\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(chunks) if chunks else f"(no broker logs in {sd / LOGS_DIR})"


# ---------------------------------------------------------------------------- cluster

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
    _CHILDREN[proc.pid] = proc
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
    with _locked(sd):
        libs = fetch(cache_dir, quiet=True)
        java = _java()
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
            _storage_format(java, libs, nd, cluster_id)
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
        pid = _read_pid(nd)
        if pid is None or not _is_our_broker(pid, nd):
            _launch(nd, _java(), libs_dir(), CLUSTER_HEAP_OPTS)
    pid = _read_pid(nd)
    address = f"127.0.0.1:{_ports_from_properties(nd / PROPERTIES_FILE)[0]}"
    if not _wait_port(address, pid, nd, timeout):
        raise BrokerError(f"cluster node {node} did not become ready at {address}\n{tail_log(nd, 40)}")
    return address


def cluster_kill_node(state_dir: Path, node: int) -> None:
    """SIGKILL one node, as a crash would: no clean shutdown, no leadership handed over."""
    nd = node_dir(state_dir.resolve(), node)
    pid = _read_pid(nd)
    if pid is None or not _is_our_broker(pid, nd):
        return
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, nd, STOP_TIMEOUT_S)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def cluster_stop(state_dir: Path) -> None:
    """Stop every node of the cluster (SIGTERM, SIGKILL after a short wait: the data is thrown away)."""
    sd = state_dir.resolve()
    for node in range(1, CLUSTER_NODES + 1):
        nd = node_dir(sd, node)
        pid = _read_pid(nd)
        if pid is not None:
            _terminate(pid, nd, 10.0)
        (nd / PID_FILE).unlink(missing_ok=True)


def node_port(state_dir: Path, node: int) -> int:
    """The client port of one node."""
    return _ports_from_properties(node_dir(state_dir.resolve(), node) / PROPERTIES_FILE)[0]


# ---------------------------------------------------------------------------- CLI


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
