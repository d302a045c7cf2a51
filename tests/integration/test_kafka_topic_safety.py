"""A run topic is the only complete record of the run: tokcap refuses settings that would destroy it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from cli_helpers import Completed, tokcap

pytestmark = pytest.mark.kafka


def assert_one_line_error(completed: Completed, fragment: str) -> None:
    assert completed.returncode == 1, completed.stdout
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("tokcap: error: ") and fragment in lines[0], lines[0]


@pytest.fixture
def run_id(kafka_topic_factory: Any) -> str:
    run = f"safety-{uuid.uuid4().hex[:12]}"
    kafka_topic_factory.created.extend([f"tokcap.{run}", f"tokcap-staged.tokcap.{run}"])
    return run


@pytest.mark.parametrize("policy", ["compact", "compact,delete"])
def test_creating_a_compacted_run_topic_is_refused_with_one_line(
    kafka_bootstrap: str, run_id: str, policy: str
) -> None:
    base = ("--bootstrap", kafka_bootstrap, "--run", run_id)
    refused = tokcap("topic", "create", *base, "--config", f"cleanup.policy={policy}")
    assert_one_line_error(refused, "compaction keeps only the last event of each rollout")
    assert_one_line_error(tokcap("topic", "describe", *base), "does not exist")


def test_a_run_topic_keeps_the_whole_run_unless_a_retention_is_given(
    kafka_bootstrap: str, run_id: str
) -> None:
    base = ("--bootstrap", kafka_bootstrap, "--run", run_id)
    created = tokcap("topic", "create", *base, "--json")
    assert created.returncode == 0, created.stderr
    described = tokcap("topic", "describe", *base, "--json").json()
    assert described["configs"]["retention.ms"] == "-1"
    assert described["warnings"] == []
    assert "warning" not in tokcap("topic", "describe", *base).stdout


def test_describe_warns_when_the_run_topic_has_a_finite_retention(kafka_bootstrap: str, run_id: str) -> None:
    base = ("--bootstrap", kafka_bootstrap, "--run", run_id)
    created = tokcap("topic", "create", *base, "--config", "retention.ms=86400000")
    assert created.returncode == 0, created.stderr
    shown = tokcap("topic", "describe", *base)
    assert shown.returncode == 0, shown.stderr
    assert "warning: retention.ms=86400000" in shown.stdout
    assert "cannot be replayed" in " ".join(shown.stdout.split())


@pytest.mark.parametrize("command", [("topic", "describe"), ("topic", "create"), ("log", "--rollout", "r1")])
def test_an_unknown_client_property_is_a_one_line_error_naming_it(
    kafka_bootstrap: str, run_id: str, command: tuple[str, ...]
) -> None:
    completed = tokcap(*command, "--bootstrap", kafka_bootstrap, "--run", run_id, "-X", "no.such.prop=1")
    assert_one_line_error(completed, "'no.such.prop' is not a Kafka client property")
