"""Power loss: after any crash state a workload's file operations may leave, nothing acknowledged is lost.

Each test runs a small workload in a real directory while ``crash_states`` records its file operations,
then builds a seeded, capped sample of the on-disk states a power loss may leave (synced bytes and names stay;
unsynced appends keep any prefix, torn at a line or a page; each unsynced create, rename or unlink is in or
out). Each state is opened the way a restarted process opens it, and every operation that returned ok must be
there, exactly; the one operation in flight at the crash may be there or not, but nothing else may differ.
A SIGKILL test cannot see these states: the page cache survives a killed process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from crash_states import CrashState, count_checked, crash_states, recording
from factories import make_entry
from staging_calls import commit_for, conversation
from store_contract import directory_contents
from tmpfs import mounted_tmpfs

import tokcap.files.store
from tokcap.errors import RolloutRetiredError, StagingKeyNotFoundError
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import FileCaptureLedger, ledger_event
from tokcap.log.events import (
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
    StagedBlob,
    StageEvent,
)
from tokcap.log.records import TokenEntry
from tokcap.log.state import IntentOp
from tokcap.staging import FileStagingSink, FileStagingSource
from transports.kafka.materializer.checkpoint import checkpoint_path, write_checkpoints

SEED = 36
STATES_PER_STEP = 24
STATE_CAP = 600


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs, so the thousands of checks' syncs cost nothing: mounted where CI runs as root, else the
    system's ``/dev/shm`` when writable, else plain files (slower, the same checks)."""
    if os.geteuid() == 0:
        with mounted_tmpfs(tmp_path / "tmpfs", "256m") as mount_point:
            yield mount_point
        return
    if os.access("/dev/shm", os.W_OK):
        directory = Path(tempfile.mkdtemp(prefix="tokcap-power-loss-", dir="/dev/shm"))
        try:
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    yield tmp_path


# ------------------------------------------------------------------ the file store


@dataclass(frozen=True)
class Op:
    """One store operation of the workload, by rollout; ``answer`` is filled in by a freeze that returned."""

    rollout_id: str
    kind: str
    call_id: str = ""
    entry: TokenEntry | None = None
    answer: tuple[str, int, bool] | None = None


@dataclass
class Expected:
    """What a rollout must read back as after a sequence of operations."""

    retired: bool = False
    frozen: bool = False
    entries: dict[str, bytes] = field(default_factory=dict)
    marks: set[str] = field(default_factory=set)
    intents: dict[str, IntentOp] = field(default_factory=dict)
    snapshot: tuple[str | None, int, bool] | None = None

    def version(self) -> int:
        return len(self.entries) + len(self.marks)

    def dangling(self) -> bool:
        return any(op is IntentOp.INTENT and call not in self.entries for call, op in self.intents.items())


def expected_after(ops: list[Op]) -> Expected:
    """The rollout's state after ``ops``, by the store's rules for this workload (no conflict, no late write)."""
    model = Expected()
    for op in ops:
        if op.kind == "intent":
            model.intents[op.call_id] = IntentOp.INTENT
        elif op.kind == "cancel":
            model.intents[op.call_id] = IntentOp.CANCEL
        elif op.kind == "put":
            assert op.entry is not None
            model.entries[op.call_id] = op.entry.canonical_json()
        elif op.kind == "mark":
            model.marks.add(op.call_id)
        elif op.kind == "freeze":
            model.frozen = True
            incomplete = bool(model.marks) or model.dangling()
            answer = op.answer or (None, model.version() + 1, incomplete)
            model.snapshot = answer
        elif op.kind in ("drop", "retire"):
            model = Expected(retired=True)
        elif op.kind == "delete":
            model = Expected()
    return model


