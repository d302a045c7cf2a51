"""Pytest fixtures that give tests a real Kafka broker, unique topics and broker restarts.

Where the broker comes from, in order:

1. ``TOKCAP_KAFKA_BOOTSTRAP`` (e.g. the docker-compose broker, or the one ``scripts/test`` started);
2. testcontainers' Kafka container, when a Docker engine answers;
3. the local JVM broker of ``scripts/kafka-broker``: one left running in the state dir by
   ``scripts/kafka-broker start`` is reused (and left running); otherwise this session starts its
   own in a private sub-dir ``pytest-<pid>`` and stops and deletes it at session end.

If none is available the tests skip with a reason that says how to get one, except with
``TOKCAP_REQUIRE_BROKER=1`` (CI), where they fail.

Fixtures: ``kafka_bootstrap`` (session, str), ``kafka_broker`` (session, :class:`KafkaBroker`),
``kafka_broker_control`` (session, :class:`KafkaBrokerControl`, skips unless the broker is the
local restartable one), ``kafka_topic`` (function, str) and ``kafka_topic_factory`` (function,
:class:`TopicFactory`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

ENV_BOOTSTRAP = "TOKCAP_KAFKA_BOOTSTRAP"
ENV_REQUIRE = "TOKCAP_REQUIRE_BROKER"
ENV_TESTCONTAINERS = "TOKCAP_KAFKA_TESTCONTAINERS"
ENV_TC_IMAGE = "TOKCAP_KAFKA_TC_IMAGE"
DEFAULT_TC_IMAGE = "confluentinc/cp-kafka:7.6.0"

REPO_ROOT = Path(__file__).resolve().parent.parent
BROKER_SCRIPT = REPO_ROOT / "scripts" / "kafka_broker.py"

BROKER_FIXTURES = frozenset(
    {
        "kafka_bootstrap",
        "kafka_broker",
        "kafka_broker_control",
        "kafka_topic",
        "kafka_topic_factory",
        "staging_topic",
    }
)
HOW_TO_GET_A_BROKER = (
    "no Kafka broker available. Get one with any of: `scripts/test` (starts a local broker; needs "
    "Java 17+ and Maven); `scripts/kafka-broker start` then export TOKCAP_KAFKA_BOOTSTRAP=<printed address>; "
    "`docker compose up -d kafka` then TOKCAP_KAFKA_BOOTSTRAP=localhost:9092; or a running Docker engine "
    "(testcontainers)."
)

_SESSION_BROKER: KafkaBroker | None = None


def load_broker_module() -> ModuleType:
    """Import scripts/kafka_broker.py by path: it is a stdlib-only script, not part of the package."""
    name = "tokcap_scripts_kafka_broker"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BROKER_SCRIPT)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {BROKER_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def start_again(state_dir: Path) -> str:
    """Start the stopped broker of ``state_dir`` on its ports and data, from a process that exits once it answers.

    Started from the test session itself, the broker would be the session's child, left running when the
    session ends (scripts/test and a developer's broker must outlive it), and Python reports such a child as
    leaked at exit. Started the way ``scripts/test`` starts it, it is no one's child in the session.
    """
    started = subprocess.run(
        [sys.executable, str(BROKER_SCRIPT), "--state-dir", str(state_dir), "start", "--reuse"],
        capture_output=True,
        text=True,
        check=False,
    )
    if started.returncode != 0 or not started.stdout.strip():
        raise RuntimeError(
            f"the broker in {state_dir} did not start again (exit {started.returncode}): "
            f"{started.stderr.strip()[-2000:]}"
        )
    return started.stdout.strip().splitlines()[-1]


@dataclass
class KafkaBroker:
    """The broker this test session uses and where it came from."""

    kind: str  # "external" | "testcontainers" | "local"
    bootstrap: str
    state_dir: Path | None = None
    started_here: bool = False
    container: Any = None
    stopped_by_test: bool = field(default=False)

    @property
    def restartable(self) -> bool:
        """Only the local JVM broker can be stopped and restarted on the same port and data."""
        return self.kind == "local" and self.state_dir is not None

    def log_tail(self, lines: int = 60) -> str:
        """Broker log tail for failure reports; external brokers have no log we can read."""
        if self.kind == "local" and self.state_dir is not None:
            return str(load_broker_module().tail_log(self.state_dir, lines))
        if self.kind == "testcontainers" and self.container is not None:
            try:
                out, err = self.container.get_logs()
            except Exception as exc:  # the log is a debugging aid; never mask the real failure
                return f"(could not read container logs: {exc!r})"
            text = (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return f"(external broker {self.bootstrap}: its log is not available here)"

    def ensure_running(self) -> None:
        """Bring a local broker back if a test stopped it and did not restart it."""
        if self.restartable and self.stopped_by_test and self.state_dir is not None:
            start_again(self.state_dir)
            self.stopped_by_test = False


class KafkaBrokerControl:
    """Stop and restart the session's broker mid-test (same port, same data dir).

    Obtained through the ``kafka_broker_control`` fixture, which skips the test unless the broker
    is the local JVM broker. After a test the broker is restarted automatically if the test left
    it stopped.
    """

    def __init__(self, broker: KafkaBroker) -> None:
        """Wrap the session broker; no side effects."""
        self._broker = broker

    @property
    def restartable(self) -> bool:
        """True when stop()/start() are supported (local JVM broker)."""
        return self._broker.restartable

    @property
    def bootstrap(self) -> str:
        """The bootstrap address; unchanged across restarts."""
        return self._broker.bootstrap

    def _require(self) -> Any:
        """The broker module, or a clear error when the broker cannot be restarted."""
        if not self.restartable:
            raise RuntimeError(f"broker {self._broker.bootstrap} ({self._broker.kind}) cannot be restarted")
        return load_broker_module()

    def stop(self) -> None:
        """Stop the broker cleanly (SIGTERM, SIGKILL fallback); clients will see it disappear."""
        module = self._require()
        self._broker.stopped_by_test = True
        module.stop(self._broker.state_dir)

    def start(self) -> str:
        """Start the stopped broker again on the same port and data dir; returns once it answers."""
        self._require()
        assert self._broker.state_dir is not None
        bootstrap = start_again(self._broker.state_dir)
        self._broker.stopped_by_test = False
        if bootstrap != self._broker.bootstrap:
            raise RuntimeError(f"broker came back at {bootstrap}, expected {self._broker.bootstrap}")
        return bootstrap

    def restart(self) -> str:
        """stop() then start()."""
        self.stop()
        return self.start()

    def is_running(self) -> bool:
        """True if the broker process is up and answers."""
        if not self.restartable:
            return bool(load_broker_module().answers(self._broker.bootstrap))
        return bool(load_broker_module().status(self._broker.state_dir).answering)


def _required() -> bool:
    """CI sets TOKCAP_REQUIRE_BROKER=1: a missing broker must fail, never skip."""
    return os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason: str) -> NoReturn:
    """Skip, or fail when a broker is required."""
    if _required():
        pytest.fail(f"{ENV_REQUIRE}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _wait_answers(bootstrap: str, timeout: float) -> bool:
    """Give a just-started external broker (e.g. docker compose) some time to come up."""
    module = load_broker_module()
    deadline = time.monotonic() + timeout
    while True:
        if module.answers(bootstrap):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _docker_answers() -> bool:
    """Quick check for a Docker engine; any error (no socket, no package, timeout) means no."""
    if os.environ.get(ENV_TESTCONTAINERS, "1").strip().lower() in ("0", "false", "no"):
        return False
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    with warnings.catch_warnings():
        # A failed connect leaks the client's socket; collect it here, where its ResourceWarning
        # is ignored, instead of in some later test where filterwarnings=error would fail it.
        warnings.simplefilter("ignore")
        try:
            docker: Any = importlib.import_module("docker")
            client = docker.from_env(timeout=3)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


def _start_testcontainer() -> KafkaBroker:
    """Start testcontainers' Kafka (KRaft); imports lazily because its imports may warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:
            from testcontainers.kafka import KafkaContainer
        container = KafkaContainer(os.environ.get(ENV_TC_IMAGE, DEFAULT_TC_IMAGE)).with_kraft()
        container.start()
        bootstrap = str(container.get_bootstrap_server())
    return KafkaBroker(kind="testcontainers", bootstrap=bootstrap, started_here=True, container=container)


def _resolve_broker() -> tuple[KafkaBroker | None, str]:
    """Find or start a broker following the documented order; returns (broker, reason if none)."""
    module = load_broker_module()
    state_dir = Path(module.default_state_dir())
    env_bootstrap = os.environ.get(ENV_BOOTSTRAP, "").strip()
    if env_bootstrap:
        local = module.status(state_dir)
        if local.running and local.bootstrap == env_bootstrap:
            # scripts/test started the local broker and exported its address: keep it restartable.
            return KafkaBroker(kind="local", bootstrap=env_bootstrap, state_dir=state_dir), ""
        if _wait_answers(env_bootstrap, 30.0):
            return KafkaBroker(kind="external", bootstrap=env_bootstrap), ""
        return None, (
            f"{ENV_BOOTSTRAP}={env_bootstrap} is set but no Kafka broker answers there "
            f"(start it, e.g. `docker compose up -d --wait kafka`, or unset {ENV_BOOTSTRAP})"
        )
    if _docker_answers():
        try:
            return _start_testcontainer(), ""
        except Exception as exc:
            docker_error = f"testcontainers Kafka failed to start ({exc!r}); "
    else:
        docker_error = ""
    local = module.status(state_dir)
    if local.running and local.answering and local.bootstrap:
        # Left running by `scripts/kafka-broker start`: reuse it and leave it running.
        return KafkaBroker(kind="local", bootstrap=local.bootstrap, state_dir=state_dir), ""
    # Our own broker in a private dir: parallel sessions in one checkout never stop or restart
    # each other's broker, and prune_orphans reclaims the dirs of sessions that were killed.
    module.prune_orphans(state_dir)
    private_dir = state_dir / f"pytest-{os.getpid()}"
    try:
        bootstrap = str(module.start(private_dir, owner_pid=os.getpid()))
    except Exception as exc:
        shutil.rmtree(private_dir, ignore_errors=True)
        return None, f"{docker_error}local JVM broker failed: {exc}. {HOW_TO_GET_A_BROKER}"
    return KafkaBroker(kind="local", bootstrap=bootstrap, state_dir=private_dir, started_here=True), ""


def _shutdown(broker: KafkaBroker) -> None:
    """Stop only what this session started; leave brokers started by scripts/test or a developer."""
    if broker.kind == "testcontainers" and broker.container is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            broker.container.stop()
    elif broker.kind == "local" and broker.started_here and broker.state_dir is not None:
        load_broker_module().stop(broker.state_dir)
        shutil.rmtree(broker.state_dir, ignore_errors=True)
    elif broker.kind == "local":
        broker.ensure_running()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """The session's broker (kind, bootstrap, log access); see the module docstring for the order."""
    global _SESSION_BROKER
    broker, reason = _resolve_broker()
    if broker is None:
        _unavailable(reason)
    _SESSION_BROKER = broker
    try:
        yield broker
    finally:
        _SESSION_BROKER = None
        _shutdown(broker)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: KafkaBroker) -> str:
    """Bootstrap address ``host:port`` of a real Kafka broker."""
    return kafka_broker.bootstrap


