"""Engine-side staging from 16 threads, beside the floors it is read against, in one run.

    python -m bench --only staging [--dir /var/tmp] [--straw DIR] [--bootstrap HOST:PORT]

Two shapes of ``stage()``: a 1,024-token delta (24 prompt, 1,000 generated) whose extras carry the routed
experts of a 48-layer top-8 MoE in Gym's ``nrlre1`` envelope (int16, 1,024 x 48 x 8, about 1 MB), and a
64-token delta with a 4 MiB image attachment. Each call is its own rollout's root, staged once. Beside them:

- the file floor: the same bytes (the staged row's JSON line and each blob) written to new files and
  fsynced, from the same number of threads;
- straw-queue 0.1.6's ``SharedFilesystemStore.publish`` of the same bytes as one record set per call, only
  with ``--straw DIR`` (installed there by ``pip install --no-deps --target DIR straw-queue==0.1.6 numpy``
  when missing; never a dependency of tokcap);
- tokcap again with one more thread recording each staged call's commit in the file ledger while the stagers
  run (the ledger's ``record`` latency under that load), and beside it one more thread doing the ledger floor
  for each call: the bytes a durable record needs on disk, written and synced file by file with nothing around
  them (the row's line appended to a new file and fsynced, the directory fsynced, a state-sized file written,
  fsynced and renamed, the directory fsynced again);
- tokcap once more with the ledger in a process of its own, as Gym runs it (the inference worker stages,
  Gym's model server records), recording each staged call's commit and then doing its floor while the
  stagers run: the ledger's latency without the stagers' interpreter lock;
- the time ``FileStagingSource.fetch`` takes for a 64-call chain.

With ``--bootstrap``, Kafka staging too: ``KafkaStagingSink.stage`` into a fresh run topic, beside the Kafka
floor (the same bytes produced raw with confluent-kafka, ``acks=all``, in messages under the broker's default
1 MiB limit, each call waited for); Kafka rows are read against that floor. Without it the table says why.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.harness import Trials, Variant, alternate
from bench.stats import median, percentile
from tokcap.files.durable_io import fsync_directory
from tokcap.fingerprint import FINGERPRINT_VERSION
from tokcap.ledger import ledger_event
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource
from tokcap.staging.digest import (
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from tokcap.staging.records import CallRecord, CaptureLedgerCommit, StagedCallRecord, staging_key

__all__ = [
    "KAFKA_FLOOR_CHUNK",
    "LEDGER_FLOOR_STATE",
    "Measured",
    "StagedCall",
    "image_calls",
    "ledger_floor",
    "run_staging",
    "staging_figures",
    "moe_calls",
    "run_kafka",
    "run_kafka_floor",
]

LAYERS, TOP_K, MIB = 48, 8, 1 << 20

LEDGER_FLOOR_STATE = b"s" * 700
"""The state the ledger floor writes: about the size of a one-call rollout's state after its ledger row."""


@dataclass(frozen=True)
class StagedCall:
    """One call to stage: the record, its attachments, and the bytes a raw writer would write for it."""

    record: StagedCallRecord
    attachments: dict[str, bytes]
    raw: tuple[bytes, ...]

    @property
    def size(self) -> int:
        """The bytes one stage makes durable."""
        return sum(map(len, self.raw))


def _record(
    rollout_id: str,
    call_id: str,
    ids: list[int],
    mask: list[float],
    log_probs: list[float],
    *,
    parent: StagedCallRecord | None = None,
    prefix: Sequence[int] = (),
    extras: dict[str, Any] | None = None,
) -> StagedCallRecord:
    prev_len = 0 if parent is None else parent.cum_len
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "parent_call_id": None if parent is None else parent.model_call_id,
        "mode": "text" if parent is None else "token_in",
        "prev_len": prev_len,
        "delta_len": len(ids),
        "cum_len": prev_len + len(ids),
        "weight_version": 1,
        "token_ids_delta": ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": log_probs,
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": compute_chain_hash(None if parent is None else parent.chain_hash, ids),
        "cumulative_hash": hash_token_ids([*prefix, *ids]),
    }
    digest = compute_staging_digest(schema_version=2, digest_version=2, extras_digest_version=1, **fields)
    return StagedCallRecord(**fields, digest=digest, extras=extras)