def observed(store: TokenCaptureStore, rollout_id: str) -> Expected:
    """What a recovered store reads back for a rollout, in the terms of ``Expected``."""
    state = store.read_state(rollout_id)
    if state.retired:
        return Expected(retired=True)
    entries = {entry.model_call_id: entry.canonical_json() for entry in store.read_entries(rollout_id)}
    snapshot = None
    if state.frozen:
        snapshot = (state.snapshot_id, state.version, store.is_incomplete(rollout_id))
    return Expected(
        frozen=state.frozen,
        entries=entries,
        marks={mark.model_call_id for mark in state.incomplete_marks},
        intents=dict(state.intents),
        snapshot=snapshot,
    )


def matches(found: Expected, wanted: Expected) -> bool:
    if wanted.snapshot is not None and wanted.snapshot[0] is None and found.snapshot is not None:
        wanted = replace(wanted, snapshot=(found.snapshot[0], *wanted.snapshot[1:]))
    return found == wanted


def store_operations() -> list[Op]:
    """Intents, puts (some over a page), a mark, a cancel, freezes, a drop, a retire, a delete and a reuse."""

    def put(rollout_id: str, call_id: str, tokens: int = 40) -> Op:
        return Op(rollout_id, "put", call_id, make_entry(rollout_id, call_id, prompt=range(tokens)))

    return [
        Op("a", "intent", "c1"),
        put("a", "c1", 1500),
        Op("b", "intent", "c1"),
        Op("a", "intent", "c2"),
        put("b", "c1"),
        put("a", "c2", 1500),
        put("c", "c1"),
        Op("a", "intent", "c3"),
        Op("a", "mark", "c3"),
        put("b", "c2"),
        put("c", "c2"),
        Op("a", "freeze"),
        Op("d", "intent", "c1"),
        put("d", "c1"),
        Op("b", "freeze"),
        Op("b", "drop"),
        Op("c", "delete"),
        Op("d", "retire"),
        put("c", "c3"),
        Op("e", "intent", "x1"),
        put("e", "x1"),
        Op("e", "intent", "x2"),
        Op("e", "cancel", "x2"),
        put("e", "x3", 1200),
        put("e", "x4"),
        put("e", "x5"),
        Op("e", "freeze"),
    ]


def run_now(store: TokenCaptureStore, op: Op, done: list[Op]) -> Op:
    """Run one operation with the store's blocking methods; a freeze returns the op with its answer."""
    if op.kind == "intent":
        store.begin_call_now(op.rollout_id, op.call_id)
    elif op.kind == "cancel":
        store.cancel_call_now(op.rollout_id, op.call_id)
    elif op.kind == "put":
        assert op.entry is not None
        store.append(op.entry)
    elif op.kind == "mark":
        store.mark_incomplete_now(op.rollout_id, op.call_id, "lost in the test")
    elif op.kind == "freeze":
        snapshot = store.freeze_now(op.rollout_id)
        return replace(op, answer=(snapshot.snapshot_id, snapshot.version, snapshot.incomplete))
    elif op.kind == "drop":
        snapshot_id, version, _ = frozen_answer(done)
        assert store.drop_now(op.rollout_id, snapshot_id, version)
    elif op.kind == "retire":
        store.retire_now([op.rollout_id])
    elif op.kind == "delete":
        store.delete_now([op.rollout_id])
    return op


async def run_async(store: TokenCaptureStore, op: Op, done: list[Op]) -> Op:
    """Run one operation with the store's async methods, which share the writer thread's batches."""
    if op.kind == "intent":
        await store.begin_call(op.rollout_id, op.call_id)
    elif op.kind == "cancel":
        await store.cancel_call(op.rollout_id, op.call_id)
    elif op.kind == "put":
        assert op.entry is not None
        await store.put(op.entry)
    elif op.kind == "mark":
        await store.mark_incomplete(op.rollout_id, op.call_id, "lost in the test")
    elif op.kind == "freeze":
        snapshot = await store.freeze(op.rollout_id)
        return replace(op, answer=(snapshot.snapshot_id, snapshot.version, snapshot.incomplete))
    elif op.kind == "drop":
        snapshot_id, version, _ = frozen_answer(done)
        assert await store.drop(op.rollout_id, snapshot_id, version)
    elif op.kind == "retire":
        await store.retire([op.rollout_id])
    elif op.kind == "delete":
        await store.delete([op.rollout_id])
    return op


