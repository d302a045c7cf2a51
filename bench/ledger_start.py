"""How long a Kafka ledger takes to start on a topic full of staged calls, and what it keeps on disk.

A model server's ledger built from the shared block (no ``store_dir``) projects the run topic into a directory
of its own at start. Its projection is ledger-only: staged calls are passed over by their type header, never
decoded or written. This scenario stages the same calls, with large attachments, and their ledger rows on two
topics: one made now, whose staged bytes lie on its staged-payload topic (``apart``), and one laid out as a topic
made before payload topics, stages inline (``inline``); a third topic holds the ledger rows alone. Then it
times, variant by variant (taking turns):

- ``ledger_apart``: ``KafkaLineageResolver`` without ``store_dir`` on the ``apart`` topic, from construction to
  its first ``manifest`` answer (which waits until the projection holds the whole partition);
- ``ledger_inline``: the same on the ``inline`` topic;
- ``rows_only``: the same on the topic of ledger rows alone: the start without any staged call;
- ``whole_apart``: ``KafkaCaptureLedger`` with a ``store_dir``, a whole projection of the ``apart`` topic, each
  stage restored from its payload;
- ``whole_inline`` (the anchor): the same on the ``inline`` topic;
- ``read_floor``: a bare consumer reading the ``inline`` topic from its start to its end, nothing decoded: the
  bytes every reader of a topic with stages inline must fetch.

Figures: ``start_s``, ``cpu_s`` (this process's CPU over the start, every thread) and ``dir_mb`` (what the
projection's directory holds once started).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import Progress, Trials, alternate

__all__ = ["LedgerStartShape", "run_ledger_start"]

CALLS_PER_ROLLOUT = 10


class LedgerStartShape:
    """The topic: ``calls`` staged calls of ``CALLS_PER_ROLLOUT`` per rollout, each with an attachment."""

    def __init__(
        self, calls: int, attachment_bytes: int, prompt_tokens: int = 200, generated_tokens: int = 100
    ):
        self.calls = calls
        self.attachment_bytes = attachment_bytes
        self.prompt_tokens = prompt_tokens
        self.generated_tokens = generated_tokens

    def describe(self) -> str:
        return (
            f"{self.calls:,} staged calls ({self.calls // CALLS_PER_ROLLOUT:,} rollouts x {CALLS_PER_ROLLOUT}), "
            f"{self.attachment_bytes // 1024:,} KiB attachment + {self.prompt_tokens + self.generated_tokens} "
            "tokens each, and their ledger rows"
        )


def _bytes_under(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _calls(shape: LedgerStartShape) -> list[tuple[Any, Any]]:
    """Every staged record with its ledger commit, rollout by rollout."""
    from tokcap.staging.example_calls import ExampleCall, commit_of, staged_record

    out: list[tuple[Any, Any]] = []
    for number in range(shape.calls // CALLS_PER_ROLLOUT):
        rollout_id = f"start-{number}"
        parent: ExampleCall | None = None
        chain: list[str] = []
        request: list[dict[str, Any]] = []
        for turn in range(CALLS_PER_ROLLOUT):
            prompt = [(number + turn + offset) % 50_000 for offset in range(shape.prompt_tokens)]
            generated = [(number * 7 + turn + offset) % 50_000 for offset in range(shape.generated_tokens)]
            record, tokens = staged_record(rollout_id, f"call-{turn}", prompt, generated, parent)
            request = [*request, {"role": "user", "content": f"{rollout_id} question {turn}"}]
            call = ExampleCall(record, tokens, request, f"{rollout_id} answer {turn}")
            out.append((record, commit_of(call, chain)))
            chain = [*chain, call.key]
            request = [*request, *call.response]
            parent = call
    return out


def _fill(bootstrap: str, topic: str, calls: list[tuple[Any, Any]], attachment: bytes | None) -> None:
    """Stage every call (unless ``attachment`` is ``None``), then publish every ledger row, acks=all."""
    from confluent_kafka import Producer

    from tokcap.ledger import ledger_event
    from transports.kafka.staging import KafkaStagingSink
    from transports.kafka.wire.codec import encode_event_messages

    if attachment is not None:
        sink = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, delivery_timeout_s=120)
        try:
            with ThreadPoolExecutor(16) as pool:
                results = list(
                    pool.map(lambda pair: _stage(sink, pair[1][0], pair[0], attachment), enumerate(calls))
                )
        finally:
            sink.close()
        failed = [result.error for result in results if not result.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} stages failed, the first: {failed[0]}")
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    errors: list[str] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            errors.append(str(error))

    for _, commit in calls:
        for message in encode_event_messages(ledger_event(commit), next_chunk_group=lambda: uuid.uuid4().hex):
            while True:
                try:
                    producer.produce(
                        topic,
                        message.value,
                        message.key,
                        headers=list(message.headers),
                        on_delivery=delivered,
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
    producer.flush(120)
    if errors:
        raise RuntimeError(f"{len(errors)} ledger rows were not delivered, the first: {errors[0]}")


def _stage(sink: Any, record: Any, number: int, attachment: bytes) -> Any:
    """Stage one call with an attachment of its own (distinct bytes: the store keeps one file per content)."""
    return sink.stage(record, attachments={"image": number.to_bytes(8, "big") + attachment[8:]})


async def _ledger_only(bootstrap: str, topic: str, last_rollout: str, trial_dir: Path) -> dict[str, float]:
    from tokcap.files.private_dirs import private_directories
    from transports.kafka.lineage import KafkaLineageResolver

    os.environ["TOKCAP_PRIVATE_DIR"] = str(trial_dir / "private")
    before = set(private_directories.held())
    started, cpu = time.perf_counter(), time.process_time()
    ledger = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic, timeout_s=600)
    try:
        manifest = await ledger.manifest(last_rollout)
        start_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        if len(manifest["records"]) != CALLS_PER_ROLLOUT:
            raise RuntimeError(f"the ledger answered {len(manifest['records'])} rows for {last_rollout}")
        (directory,) = set(private_directories.held()) - before
        size = _bytes_under(directory)
    finally:
        await ledger.close()
    return {"start_s": start_s, "cpu_s": cpu_s, "dir_mb": size / 1e6}


async def _whole(bootstrap: str, topic: str, last_rollout: str, trial_dir: Path) -> dict[str, float]:
    from transports.kafka.staging import KafkaCaptureLedger

    store_dir = trial_dir / "projection"
    started, cpu = time.perf_counter(), time.process_time()
    ledger = KafkaCaptureLedger(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir, timeout_s=600)
    try:
        manifest = await ledger.manifest(last_rollout)
        start_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        if len(manifest["records"]) != CALLS_PER_ROLLOUT:
            raise RuntimeError(f"the ledger answered {len(manifest['records'])} rows for {last_rollout}")
        size = _bytes_under(store_dir)
    finally:
        await ledger.close()
    return {"start_s": start_s, "cpu_s": cpu_s, "dir_mb": size / 1e6}


def _read_floor(bootstrap: str, topic: str) -> dict[str, float]:
    from confluent_kafka import Consumer, TopicPartition

    started, cpu = time.perf_counter(), time.process_time()
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"floor-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    try:
        _, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        consumer.assign([TopicPartition(topic, 0, 0)])
        read = 0
        while read < end:
            for message in consumer.consume(1000, 0.1):
                if message.error() is None:
                    read = int(message.offset() or 0) + 1
    finally:
        consumer.close()
    return {"start_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, "dir_mb": 0.0}


def run_ledger_start(
    bootstrap: str, shape: LedgerStartShape, trials: int, work_dir: Path, progress: Progress
) -> dict[str, Any]:
    """Fill the two topics once, then time each variant's start, taking turns."""
    from bench.staging import _delete_topic, _fresh_topic

    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    apart_topic = _fresh_topic(bootstrap, f"tokcap.bench-ledger-apart-{stamp}")
    inline_topic = _fresh_topic(bootstrap, f"tokcap.bench-ledger-inline-{stamp}", staged_payloads_apart=False)
    rows_topic = _fresh_topic(bootstrap, f"tokcap.bench-ledger-rows-{stamp}")
    saved_root = os.environ.get("TOKCAP_PRIVATE_DIR")
    try:
        calls = _calls(shape)
        last_rollout = calls[-1][0].rollout_id
        progress(f"ledger start: staging {shape.describe()}")
        filled = time.perf_counter()
        attachment = os.urandom(shape.attachment_bytes)
        _fill(bootstrap, apart_topic, calls, attachment)
        _fill(bootstrap, inline_topic, calls, attachment)
        _fill(bootstrap, rows_topic, calls, None)
        progress(f"ledger start: topics filled in {time.perf_counter() - filled:.1f} s")
        topic_mb = _topic_bytes(bootstrap, inline_topic) / 1e6
        apart_mb = _topic_bytes(bootstrap, apart_topic) / 1e6

        variants = {
            "ledger_apart": lambda directory: _ledger_only(bootstrap, apart_topic, last_rollout, directory),
            "ledger_inline": lambda directory: _ledger_only(bootstrap, inline_topic, last_rollout, directory),
            "rows_only": lambda directory: _ledger_only(bootstrap, rows_topic, last_rollout, directory),
            "whole_apart": lambda directory: _whole(bootstrap, apart_topic, last_rollout, directory),
            "whole_inline": lambda directory: _whole(bootstrap, inline_topic, last_rollout, directory),
            "read_floor": lambda directory: asyncio.to_thread(_read_floor, bootstrap, inline_topic),
        }
        result: Trials = asyncio.run(
            alternate(
                variants, trials, work_dir, lambda line: progress(f"ledger start: {line}"), shown=_SHOWN
            )
        )
    finally:
        if saved_root is None:
            os.environ.pop("TOKCAP_PRIVATE_DIR", None)
        else:
            os.environ["TOKCAP_PRIVATE_DIR"] = saved_root
        for topic in (apart_topic, f"tokcap-staged.{apart_topic}", inline_topic, rows_topic):
            threading.Thread(target=_delete_topic, args=(bootstrap, topic), daemon=True).start()
    print(result.table(_SHOWN, "whole_inline"), flush=True)
    print(
        f"run topic: {topic_mb:,.1f} MB with stages inline, {apart_mb:,.1f} MB with payloads apart",
        flush=True,
    )
    return {
        "shape": shape.describe(),
        "topic_mb": topic_mb,
        "apart_topic_mb": apart_mb,
        **result.result("whole_inline"),
    }


_SHOWN = ("start_s", "cpu_s", "dir_mb")


def _topic_bytes(bootstrap: str, topic: str) -> int:
    """The bytes of the topic's messages (keys and values), read back once."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"size-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    total = 0
    try:
        _, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        consumer.assign([TopicPartition(topic, 0, 0)])
        read = 0
        while read < end:
            for message in consumer.consume(1000, 0.1):
                if message.error() is None:
                    total += len(message.key() or b"") + len(message.value() or b"")
                    read = int(message.offset() or 0) + 1
    finally:
        consumer.close()
    return total