def _columns(seed: int, prompt: int, generated: int) -> tuple[list[int], list[float], list[float]]:
    ids = [(seed * 7919 + index * 104729) % 151_000 for index in range(prompt + generated)]
    mask = [0.0] * prompt + [1.0] * generated
    log_probs = [0.0] * prompt + [-((seed + index) % 97 + 1) / 7.0 - 1e-12 for index in range(generated)]
    return ids, mask, log_probs


def _with_raw(record: StagedCallRecord, attachments: dict[str, bytes]) -> StagedCall:
    row = orjson.dumps(record.model_dump(mode="json", exclude={"extras"})) + b"\n"
    blobs = [] if record.extras is None else [orjson.dumps(record.extras)]
    return StagedCall(record, attachments, (row, *blobs, *attachments.values()))


def moe_calls(count: int, run: str) -> list[StagedCall]:
    """1,024-token deltas with routed experts of a 48-layer top-8 MoE as an ``nrlre1`` int16 envelope."""
    out = []
    for number in range(count):
        ids, mask, log_probs = _columns(number, 24, 1000)
        routes = os.urandom(len(ids) * LAYERS * TOP_K * 2)
        envelope = f"nrlre1:int16:{len(ids)}x{LAYERS}x{TOP_K}:{base64.b64encode(routes).decode()}"
        record = _record(
            f"{run}-moe{number}", "c0", ids, mask, log_probs, extras={"routed_experts": envelope}
        )
        out.append(_with_raw(record, {}))
    return out


def image_calls(count: int, run: str) -> list[StagedCall]:
    """64-token deltas, each with one 4 MiB image attachment."""
    out = []
    for number in range(count):
        ids, mask, log_probs = _columns(number, 32, 32)
        record = _record(f"{run}-img{number}", "c0", ids, mask, log_probs)
        out.append(_with_raw(record, {"image": os.urandom(4 * MIB)}))
    return out


def _commit(record: StagedCallRecord) -> CaptureLedgerCommit:
    key = staging_key(record.rollout_id, record.model_call_id)
    row = CallRecord(
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        staging_key=key,
        mode=record.mode,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
        response_id=f"resp-{record.model_call_id}",
        fingerprint_version=FINGERPRINT_VERSION,
    )
    return CaptureLedgerCommit(
        rollout_id=record.rollout_id,
        record=row,
        staging_chain=(key,),
        request_items=[{"role": "user", "content": record.rollout_id}],
        response_items=[{"role": "assistant", "content": record.model_call_id}],
    )


@dataclass(frozen=True)
class Measured:
    """One writer over one shape: throughput and per-call latency."""

    name: str
    shape: str
    calls: int
    seconds: float
    size: int
    latencies: tuple[float, ...]
    cpu_seconds: float
    ledger: tuple[float, ...] = ()
    ledger_floor: tuple[float, ...] = ()
    ledger_append_floor: tuple[float, ...] = ()

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.size / self.seconds / 1e6


def _threaded(
    calls: Sequence[StagedCall], threads: int, one: Callable[[StagedCall], None]
) -> tuple[float, list[float], float]:
    """Run ``one`` over every call from ``threads`` threads; return the wall time, each latency and the CPU time."""
    pending: queue.SimpleQueue[StagedCall | None] = queue.SimpleQueue()
    for call in calls:
        pending.put(call)
    for _ in range(threads):
        pending.put(None)
    latencies: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        while (call := pending.get()) is not None:
            started = time.perf_counter()
            try:
                one(call)
            except BaseException as exc:  # reported by the main thread after the join
                errors.append(exc)
                return
            latencies.append(time.perf_counter() - started)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    cpu = time.process_time()
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    if errors:
        raise errors[0]
    return seconds, latencies, cpu