@pytest.fixture(scope="session")
def kafka_broker_control(kafka_broker: KafkaBroker) -> KafkaBrokerControl:
    """Stop/start the local broker mid-test; skips (the only allowed skip) for external brokers."""
    control = KafkaBrokerControl(kafka_broker)
    if not control.restartable:
        pytest.skip(
            f"broker restart needs the local JVM broker, but the session uses the {kafka_broker.kind} broker "
            f"{kafka_broker.bootstrap}; run without {ENV_BOOTSTRAP} (or via scripts/test) to test restarts"
        )
    return control


@pytest.fixture(autouse=True)
def _kafka_broker_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used kafka_broker_control, restart the broker if the test left it stopped."""
    yield
    if "kafka_broker_control" in request.fixturenames and _SESSION_BROKER is not None:
        _SESSION_BROKER.ensure_running()


_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")


class TopicFactory:
    """Creates uniquely named topics for one test and deletes them afterwards.

    Names are unique per call because deletion completes in the background and reusing a name
    races with it.
    """

    def __init__(self, broker: KafkaBroker, test_name: str) -> None:
        """Remember the broker and a readable name fragment; topics are created lazily."""
        self._broker = broker
        self._stem = _UNSAFE.sub("-", test_name).strip("-.")[:80] or "test"
        self.created: list[str] = []

    @property
    def bootstrap(self) -> str:
        """Bootstrap address of the broker the topics live on."""
        return self._broker.bootstrap

    def _admin(self) -> Any:
        """A short-lived AdminClient; confluent_kafka is imported lazily so unit tests need no broker libs."""
        admin_mod: Any = importlib.import_module("confluent_kafka.admin")
        return admin_mod.AdminClient({"bootstrap.servers": self._broker.bootstrap})

    def __call__(self, suffix: str = "", *, partitions: int = 1, config: dict[str, str] | None = None) -> str:
        """Create a topic with replication 1 and wait until every partition has a leader; return its name."""
        new_topic: Any = importlib.import_module("confluent_kafka.admin").NewTopic

        parts = ["tokcap-test", self._stem]
        if suffix:
            parts.append(_UNSAFE.sub("-", suffix))
        parts.append(uuid.uuid4().hex[:10])
        name = "-".join(parts)[:249]
        admin = self._admin()
        futures = admin.create_topics(
            [new_topic(name, num_partitions=partitions, replication_factor=1, config=config or {})],
            operation_timeout=30,
            request_timeout=30,
        )
        futures[name].result(timeout=60)
        self.created.append(name)
        self._wait_leaders(admin, name, partitions)
        return name

    def staged_apart(self, suffix: str = "", *, partitions: int = 1) -> str:
        """A topic made as ``tokcap topic create`` makes it: its limits record names a staged-payload topic."""
        topics: Any = importlib.import_module("transports.kafka.client.topics")
        parts = ["tokcap-test", self._stem]
        if suffix:
            parts.append(_UNSAFE.sub("-", suffix))
        parts.append(uuid.uuid4().hex[:10])
        name = "-".join(parts)[:200]
        topics.ensure_topic(self._broker.bootstrap, name, topics.TopicSettings(partitions=partitions))
        self.created.append(name)
        self.created.append(topics.staged_payload_topic_for(name))
        self._wait_leaders(self._admin(), name, partitions)
        return name

    @staticmethod
    def _wait_leaders(admin: Any, name: str, partitions: int, timeout: float = 30.0) -> None:
        """Creation returns before metadata propagates; wait so the first produce does not race it."""
        deadline = time.monotonic() + timeout
        while True:
            md = admin.list_topics(topic=name, timeout=10)
            topic = md.topics.get(name)
            if (
                topic is not None
                and topic.error is None
                and len(topic.partitions) == partitions
                and all(p.leader >= 0 for p in topic.partitions.values())
            ):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"topic {name} has no leader for all {partitions} partitions after {timeout}s"
                )
            time.sleep(0.1)

    def cleanup(self) -> None:
        """Delete every topic this factory created; an already missing topic is fine."""
        if not self.created:
            return
        from confluent_kafka import KafkaError, KafkaException

        self._broker.ensure_running()
        admin = self._admin()
        futures = admin.delete_topics(list(self.created), operation_timeout=30, request_timeout=30)
        errors: list[str] = []
        for name, fut in futures.items():
            try:
                fut.result(timeout=60)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if not (isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                    errors.append(f"{name}: {exc}")
        self.created.clear()
        if errors:
            raise RuntimeError("could not delete test topics: " + "; ".join(errors))


@pytest.fixture
def kafka_topic_factory(kafka_broker: KafkaBroker, request: pytest.FixtureRequest) -> Iterator[TopicFactory]:
    """Factory for tests needing several topics: ``name = kafka_topic_factory("suffix", partitions=3)``."""
    factory = TopicFactory(kafka_broker, request.node.name)
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def kafka_topic(kafka_topic_factory: TopicFactory) -> str:
    """A fresh single-partition topic unique to this test, deleted afterwards."""
    return kafka_topic_factory()


@pytest.fixture(params=["staged inline", "staged apart"])
def staging_topic(kafka_topic_factory: TopicFactory, request: pytest.FixtureRequest) -> str:
    """A fresh single-partition topic for staging, once as a topic made before staged-payload topics (stages
    inline) and once as ``tokcap topic create`` makes one now (stage references, payloads on their own topic)."""
    if request.param == "staged apart":
        return kafka_topic_factory.staged_apart()
    return kafka_topic_factory()


def _uses_broker(item: pytest.Item) -> bool:
    """True if the test (or another test in its module) depends on the broker fixtures."""
    if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if item.get_closest_marker("kafka") is not None:
        return True
    module = getattr(item, "module", None)
    return bool(module is not None and getattr(module, "_tokcap_uses_kafka_broker", False))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Flag modules with any broker-using test, so every failure there gets the broker log."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            module._tokcap_uses_kafka_broker = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the broker log tail to failures in modules that use the broker."""
    report = yield
    if report.failed and _SESSION_BROKER is not None and _uses_broker(item):
        with contextlib.suppress(Exception):
            report.sections.append(("kafka broker log (tail)", _SESSION_BROKER.log_tail(60)))
    return report