def frozen_answer(done: list[Op]) -> tuple[str, int, bool]:
    answer = next(op.answer for op in reversed(done) if op.kind == "freeze")
    assert answer is not None
    return answer


def store_workload(store: TokenCaptureStore, ack: Callable[[Any], None]) -> None:
    """The operations one after another, each acknowledged as it returns."""
    done: list[Op] = []
    for op in store_operations():
        done.append(run_now(store, op, done))
        ack(done[-1])


def concurrent_store_workload(store: TokenCaptureStore, ack: Callable[[Any], None]) -> None:
    """Each rollout's operations in order, all rollouts at once: the writer thread runs them in shared batches."""
    by_rollout: dict[str, list[Op]] = {}
    for op in store_operations():
        by_rollout.setdefault(op.rollout_id, []).append(op)

    async def rollout(ops: list[Op]) -> None:
        done: list[Op] = []
        for op in ops:
            done.append(await run_async(store, op, done))
            ack(done[-1])

    async def main() -> None:
        await asyncio.gather(*(rollout(ops) for ops in by_rollout.values()))
        await store.close()

    asyncio.run(main())


def check_store_state(state: CrashState, directory: Path, rollouts: list[str]) -> None:
    """Every acknowledged operation is there, the in-flight one is there or not, and the store works on."""
    store = TokenCaptureStore(directory)
    for rollout_id in rollouts:
        acked = [op for op in state.acked if op.rollout_id == rollout_id]
        allowed = [expected_after(acked)]
        # The rollout's next operation may have run, or part of it, without returning.
        for op in [op for op in state.not_acked if op.rollout_id == rollout_id][:1]:
            allowed.append(expected_after([*acked, op]))
            if op.kind == "delete":
                # A delete retires a rollout holding records first, so one cut short leaves it fenced.
                allowed.append(Expected(retired=True))
        found = observed(store, rollout_id)
        assert any(matches(found, wanted) for wanted in allowed), (
            f"rollout {rollout_id!r} after a crash at step {state.step}: read back {found}, "
            f"but the acknowledged operations allow only {allowed}"
        )
        if found.retired:
            with pytest.raises(RolloutRetiredError):
                store.append(make_entry(rollout_id, "after"))
        elif found.frozen:
            assert found.snapshot is not None
            assert store.freeze_now(rollout_id).snapshot_id == found.snapshot[0]
        else:
            store.begin_call_now(rollout_id, "after")
            store.append(make_entry(rollout_id, "after"))
            snapshot = store.freeze_now(rollout_id)
            assert {entry.model_call_id for entry in snapshot.entries} == {*found.entries, "after"}