def ledger_floor(directory: Path, name: str, line: bytes, state: bytes) -> tuple[float, float]:
    """The disk work of one durable ledger record with nothing around it; return (append done, all done).

    The row's ``line`` is appended to a new file and fsynced, and the directory fsynced (the file is new);
    ``state`` is written to a temporary file, fsynced, renamed over the state and the directory fsynced.
    """
    started = time.perf_counter()
    fd = os.open(directory / f"{name}.ledger", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    appended = time.perf_counter() - started
    fsync_directory(directory)
    temporary = directory / f"{name}.state.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, state)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, directory / f"{name}.state")
    fsync_directory(directory)
    return appended, time.perf_counter() - started


def _ledger_process(root: str, inbox: Any, outbox: Any, stop: Any) -> None:
    """A model server's ledger in a process of its own: record each staged call's commit, then do its floor.

    Runs until ``stop`` is set, so every latency it reports was measured while the stagers ran; records still
    queued then are left. Reports ``(record latencies, [(floor append, floor total)])`` on ``outbox``.
    """
    ledger = FileLineageResolver(root)
    floor_directory = Path(root) / "ledger-floor-process"
    floor_directory.mkdir()
    recorded: list[float] = []
    floors: list[tuple[float, float]] = []
    loop = asyncio.new_event_loop()
    outbox.put("ready")
    try:
        while not stop.is_set():
            try:
                fields = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            commit = _commit(StagedCallRecord.model_construct(**fields))
            started = time.perf_counter()
            loop.run_until_complete(ledger.record(commit))
            recorded.append(time.perf_counter() - started)
            line = ledger_event(commit).stored_line
            floors.append(ledger_floor(floor_directory, commit.rollout_id, line, LEDGER_FLOOR_STATE))
    finally:
        loop.close()
        outbox.put((recorded, floors))


def run_tokcap_ledger_process(root: Path, shape: str, calls: Sequence[StagedCall], threads: int) -> Measured:
    """``FileStagingSink.stage`` from ``threads`` threads while the ledger runs in a process of its own.

    That is how Gym deploys them: the inference worker stages, Gym's model server records. The ledger
    process records each staged call's commit and then does the ledger floor for it, one after the other,
    so both see the same disk load and neither waits for the stagers' interpreter lock.
    """
    context = multiprocessing.get_context("spawn")
    inbox, outbox, stop = context.Queue(), context.Queue(), context.Event()
    process = context.Process(target=_ledger_process, args=(str(root), inbox, outbox, stop))
    process.start()
    try:
        if outbox.get(timeout=120) != "ready":
            raise RuntimeError("the ledger process did not start")
        sink = FileStagingSink(root)

        def one(call: StagedCall) -> None:
            result = sink.stage(call.record, attachments=call.attachments or None)
            if not result.ok:
                raise RuntimeError(f"stage failed: {result.error}")
            inbox.put(call.record.model_dump(exclude={"extras"}) | {"extras": None})

        try:
            seconds, latencies, cpu = _threaded(calls, threads, one)
        finally:
            stop.set()
        recorded, floors = outbox.get(timeout=120)
    finally:
        inbox.cancel_join_thread()  # records the ledger left are never read: do not wait to flush them at exit
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
    return Measured(
        "tokcap FileStagingSink + ledger process",
        shape,
        len(calls),
        seconds,
        sum(c.size for c in calls),
        tuple(latencies),
        cpu,
        tuple(recorded),
        tuple(total for _, total in floors),
        tuple(appended for appended, _ in floors),
    )


@dataclass
class _StagedRun:
    """What staging beside a ledger measured: the stagers' wall time, latencies and CPU, each ledger record's
    latency and each floor result."""

    seconds: float
    latencies: list[float]
    cpu: float
    recorded: list[float]
    floors: list[Any]

    def measured(
        self,
        name: str,
        shape: str,
        calls: Sequence[StagedCall],
        ledger_floor: Sequence[float],
        ledger_append_floor: Sequence[float] = (),
    ) -> Measured:
        """The run as a table row: ``calls`` staged under ``name`` over ``shape``."""
        return Measured(
            name,
            shape,
            len(calls),
            self.seconds,
            sum(c.size for c in calls),
            tuple(self.latencies),
            self.cpu,
            tuple(self.recorded),
            tuple(ledger_floor),
            tuple(ledger_append_floor),
        )


def _stage_beside_ledger(
    sink: Any,
    calls: Sequence[StagedCall],
    threads: int,
    *,
    record: Callable[[CaptureLedgerCommit], Awaitable[None]] | None = None,
    floor: Callable[[StagedCallRecord], Any] | None = None,
    warm_up: Callable[[], Awaitable[object]] | None = None,
) -> _StagedRun:
    """Stage every call from ``threads`` threads; each staged call's commit then goes to ``record`` (timed, in a
    thread with its own event loop, after ``warm_up``) and its record to ``floor``, in one more thread each."""
    staged: queue.SimpleQueue[StagedCallRecord | None] = queue.SimpleQueue()
    floor_queue: queue.SimpleQueue[StagedCallRecord | None] = queue.SimpleQueue()
    recorded: list[float] = []
    floors: list[Any] = []
    warm = threading.Event()

    def record_commits() -> None:
        loop = asyncio.new_event_loop()
        try:
            if warm_up is not None:
                loop.run_until_complete(warm_up())
            warm.set()
            while (staged_record := staged.get()) is not None:
                assert record is not None
                commit = _commit(staged_record)
                started = time.perf_counter()
                loop.run_until_complete(record(commit))
                recorded.append(time.perf_counter() - started)
        finally:
            warm.set()
            loop.close()

    def floor_commits() -> None:
        while (staged_record := floor_queue.get()) is not None:
            assert floor is not None
            floors.append(floor(staged_record))

    def one(call: StagedCall) -> None:
        result = sink.stage(call.record, attachments=call.attachments or None)
        if not result.ok:
            raise RuntimeError(f"stage failed: {result.error}")
        if record is not None:
            staged.put(call.record)
        if floor is not None:
            floor_queue.put(call.record)

    recorder = threading.Thread(target=record_commits)
    floorer = threading.Thread(target=floor_commits)
    recorder.start()
    floorer.start()
    try:
        warm.wait(120)
        seconds, latencies, cpu = _threaded(calls, threads, one)
    finally:
        staged.put(None)
        floor_queue.put(None)
        recorder.join()
        floorer.join()
    return _StagedRun(seconds, latencies, cpu, recorded, floors)


def run_tokcap(
    root: Path, shape: str, calls: Sequence[StagedCall], threads: int, *, with_ledger: bool = False
) -> Measured:
    """``FileStagingSink.stage`` from ``threads`` threads; ``with_ledger``: one more thread records each commit.

    Without the ledger thread the run does what the floor and straw-queue do; with it, it is the load the
    ledger's latency is measured under, and one more thread does the ledger floor (``ledger_floor``) for
    each staged call in a directory of its own on the same filesystem, under the same load. Both threads
    share the stagers' interpreter lock; ``run_tokcap_ledger_process`` measures the ledger without it.
    """
    sink = FileStagingSink(root)
    floor_directory = root / "ledger-floor"
    floor_directory.mkdir()

    def floor(record: StagedCallRecord) -> tuple[float, float]:
        line = ledger_event(_commit(record)).stored_line
        return ledger_floor(floor_directory, record.rollout_id, line, LEDGER_FLOOR_STATE)

    run = _stage_beside_ledger(
        sink,
        calls,
        threads,
        record=FileLineageResolver(root).record if with_ledger else None,
        floor=floor if with_ledger else None,
    )
    return run.measured(
        "tokcap FileStagingSink" + (" + ledger thread" if with_ledger else ""),
        shape,
        calls,
        [total for _, total in run.floors],
        [appended for appended, _ in run.floors],
    )


def run_floor(root: Path, shape: str, calls: Sequence[StagedCall], threads: int) -> Measured:
    """The same bytes written to new files and fsynced, one file per row or blob, from the same threads."""
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def one(call: StagedCall) -> None:
        for data in call.raw:
            with lock:
                name = root / f"f{next(counter)}"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    seconds, latencies, cpu = _threaded(calls, threads, one)
    return Measured(
        "file floor (write + fsync)",
        shape,
        len(calls),
        seconds,
        sum(c.size for c in calls),
        tuple(latencies),
        cpu,
    )


def straw_module(target: Path) -> Any:
    """straw-queue 0.1.6 from ``target``, installed there (without its torch dependency) when missing."""
    if not (target / "straw" / "store.py").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(target),
                "straw-queue==0.1.6",
                "numpy",
            ],
            check=True,
        )
    sys.path.insert(0, str(target))
    from straw import protocol, store  # type: ignore[import-not-found]

    return store, protocol


