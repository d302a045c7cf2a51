"""Engine-side staging over a real broker: the conformance kit, large payloads, poison, replay and ``tokcap log``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from cli_helpers import tokcap
from confluent_kafka import Producer
from staging_calls import commit_for, conversation, cumulative_tokens, staged_call
from store_contract import directory_contents

from tests.topic_replay import replay_topic
from tokcap.errors import ConflictingEntryError, RolloutRetiredError
from tokcap.events import StagedBlob, StageEvent
from tokcap.staging import verify_and_linearize
from tokcap.staging.conformance import run_staging_conformance
from tokcap.staging.records import RolloutReceipt
from tokcap.store import TokenCaptureStore
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.materializer.dead_letters import dead_letter_files
from transports.kafka.source import KafkaTokenSource
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.codec import encode_event_messages

pytestmark = pytest.mark.kafka


def _dead_letters(store_dir: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line) for path in dead_letter_files(store_dir) for line in path.read_bytes().splitlines()
    ]


def test_the_staging_conformance_kit_passes_on_the_kafka_transport(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    def sink() -> KafkaStagingSink:
        return KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic)

    def source() -> KafkaStagingSource:
        return KafkaStagingSource(
            bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=tmp_path / "s"
        )

    def ledger() -> KafkaLineageResolver:
        return KafkaLineageResolver(
            bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=tmp_path / "s"
        )

    passed = asyncio.run(run_staging_conformance(sink, source, ledger))
    assert len(passed) == 9


def test_several_mib_of_attachment_and_routed_experts_cross_a_default_broker_whole_to_a_fresh_reader(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    image = os.urandom(6 * 1024 * 1024 + 17)
    experts = {"format": "nrlre1", "layers": [[index % 128 for index in range(8 * 48)] for _ in range(900)]}
    call = staged_call("big-r", "call-0", [1, 2, 3], list(range(10, 1010)), extras=experts)
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic)
    try:
        result = sink.stage(call, attachments={"image": image, "empty": b""})
    finally:
        sink.close()
    assert result.ok, result
    # A reader in a directory of its own, built after the stage returned: it catches up before it answers.
    source = KafkaStagingSource(
        bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=tmp_path / "fresh"
    )
    try:
        [full] = source.fetch_full([result.staging_key])
        assert full.extras == experts
        assert full.generation_log_probs_delta == call.generation_log_probs_delta
        assert source.fetch_attachments(result.staging_key) == {"image": image, "empty": b""}
    finally:
        source.close()
    assert len(orjson.dumps(experts)) > 1_000_000
    assert not _dead_letters(tmp_path / "fresh")


def _raw_stage(
    event: StageEvent, blobs: dict[str, bytes]
) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    messages = encode_event_messages(event.with_blob_bytes(blobs), next_chunk_group=lambda: "poison:0")
    return [(message.key, message.value, list(message.headers)) for message in messages]


def _stage_event(rollout_id: str, call_id: str, image: bytes) -> tuple[StageEvent, dict[str, bytes]]:
    call = staged_call(rollout_id, call_id, [1, 2], [7, 8, 9])
    sha = hashlib.sha256(image).hexdigest()
    event = StageEvent(
        rollout_id=rollout_id,
        staging_key=f"{rollout_id}/{call_id}",
        model_call_id=call_id,
        row=call.model_dump(mode="json", exclude={"extras"}),
        attachments={"image": StagedBlob(sha256=sha, size=len(image))},
    )
    return event, {sha: image}


def test_poison_staging_events_are_dead_lettered_and_mask_their_rollout(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    good, good_blobs = _stage_event("conflict-r", "call-0", b"first")
    other, other_blobs = _stage_event("conflict-r", "call-0", b"second")
    damaged, damaged_blobs = _stage_event("damaged-r", "call-0", b"pixels")
    [(key, value, headers)] = _raw_stage(damaged, damaged_blobs)
    wrong_key, wrong_blobs = _stage_event("owner-r", "call-0", b"x")
    [(_, wrong_value, wrong_headers)] = _raw_stage(wrong_key, wrong_blobs)
    late, late_blobs = _stage_event("retired-r", "call-0", b"late")
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic)
    source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=store_dir)
    try:
        assert sink.stage(staged_call("retired-r", "call-1", [1], [2])).ok
        asyncio.run(source.retire(["retired-r"]))
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for raw_key, raw_value, raw_headers in [
            *_raw_stage(good, good_blobs),
            *_raw_stage(other, other_blobs),
            (key, value[:-1] + b"X", headers),
            (b"thief-r", wrong_value, wrong_headers),
            *_raw_stage(late, late_blobs),
        ]:
            producer.produce(staging_topic, key=raw_key, value=raw_value, headers=raw_headers)
        assert producer.flush(30) == 0
        assert source.materializer.wait_until_caught_up(60)
        store = TokenCaptureStore(store_dir)
        reasons = {line["rollout_id"]: line["reason"] for line in _dead_letters(store_dir)}
        assert set(reasons) == {"conflict-r", "damaged-r", "thief-r", "retired-r"}
        assert "SHA-256" in reasons["damaged-r"]
        assert "does not match the event's rollout" in reasons["thief-r"]
        assert "refused stage event" in reasons["conflict-r"]
        assert "retired" in reasons["retired-r"]
        for masked in ("conflict-r", "damaged-r", "thief-r"):
            assert store.read_state(masked).incomplete, masked
        # The first row of the conflicting key stands; nothing of the refused ones reached the store.
        [line] = store.read_staged_lines("conflict-r", ["conflict-r/call-0"])
        assert line is not None and orjson.loads(line)["attachments"]["image"]["size"] == len(b"first")
        assert store.read_staged_lines("damaged-r", ["damaged-r/call-0"]) == [None]
        assert not store.blob_path_for("retired-r", hashlib.sha256(b"late").hexdigest()).exists()
    finally:
        sink.close()
        asyncio.run(source.close())


async def _staged_run(bootstrap: str, topic: str, store_dir: Path) -> None:
    """Staged calls with blobs, ledger rows, a failure, a retired rollout and a repeat, on three partitions."""
    sink = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, chunk_bytes=4096)
    ledger = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    try:
        for index in range(6):
            rollout_id = f"staged-{index}"
            turns = conversation(rollout_id, 2, extras=True)
            assert sink.stage(turns[0].call, attachments={"img": bytes([index]) * 10_000}).ok
            assert sink.stage(turns[0].call, attachments={"img": bytes([index]) * 10_000}).ok
            assert sink.stage(turns[1].call).ok
            for turn in turns:
                await ledger.record(commit_for(turn))
            await ledger.record(commit_for(turns[0]))
            if index % 3 == 1:
                await ledger.record_failure(rollout_id, "call-2", "worker_capture_failed")
            if index % 3 == 2:
                await source.retire([rollout_id])
        assert source.materializer.wait_until_caught_up(60)
    finally:
        sink.close()
        await ledger.close()
        await source.close()


def test_replaying_a_topic_with_staging_events_gives_byte_identical_files_and_the_log_shows_them(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("staging-replay", partitions=3)
    live = tmp_path / "live"
    asyncio.run(_staged_run(kafka_bootstrap, topic, live))
    replayed = tmp_path / "replayed"
    replay_topic(kafka_bootstrap, topic, replayed)
    live_files = {name: data for name, data in directory_contents(live).items() if ".tokens." in name}
    replayed_files = {name: data for name, data in directory_contents(replayed).items() if ".tokens." in name}
    assert any(name.endswith(".staged") for name in live_files)
    assert any(".blobs/" in name for name in live_files)
    assert live_files == replayed_files
    shown = tokcap("log", "--bootstrap", kafka_bootstrap, "--topic", topic, "--rollout", "staged-1", "--json")
    assert shown.returncode == 0, shown.stderr
    entries = shown.json()["events"]
    details = [entry["detail"] for entry in entries]
    assert any("staged staged-1/call-0" in detail and "img 10000 B" in detail for detail in details), details
    assert any("ledger row for staged-1/call-1" in detail for detail in details), details
    assert any("ledger failure: worker_capture_failed" in detail for detail in details), details
    one = tmp_path / "one-rollout"
    completed = tokcap(
        "replay", "--bootstrap", kafka_bootstrap, "--topic", topic, "--dir", str(one), "--rollout", "staged-1"
    )
    assert completed.returncode == 0, completed.stderr
    mine = {
        name: data for name, data in directory_contents(one).items() if name.startswith("staged-1.tokens.")
    }
    assert mine == {name: data for name, data in live_files.items() if name.startswith("staged-1.tokens.")}


def test_a_worker_killed_the_instant_stage_returned_ok_leaves_every_acknowledged_row_fetchable_and_verifiable(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    repo = Path(__file__).resolve().parents[2]
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(repo / 'tests')!r})\n"
        "from staging_calls import conversation\n"
        "from transports.kafka.staging import KafkaStagingSink\n"
        "sink = KafkaStagingSink(bootstrap_servers=sys.argv[1], topic=sys.argv[2])\n"
        "for turn in conversation('killed', 40, extras=True):\n"
        "    assert sink.stage(turn.call, attachments={'a': turn.call.digest.encode() * 20_000}).ok\n"
        "    print(turn.call.model_call_id, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo)}
    worker = subprocess.Popen(
        [sys.executable, "-c", script, kafka_bootstrap, staging_topic], stdout=subprocess.PIPE, env=env
    )
    assert worker.stdout is not None
    acknowledged = [worker.stdout.readline().decode().strip() for _ in range(5)]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    worker.stdout.close()
    assert all(acknowledged), acknowledged
    turns = {turn.call.model_call_id: turn for turn in conversation("killed", 40, extras=True)}
    source = KafkaStagingSource(
        bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=tmp_path / "after"
    )
    try:
        keys = [f"killed/{call_id}" for call_id in acknowledged]
        assert [s.model_dump() for s in source.fetch_full(keys)] == [
            turns[c].call.model_dump() for c in acknowledged
        ]
        last = turns[acknowledged[-1]].call
        assert source.fetch_attachments(keys[-1]) == {"a": last.digest.encode() * 20_000}
        receipt = RolloutReceipt(
            rollout_id="killed",
            manifest=[commit_for(turns[call_id]).record for call_id in acknowledged],
            terminal_model_call_id=acknowledged[-1],
            terminal_selection="declared",
        )
        row = verify_and_linearize(receipt, source.fetch(keys))
        assert row.token_ids == cumulative_tokens(last)
    finally:
        source.close()


def _stage_root_from_another_process(bootstrap: str, topic: str, rollout_id: str) -> None:
    """Stage the root of ``conversation(rollout_id, 1)`` through a sink in a process of its own."""
    repo = Path(__file__).resolve().parents[2]
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(repo / 'tests')!r})\n"
        "from staging_calls import conversation\n"
        "from transports.kafka.staging import KafkaStagingSink\n"
        "sink = KafkaStagingSink(bootstrap_servers=sys.argv[1], topic=sys.argv[2])\n"
        "assert sink.stage(conversation(sys.argv[3], 1)[0].call).ok\n"
        "sink.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, "-c", script, bootstrap, topic, rollout_id], env=env, check=True)


def test_a_sink_with_a_store_dir_fails_a_conflicting_stage_from_another_process_and_a_late_stage_after_retire(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    _stage_root_from_another_process(kafka_bootstrap, staging_topic, "fenced")
    store_dir = tmp_path / "own"
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=store_dir)
    ledger = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=store_dir)
    try:
        [first] = conversation("fenced", 1)
        [different] = conversation("fenced", 1, extras=True)
        refused = sink.stage(different.call)
        assert not refused.ok and "different payload" in refused.error
        assert sink.stage(first.call).ok
        asyncio.run(ledger.record(commit_for(first)))
        assert asyncio.run(ledger.retire(["fenced"])) == {"removed": ["fenced"], "absent": []}
        late = sink.stage(staged_call("fenced", "call-late", [1], [2]))
        assert not late.ok and "retired" in late.error
        assert asyncio.run(ledger.manifest("fenced"))["records"] == []
        assert asyncio.run(ledger.delete(["fenced"])) == {"removed": ["fenced"], "absent": []}
        assert sink.stage(first.call).ok
    finally:
        sink.close()
        asyncio.run(ledger.close())


def test_without_a_store_dir_a_stage_the_store_drops_is_refused_at_its_ledger_record_and_masks_the_rollout(
    kafka_bootstrap: str, staging_topic: str, tmp_path: Path
) -> None:
    """The sink alone cannot see the verdict; the ledger row Gym writes after it does, before the commit."""
    _stage_root_from_another_process(kafka_bootstrap, staging_topic, "raced")
    store_dir = tmp_path / "trainer"
    sink = KafkaStagingSink(bootstrap_servers=kafka_bootstrap, topic=staging_topic)
    ledger = KafkaLineageResolver(bootstrap_servers=kafka_bootstrap, topic=staging_topic, store_dir=store_dir)
    try:
        [second] = conversation("raced", 1, extras=True)
        assert sink.stage(second.call).ok
        with pytest.raises(ConflictingEntryError, match="staged twice with different payloads"):
            asyncio.run(ledger.record(commit_for(second)))
        assert asyncio.run(ledger.manifest("raced"))["records"] == []
        state = TokenCaptureStore(store_dir).read_state("raced")
        assert [mark.model_call_id for mark in state.incomplete_marks] == [second.call.model_call_id] * 2

        [kept] = conversation("fenced-late", 1)
        assert sink.stage(kept.call).ok
        asyncio.run(ledger.record(commit_for(kept)))
        assert asyncio.run(ledger.retire(["fenced-late"])) == {"removed": ["fenced-late"], "absent": []}
        [late] = conversation("fenced-late", 2)[1:]
        assert sink.stage(late.call).ok
        with pytest.raises(RolloutRetiredError, match="fence refused"):
            asyncio.run(ledger.record(commit_for(late)))
    finally:
        sink.close()
        asyncio.run(ledger.close())


def test_the_staging_benchmark_measures_kafka_staging_beside_the_raw_producer_floor(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import main

    argv = ["--only", "staging", "--staging-calls", "2", "--staging-images", "1", "--staging-threads", "2"]
    argv += ["--trials", "1", "--bootstrap", kafka_bootstrap]
    assert main([*argv, "--dir", str(tmp_path / "work"), "--output", str(tmp_path / "latest.json")]) == 0
    out = capsys.readouterr().out
    assert (
        out.count("tokcap KafkaStagingSink |") == 2
        and out.count("Kafka floor (confluent-kafka acks=all)") == 2
    )
    assert "not measured" not in out
    ledger_rows = [line.split("|") for line in out.splitlines() if "+ Kafka ledger thread |" in line]
    assert len(ledger_rows) == 2
    for cells in ledger_rows:
        record, floor = cells[-3].strip(), cells[-2].strip()
        assert record and floor, cells