@pytest.mark.parametrize(
    "workload", [store_workload, concurrent_store_workload], ids=["one-at-a-time", "writer-batches"]
)
def test_a_power_loss_never_loses_what_the_file_store_acknowledged(
    workload: Callable[[TokenCaptureStore, Callable[[Any], None]], None],
    disk: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    # A small flush interval, so the workload writes lagging index updates as a long rollout does.
    monkeypatch.setattr(tokcap.files.store, "INDEX_FLUSH_ENTRIES", 3)
    live = disk / "live"
    live.mkdir()
    with recording(live, monkeypatch) as recorder:
        workload(TokenCaptureStore(live), recorder.ack)
    states = crash_states(recorder.steps, seed=SEED, per_step=STATES_PER_STEP, cap=STATE_CAP)
    for state in states:
        check_store_state(state, state.write_into(disk / "crash"), ["a", "b", "c", "d", "e"])
    count_checked("file store", len(states))
    record_property("power_loss_crash_states", len(states))


# ------------------------------------------------------------------ the projection's flush

TOPIC = "tokcap.power-loss"
BLOCK = 4
"""Events per projection block: each block ends with a flush and a checkpoint, as the materializer's sweep does."""


def carried_stage(rollout_id: str, turn_index: int) -> StageEvent:
    """A stage as the Kafka sink sends it: the row, and its extras and one attachment carried as blob bytes."""
    call = conversation(rollout_id, turn_index + 1, extras=True)[turn_index].call
    carried: dict[str, bytes] = {}

    def blob(data: bytes) -> StagedBlob:
        sha256 = hashlib.sha256(data).hexdigest()
        carried[sha256] = data
        return StagedBlob(sha256=sha256, size=len(data))

    assert call.extras is not None
    return StageEvent(
        rollout_id=rollout_id,
        staging_key=f"{rollout_id}/{call.model_call_id}",
        model_call_id=call.model_call_id,
        row=call.model_dump(mode="json", exclude={"extras"}),
        extras=blob(orjson.dumps(call.extras)),
        attachments={"image": blob(bytes(range(256)) * 20)},
    ).with_blob_bytes(carried)


def projected_events(drop_answer: tuple[str, int] | None) -> list[Event]:
    """Every kind the materializer applies, interleaved over rollouts; the drop needs the freeze's answer."""

    def put(rollout_id: str, call_id: str, tokens: int = 40) -> PutEvent:
        return PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, prompt=range(tokens)))

    turns = conversation("s", 2, extras=True)
    events: list[Event] = [
        IntentEvent(rollout_id="p", model_call_id="c1"),
        put("p", "c1", 1500),
        IntentEvent(rollout_id="q", model_call_id="c1"),
        carried_stage("s", 0),
        put("q", "c1"),
        put("t", "c1"),
        IntentEvent(rollout_id="p", model_call_id="c2"),
        ledger_event(commit_for(turns[0])),
        put("p", "c2", 1500),
        FreezeEvent(rollout_id="q"),
        IntentEvent(rollout_id="u", model_call_id="c1"),
        put("t", "c2"),
        carried_stage("s", 1),
        IncompleteEvent(rollout_id="p", model_call_id="c3", reason="lost in the test"),
        put("u", "c1"),
        DeleteEvent(rollout_id="t"),
        FreezeEvent(rollout_id="p"),
        ledger_event(commit_for(turns[1])),
        RetireEvent(rollout_id="u"),
        put("t", "c3"),
    ]
    if drop_answer is not None:
        events.append(DropEvent(rollout_id="q", snapshot_id=drop_answer[0], version=drop_answer[1]))
    return events


def position(offset: int) -> LogPosition:
    return LogPosition(TOPIC, 0, offset)


def project(directory: Path, events: list[Event], ack: Callable[[Any], None] = lambda _: None) -> Projection:
    """Apply the events past the directory's checkpoint in blocks; each flush is followed by its checkpoint."""
    projection = Projection(TokenCaptureStore(directory))
    checkpoint = checkpoint_path(directory, 0)
    start = int(checkpoint.read_bytes()) if checkpoint.exists() else 0
    for offset in range(start, len(events)):
        projection.apply(events[offset], position(offset))
        if (offset + 1) % BLOCK == 0 or offset + 1 == len(events):
            projection.flush()
            write_checkpoints(directory, {0: str(offset + 1).encode()})
            ack(offset + 1)
    return projection


def projected_files(directory: Path) -> dict[str, bytes]:
    """The files a projection leaves, but its locks, its checkpoint and temporary files no process owns."""
    return {
        name: data
        for name, data in directory_contents(directory).items()
        if not name.endswith(".lock") and ".tmp-" not in name and name != checkpoint_path(directory, 0).name
    }


