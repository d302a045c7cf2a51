"""Against a SASL_SSL broker with ACLs: the capture path works with the right credentials, fails fast and
clearly with wrong ones, and a writer cannot do more than write."""

from __future__ import annotations

import asyncio
import json
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Completed, tokcap
from factories import chat_response, make_entry
from kafka_broker_fixture import load_broker_module
from secure_kafka_fixture import SecureKafka
from staging_calls import conversation

from tokcap.errors import TokcapError
from transports.kafka import KafkaTokenSink, KafkaTokenSource, Materializer
from transports.kafka.errors import BrokerAuthenticationError, BrokerAuthorizationError, BrokerTlsError
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

pytestmark = pytest.mark.kafka

DELIVERY_TIMEOUT_S = 60.0
"""Long on purpose: a refused login must fail far sooner than the delivery bound, not by waiting it out."""

WRITER_OPERATIONS = ("WRITE", "DESCRIBE")
TRAINER_OPERATIONS = ("READ", "WRITE", "DESCRIBE")


def assert_one_line_error(completed: Completed, fragment: str) -> str:
    assert completed.returncode == 1, completed.stdout
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("tokcap: error: ") and fragment in lines[0], lines[0]
    return lines[0]


def writer_sink(secure_kafka: SecureKafka, run: str) -> KafkaTokenSink:
    """A model server's sink, logged in as the write-only ``writer``."""
    return KafkaTokenSink(
        bootstrap_servers=secure_kafka.bootstrap, run_id=run, producer_config=secure_kafka.config("writer")
    )


def trainer_source(secure_kafka: SecureKafka, run: str, store_dir: Path) -> KafkaTokenSource:
    """The trainer's source, logged in as ``trainer`` for both its producer and its materializer."""
    return KafkaTokenSource(
        bootstrap_servers=secure_kafka.bootstrap,
        run_id=run,
        store_dir=store_dir,
        producer_config=secure_kafka.config("trainer"),
        consumer_config=secure_kafka.config("trainer"),
    )


@pytest.fixture
def run_topic(secure_kafka: SecureKafka) -> tuple[str, str]:
    """A run created by the admin through the CLI, writable by ``writer`` and usable by ``trainer``."""
    run = secure_kafka.new_run()
    created = tokcap(
        "topic", "create", "--bootstrap", secure_kafka.bootstrap, "--run", run, *secure_kafka.options("admin")
    )
    assert created.returncode == 0, created.stderr
    topic = f"tokcap.{run}"
    secure_kafka.grant("writer", topic, WRITER_OPERATIONS)
    secure_kafka.grant("trainer", topic, TRAINER_OPERATIONS)
    return run, topic