def run_straw(root: Path, shape: str, calls: Sequence[StagedCall], threads: int, target: Path) -> Measured:
    """``SharedFilesystemStore.publish`` of each call's bytes as one record set, one store per thread."""
    store_module, protocol = straw_module(target)
    local = threading.local()
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def one(call: StagedCall) -> None:
        store = getattr(local, "store", None)
        if store is None:
            store = local.store = store_module.SharedFilesystemStore(str(root), "bench")
        with lock:
            number = next(counter)
        records = [protocol.Record(f"{number}:{index}", data) for index, data in enumerate(call.raw)]
        store.publish(records, submission_id=f"s{number}")

    seconds, latencies, cpu = _threaded(calls, threads, one)
    return Measured(
        "straw-queue 0.1.6 publish",
        shape,
        len(calls),
        seconds,
        sum(c.size for c in calls),
        tuple(latencies),
        cpu,
    )


def chain_fetch(root: Path, run: str, calls: int = 64, samples: int = 20) -> list[float]:
    """Stage one rollout of ``calls`` chained calls (32 new tokens each), then time fetching the whole chain."""
    sink = FileStagingSink(root)
    parent: StagedCallRecord | None = None
    prefix: list[int] = []
    keys = []
    for number in range(calls):
        ids, mask, log_probs = _columns(number, 16, 16)
        record = _record(f"{run}-chain", f"c{number}", ids, mask, log_probs, parent=parent, prefix=prefix)
        if not sink.stage(record).ok:
            raise RuntimeError("staging the chain failed")
        prefix += ids
        parent = record
        keys.append(staging_key(record.rollout_id, record.model_call_id))
    out = []
    for _ in range(samples):
        source = FileStagingSource(root)
        started = time.perf_counter()
        rows = source.fetch(keys)
        out.append(time.perf_counter() - started)
        assert len(rows) == calls
    return out