def test_a_power_loss_during_a_projections_flush_restarts_to_exactly_the_files_of_a_run_without_one(
    disk: Path, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    """A restart applies the events past its checkpoint again and must reach the same bytes, answers included."""
    first = project(disk / "answer", projected_events(None))
    answer = first.snapshot("q", position(9))
    events = projected_events((answer.snapshot_id, answer.version))
    project(disk / "reference", events)
    reference = projected_files(disk / "reference")
    live = disk / "live"
    live.mkdir()
    with recording(live, monkeypatch) as recorder:
        project(live, events, recorder.ack)
    assert projected_files(live) == reference
    states = crash_states(recorder.steps, seed=SEED, per_step=STATES_PER_STEP, cap=STATE_CAP)
    for state in states:
        directory = state.write_into(disk / "crash")
        project(directory, events)
        assert projected_files(directory) == reference, (
            f"a crash at step {state.step} restarted to other files"
        )
    count_checked("projection", len(states))
    record_property("power_loss_crash_states", len(states))


# ------------------------------------------------------------------ staging blobs and the ledger


@dataclass(frozen=True)
class StagingOp:
    """One staging call of the workload: a stage, a ledger row or failure, or a retire of the rollout."""

    rollout_id: str
    kind: str
    turn: Any = None

    @property
    def key(self) -> str:
        return f"{self.rollout_id}/{self.turn.call.model_call_id}"


def staging_operations() -> list[StagingOp]:
    """Two rollouts staged turn by turn (extras and an image each), their ledger rows, a failure and a retire."""
    first, second = conversation("s1", 3, extras=True), conversation("s2", 2, extras=True)
    return [
        StagingOp("s1", "stage", first[0]),
        StagingOp("s2", "stage", second[0]),
        StagingOp("s1", "record", first[0]),
        StagingOp("s1", "stage", first[1]),
        StagingOp("s2", "record", second[0]),
        StagingOp("s1", "record", first[1]),
        StagingOp("s2", "stage", second[1]),
        StagingOp("s2", "failure", second[1]),
        StagingOp("s1", "stage", first[2]),
        StagingOp("s2", "retire"),
        StagingOp("s1", "record", first[2]),
    ]


def image_of(op: StagingOp) -> bytes:
    """An attachment of more than a page, different per call."""
    return op.key.encode() * 700


def run_staging(directory: Path, op: StagingOp) -> None:
    if op.kind == "stage":
        result = FileStagingSink(directory).stage(op.turn.call, attachments={"image": image_of(op)})
        assert result.ok, result.error
    elif op.kind == "record":
        FileCaptureLedger(directory).record_now(commit_for(op.turn))
    elif op.kind == "failure":
        FileCaptureLedger(directory).record_failure_now(
            op.rollout_id, op.turn.call.model_call_id, "timed out"
        )
    elif op.kind == "retire":
        asyncio.run(FileCaptureLedger(directory).retire([op.rollout_id]))


def fetched(source: FileStagingSource, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """A staged call as a restarted trainer reads it, extras and attachments included; ``None`` when absent."""
    try:
        snapshot = source.fetch_full([key])[0]
    except StagingKeyNotFoundError:
        return None
    return snapshot.model_dump(mode="json"), source.fetch_attachments(key)


def manifest_of(ledger: FileCaptureLedger, rollout_id: str) -> tuple[set[str], set[str]]:
    manifest = ledger.manifest_now(rollout_id)
    return (
        {record["model_call_id"] for record in manifest["records"]},
        {failure["model_call_id"] for failure in manifest["failures"]},
    )


def check_staging_state(state: CrashState, directory: Path, reference: dict[str, Any]) -> None:
    """Every acknowledged stage reads back exactly (blobs included), every acknowledged ledger line is in the
    manifest, a retired rollout shows nothing, and a stage cut short can be staged again."""
    source, ledger = FileStagingSource(directory), FileCaptureLedger(directory)
    for rollout_id in ("s1", "s2"):
        acked = [op for op in state.acked if op.rollout_id == rollout_id]
        pending = [op for op in state.not_acked if op.rollout_id == rollout_id][:1]
        if any(op.kind == "retire" for op in acked):
            assert manifest_of(ledger, rollout_id) == (set(), set())
            stages = [op for op in staging_operations() if op.rollout_id == rollout_id and op.kind == "stage"]
            assert all(fetched(source, op.key) is None for op in stages)
            continue
        retiring = any(op.kind == "retire" for op in pending)
        for op in staging_operations():
            if op.rollout_id != rollout_id or op.kind != "stage":
                continue
            found = fetched(source, op.key)
            if op in acked and not retiring:
                assert found == reference[op.key], (
                    f"stage {op.key} acknowledged before step {state.step} is lost"
                )
            else:
                assert found in (None, reference[op.key]), f"stage {op.key} reads back wrong at {state.step}"
        records, failures = manifest_of(ledger, rollout_id)
        if not retiring:
            assert {op.turn.call.model_call_id for op in acked if op.kind == "record"} <= records
            assert {op.turn.call.model_call_id for op in acked if op.kind == "failure"} <= failures
        owed = {op.turn.call.model_call_id for op in [*acked, *pending] if op.kind in ("record", "failure")}
        assert records | failures <= owed
        for op in pending:
            if op.kind == "stage" and not retiring:
                run_staging(directory, op)
                assert fetched(source, op.key) == reference[op.key]


def test_a_power_loss_never_loses_a_staged_call_its_blobs_or_a_ledger_row_that_returned_ok(
    disk: Path, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    live = disk / "live"
    live.mkdir()
    with recording(live, monkeypatch) as recorder:
        reference: dict[str, Any] = {}
        for op in staging_operations():
            run_staging(live, op)
            if op.kind == "stage":
                reference[op.key] = fetched(FileStagingSource(live), op.key)
            recorder.ack(op)
    states = crash_states(recorder.steps, seed=SEED, per_step=STATES_PER_STEP, cap=STATE_CAP)
    for state in states:
        check_staging_state(state, state.write_into(disk / "crash"), reference)
    count_checked("staging", len(states))
    record_property("power_loss_crash_states", len(states))


# ------------------------------------------------------------------ a repeat of another writer's operation


def test_a_repeat_told_ok_from_another_writers_unsynced_write_is_never_lost(
    disk: Path, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    """An identical repeat changes nothing, but its ok is a promise too: what it repeats must be durable first.

    Writer A (another process's writer thread, mid-batch: its writes are made durable at its batch's end) has
    appended an intent and a put whose index write was not due, so it holds no lock; writer B repeats each and
    is told ok. After any crash from then on, each must be there.
    """
    live = disk / "live"
    live.mkdir()
    entry = make_entry("r", "c1")
    with recording(live, monkeypatch) as recorder:
        first = TokenCaptureStore(live)
        first.append(make_entry("r", "c0"))
        first.files._batch.running = True  # as on A's writer thread: no barrier of its own
        first.begin_call_now("r", "c1")
        first.append(entry)
        first.files._batch.running = False
        assert not first.files._batch.pending, "A's index writes were due; it would hold the rollout's lock"
        repeat = TokenCaptureStore(live)
        repeat.begin_call_now("r", "c1")
        recorder.ack("intent")
        repeat.append(entry)
        recorder.ack("put")
    states = crash_states(recorder.steps, seed=SEED, per_step=STATES_PER_STEP, cap=STATE_CAP)
    for state in states:
        store = TokenCaptureStore(state.write_into(disk / "crash"))
        if "intent" in state.acked:
            assert store.read_intents("r") == {"c1": IntentOp.INTENT}, f"a crash at step {state.step} lost it"
        if "put" in state.acked:
            found = {found.model_call_id: found.canonical_json() for found in store.read_entries("r")}
            assert found.get("c1") == entry.canonical_json(), f"a crash at step {state.step} lost it"
    count_checked("repeats", len(states))
    record_property("power_loss_crash_states", len(states))