def test_the_whole_path_works_with_the_right_credentials_and_tls_verified(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    run, _ = run_topic

    async def capture_and_freeze() -> Any:
        sink = writer_sink(secure_kafka, run)
        source = trainer_source(secure_kafka, run, tmp_path / "store")
        try:
            await sink.begin_call("r1", "c1")
            await sink.put(make_entry("r1", "c1"))
            return await source.freeze("r1")
        finally:
            await sink.close()
            await source.close()

    snapshot = asyncio.run(capture_and_freeze())
    assert [e.model_call_id for e in snapshot.entries] == ["c1"] and not snapshot.incomplete

    base = ("--bootstrap", secure_kafka.bootstrap, "--run", run)
    timeline = tokcap("log", *base, "--rollout", "r1", "--json", *secure_kafka.options("trainer"))
    assert timeline.returncode == 0, timeline.stderr
    assert [row["event_type"] for row in json.loads(timeline.stdout)["events"]][:3] == [
        "intent",
        "put",
        "freeze",
    ]
    projected = tmp_path / "projected"
    materialized = tokcap(
        "materialize", *base, "--dir", str(projected), "--until-caught-up", *secure_kafka.options("trainer")
    )
    assert materialized.returncode == 0, materialized.stderr
    described = tokcap("topic", "describe", *base, "--json", *secure_kafka.options("admin"))
    assert described.returncode == 0, described.stderr
    assert described.json()["messages"] == 4  # the topic's limits record, then the intent, put and freeze


def test_a_wrong_password_fails_the_sink_at_once_naming_broker_and_mechanism(
    secure_kafka: SecureKafka, run_topic: tuple[str, str]
) -> None:
    run, _ = run_topic
    wrong = "not-the-writers-password"

    async def put() -> float:
        sink = KafkaTokenSink(
            bootstrap_servers=secure_kafka.bootstrap,
            run_id=run,
            delivery_timeout_s=DELIVERY_TIMEOUT_S,
            producer_config=secure_kafka.config("writer", password=wrong),
        )
        started = time.monotonic()
        try:
            with pytest.raises(BrokerAuthenticationError) as caught:
                await sink.put(make_entry("r1", "c1"))
            return time.monotonic() - started
        finally:
            await sink.close()
            shown = "".join(traceback.format_exception(caught.value))
            assert wrong not in shown
            assert secure_kafka.bootstrap in str(caught.value) and "SCRAM-SHA-512" in str(caught.value)

    assert asyncio.run(put()) < DELIVERY_TIMEOUT_S


def test_a_wrong_password_is_one_line_from_the_cli_naming_broker_and_mechanism(
    secure_kafka: SecureKafka, run_topic: tuple[str, str]
) -> None:
    run, _ = run_topic
    wrong = "not-the-trainers-password"
    for command in (("topic", "describe"), ("log", "--rollout", "r1"), ("materialize", "--until-caught-up")):
        extra = ("--dir", "unused") if command[0] == "materialize" else ()
        completed = tokcap(
            *command, *extra, "--bootstrap", secure_kafka.bootstrap, "--run", run, "--timeout", "60",
            *secure_kafka.options("trainer", password=wrong),
        )  # fmt: skip
        line = assert_one_line_error(completed, f"the broker at {secure_kafka.bootstrap} refused the login")
        assert "SCRAM-SHA-512" in line and wrong not in completed.stderr + completed.stdout


def test_a_wrong_password_stops_the_materializer_and_the_source_with_a_clear_error(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    _, topic = run_topic
    materializer = Materializer(
        secure_kafka.bootstrap,
        topic,
        tmp_path,
        consumer_config=secure_kafka.config("trainer", password="nope"),
    )
    with pytest.raises(
        TokcapError, match="refused the login of User:trainer with SASL mechanism SCRAM-SHA-512"
    ):
        materializer.start()
    with pytest.raises(
        TokcapError, match="refused the login of User:trainer with SASL mechanism SCRAM-SHA-512"
    ):
        KafkaTokenSource(
            bootstrap_servers=secure_kafka.bootstrap,
            topic=topic,
            store_dir=tmp_path / "source",
            delivery_timeout_s=DELIVERY_TIMEOUT_S,
            producer_config=secure_kafka.config("trainer", password="nope"),
            consumer_config=secure_kafka.config("trainer", password="nope"),
        )


def test_an_untrusted_broker_certificate_fails_fast_and_clearly(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    run, _ = run_topic
    load_broker_module().make_certificates(tmp_path / "other-ca", "unused-password")
    other_ca = str(tmp_path / "other-ca" / "ca.pem")

    async def put() -> float:
        sink = KafkaTokenSink(
            bootstrap_servers=secure_kafka.bootstrap,
            run_id=run,
            delivery_timeout_s=DELIVERY_TIMEOUT_S,
            producer_config=secure_kafka.config("writer", ca_location=other_ca),
        )
        started = time.monotonic()
        try:
            with pytest.raises(BrokerTlsError, match="TLS handshake with the broker at"):
                await sink.put(make_entry("r1", "c1"))
            return time.monotonic() - started
        finally:
            await sink.close()

    assert asyncio.run(put()) < DELIVERY_TIMEOUT_S
    completed = tokcap(
        "topic", "describe", "--bootstrap", secure_kafka.bootstrap, "--run", run, "--timeout", "60",
        *secure_kafka.options("admin", ca_location=other_ca),
    )  # fmt: skip
    assert_one_line_error(completed, "certificate verify failed")


def test_a_writer_allowed_only_to_write_its_run_topic_cannot_read_or_delete_it(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    run, topic = run_topic

    async def put() -> None:
        sink = KafkaTokenSink(
            bootstrap_servers=secure_kafka.bootstrap,
            run_id=run,
            producer_config=secure_kafka.config("writer"),
        )
        try:
            await sink.put(make_entry("r1", "c1"))
        finally:
            await sink.close()

    asyncio.run(put())
    base = ("--bootstrap", secure_kafka.bootstrap, "--run", run, *secure_kafka.options("writer"))
    assert_one_line_error(tokcap("log", *base, "--rollout", "r1"), "does not allow User:writer to read")
    assert_one_line_error(
        tokcap("topic", "delete", *base, "--yes"), f"does not allow User:writer to delete topic {topic!r}"
    )
    still_there = tokcap(
        "topic", "describe", "--bootstrap", secure_kafka.bootstrap, "--run", run, "--json",
        *secure_kafka.options("admin"),
    )  # fmt: skip
    assert (
        still_there.returncode == 0 and still_there.json()["messages"] == 2
    )  # its limits record and the put


def test_the_lineage_resolver_links_calls_over_the_secured_broker_with_read_rights(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    from tokcap import sink as capture
    from transports.kafka.lineage import KafkaLineageResolver

    run, _ = run_topic
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "one"}, {"role": "user", "content": "more"}]

    async def two_calls() -> dict[str, tuple[str | None, str | None]]:
        sink = writer_sink(secure_kafka, run)
        resolver = KafkaLineageResolver(
            bootstrap_servers=secure_kafka.bootstrap,
            run_id=run,
            consumer_config=secure_kafka.config("trainer"),
        )
        source = trainer_source(secure_kafka, run, tmp_path / "store")
        try:
            for call_id, request, answer in (
                ("c1", first, chat_response("one", [1, 2], [3])),
                ("c2", second, chat_response("two", [1, 2, 3, 4], [5])),
            ):
                token = capture.set_token_sink(
                    capture.CaptureContext("r-lineage", call_id, sink, lineage_store=resolver)
                )
                try:
                    await capture.resolve_parent(request)
                    await capture.capture_tokens(answer)
                finally:
                    capture.reset_token_sink(token)
            snapshot = await source.freeze("r-lineage")
            return {e.model_call_id: (e.parent_resolution, e.parent_call_id) for e in snapshot.entries}
        finally:
            await asyncio.gather(sink.close(), resolver.close(), source.close())

    assert asyncio.run(two_calls()) == {"c1": ("root", None), "c2": ("resolved", "c1")}


def put_until(
    sink: KafkaTokenSink, rollout: str, done: Any, *, within_s: float
) -> tuple[list[str], Exception]:
    """Put one call a second until ``done(error)`` says the outcome looked for came; the calls acknowledged.

    Returns the call ids the broker acknowledged and the last failure (or a placeholder when none failed).
    """

    async def loop() -> tuple[list[str], Exception]:
        acknowledged: list[str] = []
        last: Exception = AssertionError(f"nothing looked for happened within {within_s} s")
        deadline = time.monotonic() + within_s
        number = 0
        while time.monotonic() < deadline:
            number += 1
            call = f"{rollout}-c{number}"
            try:
                await sink.put(make_entry(rollout, call))
            except TokcapError as exc:
                last = exc
                if done(exc):
                    return acknowledged, exc
            else:
                acknowledged.append(call)
                if done(None):
                    return acknowledged, last
            await asyncio.sleep(1.0)
        raise last

    return asyncio.run(loop())


def frozen_calls(secure_kafka: SecureKafka, run: str, store_dir: Path, rollouts: list[str]) -> set[str]:
    """Every call id the trainer's freeze of ``rollouts`` holds."""

    async def freeze() -> set[str]:
        source = trainer_source(secure_kafka, run, store_dir)
        try:
            calls: set[str] = set()
            for rollout in rollouts:
                calls |= {entry.model_call_id for entry in (await source.freeze(rollout)).entries}
            return calls
        finally:
            await source.close()

    return asyncio.run(freeze())


def test_a_revoked_acl_fails_puts_naming_principal_and_operation_and_the_sink_recovers_when_granted_again(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    run, topic = run_topic
    sink = writer_sink(secure_kafka, run)
    try:
        before, _ = put_until(sink, "r-before", lambda error: error is None, within_s=30)
        secure_kafka.revoke("writer", topic, "WRITE")
        during, refused = put_until(
            sink, "r-during", lambda error: isinstance(error, BrokerAuthorizationError), within_s=30
        )
        shown = "".join(traceback.format_exception(refused))
        assert f"does not allow User:writer to write to topic {topic!r}" in str(refused)
        assert secure_kafka.passwords["writer"] not in shown
        secure_kafka.grant("writer", topic, ("WRITE",))
        after, _ = put_until(sink, "r-after", lambda error: error is None, within_s=30)
    finally:
        asyncio.run(sink.close())

    acknowledged = set(before + during + after)
    assert before and after
    held = frozen_calls(secure_kafka, run, tmp_path / "store", ["r-before", "r-during", "r-after"])
    assert acknowledged <= held, f"acknowledged but lost: {sorted(acknowledged - held)}"


def test_a_rotated_password_fails_puts_clearly_and_the_sink_recovers_once_it_is_valid_again(
    secure_kafka: SecureKafka, run_topic: tuple[str, str], tmp_path: Path
) -> None:
    run, _ = run_topic
    original = secure_kafka.passwords["writer"]
    rotated = f"rotated-{uuid.uuid4().hex}"
    sink = writer_sink(secure_kafka, run)
    try:
        before, _ = put_until(sink, "r-before", lambda error: error is None, within_s=30)
        secure_kafka.set_password("writer", rotated)
        # The broker makes live sessions log in again every few seconds (connections.max.reauth.ms), so the
        # rotation reaches the sink's open connection mid-run.
        during, refused = put_until(
            sink, "r-during", lambda error: isinstance(error, BrokerAuthenticationError), within_s=40
        )
        shown = "".join(traceback.format_exception(refused))
        assert "refused the login of User:writer with SASL mechanism SCRAM-SHA-512" in str(refused)
        assert original not in shown and rotated not in shown
        secure_kafka.set_password("writer", original)
        after, _ = put_until(sink, "r-after", lambda error: error is None, within_s=60)
    finally:
        secure_kafka.set_password("writer", original)
        asyncio.run(sink.close())

    acknowledged = set(before + during + after)
    assert before and after
    held = frozen_calls(secure_kafka, run, tmp_path / "store", ["r-before", "r-during", "r-after"])
    assert acknowledged <= held, f"acknowledged but lost: {sorted(acknowledged - held)}"


def test_staging_works_with_the_rights_the_acl_table_names_and_needs_write_on_the_payload_topic(
    secure_kafka: SecureKafka,
) -> None:
    run = secure_kafka.new_run()
    created = tokcap(
        "topic", "create", "--bootstrap", secure_kafka.bootstrap, "--run", run, *secure_kafka.options("admin")
    )
    assert created.returncode == 0, created.stderr
    topic, payload_topic = f"tokcap.{run}", f"tokcap-staged.tokcap.{run}"
    secure_kafka.grant("writer", topic, ("WRITE", "DESCRIBE", "READ"))
    secure_kafka.grant("trainer", topic, TRAINER_OPERATIONS)
    secure_kafka.grant("trainer", payload_topic, ("READ", "DESCRIBE"))
    sink = KafkaStagingSink(
        bootstrap_servers=secure_kafka.bootstrap,
        run_id=run,
        producer_config=secure_kafka.config("writer"),
        delivery_timeout_s=DELIVERY_TIMEOUT_S,
    )
    image = bytes(range(256)) * 64
    [first, second] = conversation("acl-staged", 2)
    try:
        refused = sink.stage(first.call, attachments={"image": image})
        assert not refused.ok and payload_topic in (refused.error or ""), refused.error
        secure_kafka.grant("writer", payload_topic, WRITER_OPERATIONS)
        deadline = time.monotonic() + 30
        while not (staged := sink.stage(second.call, attachments={"image": image})).ok:
            assert time.monotonic() < deadline, staged.error
            time.sleep(0.5)
    finally:
        sink.close()
    source = KafkaStagingSource(
        bootstrap_servers=secure_kafka.bootstrap, run_id=run, consumer_config=secure_kafka.config("trainer")
    )
    try:
        [snapshot] = source.fetch_full([staged.staging_key])
        assert snapshot.model_dump() == second.call.model_dump()
        assert source.fetch_attachments(staged.staging_key) == {"image": image}
    finally:
        source.close()
