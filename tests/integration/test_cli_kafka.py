"""The Kafka commands of ``tokcap`` against a real broker: demo, replay, log, materialize and topics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Completed, tokcap
from factories import make_entry
from store_contract import directory_contents

from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka


def assert_one_line_error(completed: Completed, fragment: str) -> None:
    assert completed.returncode == 1, completed.stdout
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("tokcap: error: ") and fragment in lines[0]


@pytest.fixture
def run_id(kafka_topic_factory: Any) -> str:
    """A run id whose topic does not exist yet; the topic is deleted after the test."""
    run = f"cli-{uuid.uuid4().hex[:12]}"
    kafka_topic_factory.created.extend([f"tokcap.{run}", f"tokcap-staged.tokcap.{run}"])
    return run


@pytest.fixture
def demo_over_kafka(kafka_bootstrap: str, run_id: str, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    live = tmp_path / "live"
    completed = tokcap(
        "demo", "--bootstrap", kafka_bootstrap, "--run", run_id, "--rollouts", "10", "--turns", "3",
        "--dir", str(live), "--json",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return live, completed.json()


def test_the_demo_over_kafka_completes_and_its_store_holds_what_it_reports(
    demo_over_kafka: tuple[Path, dict[str, Any]], run_id: str
) -> None:
    live, report = demo_over_kafka
    assert report["transport"] == "kafka" and report["topic"] == f"tokcap.{run_id}"
    totals = report["totals"]
    assert totals["rollouts"] == 10 and totals["masked"] == 2 and totals["retired"] == 7
    described = tokcap("inspect", str(live), "--json").json()
    states = {row["rollout_id"]: row["state"] for row in described["rollouts"]}
    for rollout in report["rollouts"]:
        assert states[rollout["rollout_id"]] == ("retired" if rollout["retired"] else "frozen")
    assert described["kafka_checkpoints"] and described["dead_letters"] == {}


def test_replaying_a_demo_run_reproduces_its_store_byte_for_byte(
    demo_over_kafka: tuple[Path, dict[str, Any]], kafka_bootstrap: str, run_id: str, tmp_path: Path
) -> None:
    live, _ = demo_over_kafka
    replayed = tmp_path / "replayed"
    completed = tokcap(
        "replay", "--bootstrap", kafka_bootstrap, "--run", run_id, "--dir", str(replayed), "--json"
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.json()["mode"] == "materializer"
    assert directory_contents(replayed) == directory_contents(live)


def test_replaying_one_rollout_reproduces_that_rollouts_files(
    demo_over_kafka: tuple[Path, dict[str, Any]], kafka_bootstrap: str, run_id: str, tmp_path: Path
) -> None:
    live, _ = demo_over_kafka
    replayed = tmp_path / "one"
    completed = tokcap(
        "replay", "--bootstrap", kafka_bootstrap, "--run", run_id, "--dir", str(replayed),
        "--rollout", "demo-00004", "--json",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    files = directory_contents(replayed)
    assert files and all(name.startswith("demo-00004.") for name in files)
    live_files = {
        name: data for name, data in directory_contents(live).items() if name.startswith("demo-00004.")
    }
    assert files == live_files


def test_replaying_until_the_freeze_shows_the_rollout_still_open(
    demo_over_kafka: tuple[Path, dict[str, Any]], kafka_bootstrap: str, run_id: str, tmp_path: Path
) -> None:
    timeline = tokcap(
        "log", "--bootstrap", kafka_bootstrap, "--run", run_id, "--rollout", "demo-00004", "--json"
    )
    assert timeline.returncode == 0, timeline.stderr
    freeze = next(event for event in timeline.json()["events"] if event["event_type"] == "freeze")
    until = f"{freeze['partition']}:{freeze['offset']}"
    replayed = tmp_path / "before-freeze"
    completed = tokcap(
        "replay", "--bootstrap", kafka_bootstrap, "--run", run_id, "--dir", str(replayed),
        "--rollout", "demo-00004", "--until", until, "--json",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    detail = tokcap("inspect", str(replayed), "demo-00004", "--json").json()
    assert detail["state"] == "open"
    assert [entry["model_call_id"] for entry in detail["entries"]] == ["turn-0", "turn-1", "turn-2"]
    assert detail["verdict"]["masked"] is False


async def scripted_late_write(bootstrap: str, topic: str, store_dir: Path) -> None:
    """One rollout: an intent and its entry, a freeze, then a write of an attempt that was still running."""
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, writer_id="server-a")
    source = KafkaTokenSource(
        bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir, writer_id="trainer"
    )
    try:
        await sink.begin_call("r1", "c1")
        await sink.put(make_entry("r1", "c1"))
        snapshot = await source.freeze("r1")
        await sink.put(make_entry("r1", "late"))
        assert await source.drop("r1", snapshot.snapshot_id, snapshot.version) is False
    finally:
        await sink.close()
        await source.close()


def test_log_shows_the_rejected_late_write_of_a_scripted_rollout(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    asyncio.run(scripted_late_write(kafka_bootstrap, kafka_topic, tmp_path / "store"))
    completed = tokcap(
        "log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "r1", "--json"
    )
    assert completed.returncode == 0, completed.stderr
    events = completed.json()["events"]
    assert [(e["event_type"], e["model_call_id"], e["decision"]) for e in events] == [
        ("intent", "c1", "accepted"),
        ("put", "c1", "accepted"),
        ("freeze", "", "accepted"),
        ("put", "late", "rejected-after-freeze"),
        ("drop", "", "no-op"),
    ]
    assert [e["offset"] for e in events] == sorted(e["offset"] for e in events)
    assert events[3]["writer"] == "server-a" and events[3]["version"] == 3
    human = tokcap("log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "r1")
    assert "rejected-after-freeze" in human.stdout and "late" in human.stdout


def test_log_of_a_rollout_with_no_events_is_one_line(kafka_bootstrap: str, kafka_topic: str) -> None:
    assert_one_line_error(
        tokcap("log", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic, "--rollout", "absent"),
        "no events",
    )


def test_topic_create_describe_and_delete_manage_the_run_topic(kafka_bootstrap: str, run_id: str) -> None:
    base = ("--bootstrap", kafka_bootstrap, "--run", run_id)
    created = tokcap("topic", "create", *base, "--partitions", "2", "--config", "retention.ms=-1", "--json")
    assert created.returncode == 0, created.stderr
    assert created.json()["created"] is True
    again = tokcap("topic", "create", *base, "--partitions", "2", "--config", "retention.ms=-1", "--json")
    assert again.returncode == 0 and again.json()["created"] is False
    assert_one_line_error(tokcap("topic", "create", *base, "--partitions", "3"), "different settings")
    described = tokcap("topic", "describe", *base, "--json")
    assert described.returncode == 0, described.stderr
    description = described.json()
    assert [p["partition"] for p in description["partitions"]] == [0, 1]
    assert description["configs"]["retention.ms"] == "-1"
    assert description["replayable_from_start"] is True
    assert_one_line_error(tokcap("topic", "delete", *base), "--yes")
    deleted = tokcap("topic", "delete", *base, "--yes", "--json")
    assert deleted.returncode == 0 and deleted.json() == {
        "deleted": True,
        "topic": f"tokcap.{run_id}",
        "staged_payload_topic": f"tokcap-staged.tokcap.{run_id}",
    }
    assert_one_line_error(tokcap("topic", "describe", *base), "does not exist")


@pytest.mark.parametrize(
    "command",
    [
        ("log", "--run", "some-run", "--rollout", "r1"),
        ("topic", "describe", "--run", "some-run"),
        ("demo", "--rollouts", "2"),
    ],
)
def test_an_unreachable_broker_is_one_clear_line(command: tuple[str, ...]) -> None:
    completed = tokcap(*command, "--bootstrap", "127.0.0.1:1", "--timeout", "2")
    assert_one_line_error(completed, "no Kafka broker answered at 127.0.0.1:1")


def test_materialize_stops_cleanly_on_sigterm_with_its_checkpoint_written(
    demo_over_kafka: tuple[Path, dict[str, Any]], kafka_bootstrap: str, run_id: str, tmp_path: Path
) -> None:
    live, _ = demo_over_kafka
    projected = tmp_path / "projected"
    process = subprocess.Popen(
        [sys.executable, "-m", "tokcap.cli", "materialize", "--bootstrap", kafka_bootstrap, "--run", run_id,
         "--dir", str(projected), "--interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        expected = {
            name: json.loads(data) for name, data in directory_contents(live).items() if "checkpoint" in name
        }
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            written = {name: json.loads((projected / name).read_bytes() or b"{}") for name in expected
                       if (projected / name).exists()}  # fmt: skip
            if written == expected:
                break
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "stopped; checkpoint written" in stderr
    assert directory_contents(projected) == directory_contents(live)


def test_materialize_until_caught_up_projects_the_same_store(
    demo_over_kafka: tuple[Path, dict[str, Any]], kafka_bootstrap: str, run_id: str, tmp_path: Path
) -> None:
    live, _ = demo_over_kafka
    projected = tmp_path / "caught-up"
    completed = tokcap(
        "materialize",
        "--bootstrap",
        kafka_bootstrap,
        "--run",
        run_id,
        "--dir",
        str(projected),
        "--until-caught-up",
    )
    assert completed.returncode == 0, completed.stderr
    assert directory_contents(projected) == directory_contents(live)
