"""Keep docker-compose.yml correct without a Docker engine.

The compose broker cannot run here, so this test reads the file the way the apache/kafka image
does (KAFKA_* env vars become server properties) and checks it against what the test fixture
and the local broker expect: same Kafka version, a KRaft node whose controller quorum matches its
listeners, a client listener advertised and published as localhost:9092, and single-node settings
for the internal topics.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
from kafka_broker_fixture import ENV_BOOTSTRAP, load_broker_module

yaml = pytest.importorskip("yaml")

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
EXPECTED_BOOTSTRAP = "localhost:9092"

# Server settings that must agree between the compose broker and scripts/kafka-broker.
SHARED_SETTINGS = (
    "process.roles",
    "offsets.topic.replication.factor",
    "transaction.state.log.replication.factor",
    "transaction.state.log.min.isr",
    "share.coordinator.state.topic.replication.factor",
    "share.coordinator.state.topic.min.isr",
    "default.replication.factor",
    "min.insync.replicas",
    "group.initial.rebalance.delay.ms",
)
# Read by the image's launcher, not turned into server properties.
NON_PROPERTY_ENV = {"KAFKA_VERSION", "KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_JMX_OPTS"}


def env_to_property(name: str) -> str:
    """The apache/kafka image's rule: drop KAFKA_, lower-case, ``___``→``-``, ``__``→``_``, ``_``→``.``."""
    key = name.removeprefix("KAFKA_").lower()
    return key.replace("_", ".").replace("...", "-").replace("..", "_")


def parse_listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,...`` → {NAME: (host, port)}; an empty host means all interfaces."""
    result: dict[str, tuple[str, int]] = {}
    for entry in value.split(","):
        match = re.fullmatch(r"([A-Z_]+)://([^:]*):(\d+)", entry.strip())
        assert match, f"bad listener entry {entry!r}"
        result[match.group(1)] = (match.group(2), int(match.group(3)))
    return result


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    """The kafka service of docker-compose.yml."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and "services" in data
    assert list(data["services"]) == ["kafka"], "one single-node broker service named kafka"
    svc = data["services"]["kafka"]
    assert isinstance(svc, dict)
    return svc


@pytest.fixture(scope="module")
def env(service: dict[str, Any]) -> dict[str, str]:
    """Service environment as strings (YAML turns 1 into an int)."""
    raw = service["environment"]
    assert isinstance(raw, dict), "environment must be a mapping"
    return {str(k): str(v) for k, v in raw.items()}


@pytest.fixture(scope="module")
def props(env: dict[str, str]) -> dict[str, str]:
    """Server properties as the image derives them from KAFKA_* variables."""
    return {
        env_to_property(k): v for k, v in env.items() if k.startswith("KAFKA_") and k not in NON_PROPERTY_ENV
    }


def test_env_to_property_rule() -> None:
    """The conversion helper follows the image's documented escaping."""
    assert env_to_property("KAFKA_CONTROLLER_QUORUM_VOTERS") == "controller.quorum.voters"
    assert env_to_property("KAFKA_SOME__UNDERSCORE") == "some_underscore"
    assert env_to_property("KAFKA_SOME___DASH") == "some-dash"


def test_image_is_official_and_pinned_to_local_broker_version(service: dict[str, Any]) -> None:
    """Compose and scripts/kafka-broker run the same Kafka release."""
    assert service["image"] == f"apache/kafka:{load_broker_module().KAFKA_VERSION}"


def test_client_port_published_on_localhost(service: dict[str, Any], props: dict[str, str]) -> None:
    """The host reaches the broker at localhost:9092, the port it advertises."""
    published: list[tuple[str, int, int]] = []
    for port in service["ports"]:
        parts = str(port).split(":")
        host_ip = parts[0] if len(parts) == 3 else ""
        published.append((host_ip, int(parts[-2]), int(parts[-1])))
    assert ("127.0.0.1", 9092, 9092) in published or ("", 9092, 9092) in published
    container_ports = {p[2] for p in published}
    listeners = parse_listeners(props["listeners"])
    assert listeners["CONTROLLER"][1] not in container_ports, "the controller listener stays private"


def test_kraft_combined_node(props: dict[str, str], env: dict[str, str]) -> None:
    """A single KRaft node acting as broker and controller, with a valid cluster id."""
    assert set(props["process.roles"].split(",")) == {"broker", "controller"}
    assert "zookeeper.connect" not in props
    cluster_id = env["CLUSTER_ID"]
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_controller_quorum_matches_listeners(props: dict[str, str]) -> None:
    """The only voter is this node, on the port of its controller listener."""
    listeners = parse_listeners(props["listeners"])
    controller_names = props["controller.listener.names"].split(",")
    assert len(controller_names) == 1 and controller_names[0] in listeners
    voters = props["controller.quorum.voters"].split(",")
    assert len(voters) == 1
    node_id, address = voters[0].split("@")
    assert node_id == props["node.id"]
    host, port = address.rsplit(":", 1)
    assert host in ("localhost", "127.0.0.1")
    assert int(port) == listeners[controller_names[0]][1]
    protocol_map = dict(item.split(":") for item in props["listener.security.protocol.map"].split(","))
    assert set(listeners) <= set(protocol_map)


def test_advertised_listener_is_what_tests_use(props: dict[str, str]) -> None:
    """Clients (and the fixture via TOKCAP_KAFKA_BOOTSTRAP) connect to localhost:9092."""
    listeners = parse_listeners(props["listeners"])
    advertised = parse_listeners(props["advertised.listeners"])
    assert list(advertised) == ["PLAINTEXT"]
    assert advertised["PLAINTEXT"] == ("localhost", 9092)
    assert listeners["PLAINTEXT"][1] == 9092
    assert props["inter.broker.listener.name"] in advertised
    assert props["controller.listener.names"] not in advertised


def test_single_node_settings_match_local_broker(props: dict[str, str], tmp_path: Path) -> None:
    """Internal topics use replication 1, exactly like the local JVM broker's server.properties."""
    module = load_broker_module()
    local = module.read_properties_text(module.server_properties(tmp_path, 1111, 2222))
    for key in SHARED_SETTINGS:
        assert key in props, f"{key} missing from docker-compose.yml"
        assert props[key] == local[key], f"{key}: compose {props[key]!r} != local broker {local[key]!r}"


def test_healthcheck_probes_client_listener(service: dict[str, Any]) -> None:
    """compose up --wait returns only when the broker answers on 9092."""
    check = service["healthcheck"]
    command = " ".join(check["test"]) if isinstance(check["test"], list) else str(check["test"])
    assert "kafka-broker-api-versions.sh" in command and "localhost:9092" in command
    assert int(check["retries"]) >= 5


def test_documents_running_the_suite_against_it() -> None:
    """The file tells users how to point the README's test command at it."""
    text = COMPOSE_FILE.read_text()
    assert f"{ENV_BOOTSTRAP}={EXPECTED_BOOTSTRAP} scripts/test" in text