KAFKA_FLOOR_CHUNK = 900_000
"""Bytes per raw message of the Kafka floor: under a broker's default 1 MiB limit, as tokcap's chunks are."""


def _kafka_gap(bootstrap: str | None) -> str | None:
    """Why Kafka staging is not measured, or ``None`` when it can be."""
    if importlib.util.find_spec("transports.kafka.staging") is None:
        return "not measured: transports.kafka.staging is not in this tree"
    if bootstrap is None:
        return "not measured: no --bootstrap"
    return None


def _fresh_topic(bootstrap: str, name: str, *, staged_payloads_apart: bool = True) -> str:
    from transports.kafka import ensure_topic

    ensure_topic(bootstrap, name, staged_payloads_apart=staged_payloads_apart)
    return name


def _delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic], operation_timeout=30)[topic].result(timeout=60)


def run_kafka(
    bootstrap: str, shape: str, calls: Sequence[StagedCall], threads: int, *, with_ledger: bool = False
) -> Measured:
    """``KafkaStagingSink.stage`` from ``threads`` threads into a fresh run topic (acks=all, chunked blobs).

    ``with_ledger``: one more thread records each staged call's commit through a ``KafkaLineageResolver``
    (its own projection, as a model server runs it), and one more produces the same ledger line raw with
    confluent-kafka (acks=all, waited for) to a topic of its own: the ledger's floor under the same load.
    """
    from confluent_kafka import Producer

    from transports.kafka.lineage import KafkaLineageResolver
    from transports.kafka.staging import KafkaStagingSink

    topic = _fresh_topic(bootstrap, f"tokcap.bench-staging-{os.getpid()}-{time.monotonic_ns()}")
    floor_topic = _fresh_topic(bootstrap, f"tokcap.bench-ledger-floor-{os.getpid()}-{time.monotonic_ns()}")
    sink = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, delivery_timeout_s=60)
    projection = Path(tempfile.mkdtemp(prefix="ledger-projection-"))
    ledger = (
        KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic, store_dir=projection, timeout_s=120)
        if with_ledger
        else None
    )
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})

    async def warm_up() -> None:
        # The projection joins the topic and reads every partition before the clock starts: a model server's
        # runs all the time. Rollout ids spread over the partitions by their hash.
        assert ledger is not None
        for number in range(64):
            await ledger.has_rows(f"bench-warm-up-{number}")

    def floor(record: StagedCallRecord) -> float:
        failures: list[Any] = []
        started = time.perf_counter()
        producer.produce(
            floor_topic,
            value=ledger_event(_commit(record)).stored_line,
            key=record.rollout_id.encode(),
            on_delivery=lambda error, _message: failures.append(error),
        )
        while not failures:
            producer.poll(0.001)
        if failures[0] is not None:
            raise RuntimeError(f"raw ledger produce failed: {failures[0]}")
        return time.perf_counter() - started

    try:
        run = _stage_beside_ledger(
            sink,
            calls,
            threads,
            record=None if ledger is None else ledger.record,
            floor=floor if with_ledger else None,
            warm_up=None if ledger is None else warm_up,
        )
    finally:
        sink.close()
        if ledger is not None:
            asyncio.run(ledger.close())
        producer.flush(30)
        shutil.rmtree(projection, ignore_errors=True)
        _delete_topic(bootstrap, topic)
        _delete_topic(bootstrap, floor_topic)
    return run.measured(
        "tokcap KafkaStagingSink" + (" + Kafka ledger thread" if with_ledger else ""),
        shape,
        calls,
        run.floors,
    )


def run_kafka_floor(bootstrap: str, shape: str, calls: Sequence[StagedCall], threads: int) -> Measured:
    """The same bytes produced raw with confluent-kafka (acks=all, idempotent), waited for per call."""
    from confluent_kafka import Producer

    topic = _fresh_topic(bootstrap, f"tokcap.bench-floor-{os.getpid()}-{time.monotonic_ns()}")
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 1}
    )
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            producer.poll(0.05)

    poller = threading.Thread(target=poll)
    poller.start()

    def one(call: StagedCall) -> None:
        done = threading.Semaphore(0)
        failures: list[Any] = []
        parts = [
            data[start : start + KAFKA_FLOOR_CHUNK]
            for data in call.raw
            for start in range(0, max(len(data), 1), KAFKA_FLOOR_CHUNK)
        ]

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                failures.append(error)
            done.release()

        key = call.record.rollout_id.encode()
        for part in parts:
            producer.produce(topic, value=part, key=key, on_delivery=delivered)
        for _ in parts:
            done.acquire()
        if failures:
            raise RuntimeError(f"raw produce failed: {failures[0]}")

    try:
        seconds, latencies, cpu = _threaded(calls, threads, one)
    finally:
        stop.set()
        poller.join()
        producer.flush(30)
        _delete_topic(bootstrap, topic)
    size = sum(c.size for c in calls)
    return Measured(
        "Kafka floor (confluent-kafka acks=all)", shape, len(calls), seconds, size, tuple(latencies), cpu
    )


_SHAPES = {"moe": "moe 1k tokens + nrlre1", "image": "4 MiB image"}
"""Short keys of the two shapes, as the results and the targets name them."""


def _measured_figures(measured: Measured) -> dict[str, float]:
    figures = {
        "calls_per_s": measured.calls_per_s,
        "mb_per_s": measured.mb_per_s,
        "p50_ms": median(measured.latencies) * 1e3,
        "p99_ms": percentile(measured.latencies, 0.99) * 1e3,
        "cpu_ms_per_call": measured.cpu_seconds / measured.calls * 1e3,
    }
    for name, latencies in (("ledger", measured.ledger), ("ledger_floor", measured.ledger_floor)):
        if latencies:
            figures[f"{name}_p50_ms"] = median(latencies) * 1e3
            figures[f"{name}_p99_ms"] = percentile(latencies, 0.99) * 1e3
    return figures


def _no_directory(writer: Callable[[], Measured]) -> Callable[[Path], Measured]:
    return lambda _directory: writer()


def _say(prefix: str, line: str) -> None:
    print(prefix, line, flush=True)


def run_staging(
    work: Path,
    *,
    calls: int,
    images: int,
    threads: int,
    straw: Path | None,
    bootstrap: str | None = None,
    trials: int = 1,
) -> tuple[dict[str, Trials], list[Measured], list[float]]:
    """Every writer over both shapes, taking turns ``trials`` times (``bench.harness``), then the chain fetch.

    Returns each shape's trials (figures per writer), every writer's measurement in the order they ran, and
    the chain fetch's latencies.
    """
    run = f"b{os.getpid()}"
    staged_by_shape = {"moe": moe_calls(calls, run), "image": image_calls(images, run)}
    measured: list[Measured] = []
    by_shape: dict[str, Trials] = {}
    kafka = bootstrap is not None and _kafka_gap(bootstrap) is None
    for key, staged in staged_by_shape.items():
        shape = _SHAPES[key]
        writers: dict[str, Callable[[Path], Measured]] = {
            "floor": partial(run_floor, shape=shape, calls=staged, threads=threads),
            "tokcap": partial(run_tokcap, shape=shape, calls=staged, threads=threads),
            "tokcap_ledger_thread": partial(
                run_tokcap, shape=shape, calls=staged, threads=threads, with_ledger=True
            ),
            "tokcap_ledger_process": partial(
                run_tokcap_ledger_process, shape=shape, calls=staged, threads=threads
            ),
        }
        if straw is not None:
            writers["straw"] = partial(run_straw, shape=shape, calls=staged, threads=threads, target=straw)
        if kafka:
            assert bootstrap is not None
            # The Kafka writers write no directory: each gets a fresh run topic instead.
            writers |= {
                "kafka_floor": _no_directory(partial(run_kafka_floor, bootstrap, shape, staged, threads)),
                "kafka": _no_directory(partial(run_kafka, bootstrap, shape, staged, threads)),
                "kafka_ledger_thread": _no_directory(
                    partial(run_kafka, bootstrap, shape, staged, threads, with_ledger=True)
                ),
            }

        def variant(writer: Callable[[Path], Measured]) -> Variant:
            async def trial(directory: Path) -> dict[str, float]:
                # Writers run their own event loops, so each runs in a thread with none.
                done = await asyncio.to_thread(writer, directory)
                measured.append(done)
                return _measured_figures(done)

            return trial

        variants = {name: variant(writer) for name, writer in writers.items()}
        by_shape[key] = asyncio.run(alternate(variants, trials, work, partial(_say, f"staging {key}:")))
    directory = Path(tempfile.mkdtemp(prefix="chain-", dir=work))
    try:
        fetches = chain_fetch(directory, run)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return by_shape, measured, fetches


def staging_figures(
    by_shape: dict[str, Trials], measured: Sequence[Measured], fetches: Sequence[float], bootstrap: str | None
) -> dict[str, Any]:
    """The staging results: medians per shape and writer, the ratios the targets read, and the table."""
    figures: dict[str, Any] = {key: trials.summary() for key, trials in by_shape.items()}
    ratios: dict[str, dict[str, float]] = {}
    for key, trials in by_shape.items():
        rates = {name: values["mb_per_s"] for name, values in trials.summary().items()}
        pairs = {
            "tokcap_vs_floor": ("tokcap", "floor"),
            "tokcap_vs_straw": ("tokcap", "straw"),
            "kafka_vs_kafka_floor": ("kafka", "kafka_floor"),
        }
        ratios[key] = {
            name: rates[a] / rates[b] for name, (a, b) in pairs.items() if a in rates and b in rates
        }
    figures["chain_fetch_p50_ms"] = median(fetches) * 1e3
    figures["chain_fetch_p99_ms"] = percentile(fetches, 0.99) * 1e3
    return {"figures": figures, "ratios": ratios, "table": _table(measured, fetches, _kafka_gap(bootstrap))}


def _family(measured: Measured) -> str:
    """Which floor a writer is read against: Kafka writers against the raw producer, the others the disk."""
    return "kafka" if "Kafka" in measured.name else "file"


def _p50_p99(latencies: Sequence[float]) -> str:
    """``p50 / p99`` in milliseconds, or nothing when there are no latencies."""
    if not latencies:
        return ""
    return f"{median(latencies) * 1e3:.1f} / {percentile(latencies, 0.99) * 1e3:.1f}"


def _table(results: Sequence[Measured], fetches: Sequence[float], kafka_gap: str | None) -> str:
    lines = [
        "| shape | writer | calls/s | MB/s | p50 (ms) | p99 (ms) | CPU ms/call | MB/s ÷ floor "
        "| ledger record p50 / p99 (ms) | ledger floor p50 / p99 (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    floors = {(r.shape, _family(r)): r.mb_per_s for r in results if "floor" in r.name}
    for r in results:
        lines.append(
            f"| {r.shape} | {r.name} | {r.calls_per_s:,.0f} | {r.mb_per_s:,.0f} | "
            f"{median(r.latencies) * 1e3:.1f} | {percentile(r.latencies, 0.99) * 1e3:.1f} | "
            f"{r.cpu_seconds / r.calls * 1e3:.2f} | "
            f"{r.mb_per_s / floors[(r.shape, _family(r))]:.2f} | {_p50_p99(r.ledger)} | "
            f"{_p50_p99(r.ledger_floor)} |"
        )
    if kafka_gap is not None:
        lines.append(f"| both | Kafka staging, confluent-kafka acks=all floor | {kafka_gap} | | | | | | | |")
    lines.append("")
    for r in results:
        if r.ledger_append_floor:
            lines.append(
                f"Ledger floor's append + fsync alone ({r.shape}): {_p50_p99(r.ledger_append_floor)} ms (p50 / p99)."
            )
    lines.append(
        f"64-call chain fetch (`FileStagingSource.fetch`, fresh source): p50 {median(fetches) * 1e3:.1f} ms, "
        f"p99 {percentile(fetches, 0.99) * 1e3:.1f} ms"
    )
    return "\n".join(lines)
