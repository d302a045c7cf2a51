"""The trainer process the crash harness kills: NeMo RL's loop over an in-memory staging store, with or without
tokcap's journal behind it.

    python -m bench.crash_trainer CONFIG_JSON

Generator threads play the rollout workers and Gym's model server: each generates its rollout's calls one by
one (each call costs a known number of generation-seconds, counted, not slept), stages it and records its
ledger row; every acknowledged stage is printed. The trainer takes complete rollouts a batch per step, trains on
them (takes them out of the store), and after every K-th step takes ``journal.cursor()``, then writes its
snapshot: the step, the trained rollouts, the in-memory store's calls and the cursor's JSON. Once the snapshot
is durable it retires the rollouts the snapshot trained on.

Started again, it restores from its last snapshot: the snapshot's calls go back into a fresh store, the
journal's calls staged after the cursor are restaged into it, ``pending_rollouts()`` names the committed
rollouts so that complete ones are trained on instead of generated again, and the rest are generated from
their first missing call. It prints what it holds after the restore, so the driver can price what was lost.

Transports: ``memory`` (the store alone, the anchor), ``file`` (``FileStagingSink``) and ``kafka``
(``KafkaStagingSink``). Output: one JSON document per line on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import tempfile
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench.crash_workload import (
    InMemoryStagingStore,
    Killer,
    PlannedCall,
    WorkloadPlan,
    planned_rollout,
    rollout_of,
)
from tokcap.files.durable_io import fsync_directory

__all__ = ["Journal", "main", "open_journal", "rollout_name"]

_T = TypeVar("_T")

SNAPSHOT = "snapshot.json"


def rollout_name(index: int) -> str:
    """The rollout id of the run's ``index``-th rollout."""
    return f"r{index:05d}"


def _index(rollout_id: str) -> int:
    return int(rollout_id[1:])


class _Loop:
    """One event loop in a thread of its own, where every ledger coroutine of the process runs."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ledger-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


@dataclass
class Journal:
    """tokcap's side of the trainer: the journal sink, the source restage reads and the ledger."""

    sink: Any
    source: Any
    ledger: Any
    loop: _Loop
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def open_journal(
    transport: str, work: Path, inner: InMemoryStagingStore, settings: Mapping[str, Any]
) -> Journal:
    """The journal on ``transport``, behind ``inner``; each process's own directories are fresh ones."""
    from tokcap.staging import JournaledStagingSink

    loop = _Loop()
    if transport == "file":
        from tokcap.lineage import FileLineageResolver
        from tokcap.staging import FileStagingSink, FileStagingSource

        root = work / "journal"
        sink = JournaledStagingSink(inner, FileStagingSink(root))
        ledger = FileLineageResolver(root)
        return Journal(sink, FileStagingSource(root), ledger, loop, [lambda: loop.run(ledger.close())])
    if transport == "kafka":
        from transports.kafka.lineage import KafkaLineageResolver
        from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

        bootstrap, topic = settings["bootstrap"], settings["topic"]
        own = Path(tempfile.mkdtemp(prefix="incarnation-", dir=work))
        journal = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, delivery_timeout_s=60)
        source = KafkaStagingSource(
            bootstrap_servers=bootstrap, topic=topic, store_dir=own / "source", timeout_s=60
        )
        ledger = KafkaLineageResolver(
            bootstrap_servers=bootstrap, topic=topic, store_dir=own / "ledger", timeout_s=60
        )
        return Journal(
            JournaledStagingSink(inner, journal),
            source,
            ledger,
            loop,
            [journal.close, source.close, lambda: loop.run(ledger.close())],
        )
    raise ValueError(f"transport {transport!r} is not memory, file or kafka")


class _Output:
    """One JSON line per event on stdout, whole lines only, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def say(self, **fields: Any) -> None:
        line = json.dumps(fields, sort_keys=True) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


def _write_snapshot(work: Path, snapshot: Mapping[str, Any]) -> None:
    """Write the snapshot durably and atomically, as a trainer's checkpoint is."""
    temporary = work / (SNAPSHOT + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(snapshot).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, work / SNAPSHOT)
    fsync_directory(work)


class Trainer:
    """One incarnation of the trainer: restore from the last snapshot, then run the loop to its last step."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.work = Path(config["work"])
        self.plan = WorkloadPlan.from_json(config["plan"])
        self.transport: str = config["transport"]
        self.restart: bool = config.get("restart", False)
        """Whether an earlier incarnation ran: restore, from its snapshot or from nothing."""
        self.out = _Output()
        self.killer = Killer(config.get("kill"), lambda point: self.out.say(killed=point))
        self.store = InMemoryStagingStore(self.killer)
        self.journal = (
            None
            if self.transport == "memory"
            else open_journal(self.transport, self.work, self.store, config.get("settings", {}))
        )
        self.trained: set[str] = set()
        self.step = 0
        self.next_rollout = 0
        self.complete: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.work_list: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.failures: list[BaseException] = []
        self.progress = threading.Condition()
        """Guards ``next_rollout``; notified after every step, when new rollouts may start."""
        self.stop = threading.Event()

    def calls(self, rollout_id: str) -> tuple[PlannedCall, ...]:
        low, high = self.plan.generation_seconds
        return planned_rollout(self.plan.seed, rollout_id, self.plan.calls_per_rollout, low, high)

    # ------------------------------------------------------------------ restore

    def restore(self) -> None:
        """Back to the last snapshot: its calls, then the journal's since its cursor, then the ledger's view."""
        path = self.work / SNAPSHOT
        if not self.restart:
            return
        snapshot = (
            json.loads(path.read_text())
            if path.exists()
            else {"step": 0, "next_rollout": 0, "trained": [], "rows": [], "cursor": None}
        )
        self.step, self.next_rollout = snapshot["step"], snapshot["next_rollout"]
        self.trained = set(snapshot["trained"])
        self.store.point = "load"
        self.store.load(snapshot["rows"])
        self.store.point = "restage"
        restaged = refused = 0
        pending: list[str] = []
        if self.journal is not None:
            from tokcap.staging import JournalCursor, restage

            cursor = None if snapshot["cursor"] is None else JournalCursor.from_json(snapshot["cursor"])
            report = restage(self.journal.source, self.store, after=cursor)
            restaged, refused = report.restaged, report.refused
            if refused:
                raise RuntimeError(f"the in-memory store refused {refused} restaged calls: {report!r}")
            pending = [
                rollout.rollout_id
                for rollout in self.journal.loop.run(self.journal.ledger.pending_rollouts())
                if not rollout.has_failures
            ]
        self.store.point = "stage"
        for rollout_id in self.trained:
            self.store.take(rollout_id)
        self.out.say(
            restored={
                "held": self.store.digests(),
                "trained": sorted(self.trained),
                "restaged": restaged,
                "pending": sorted(set(pending) - self.trained),
                "step": self.step,
            }
        )
        held: dict[str, int] = {}
        for key in self.store.staged_keys():
            held[rollout_of(key)] = held.get(rollout_of(key), 0) + 1
        if self.journal is not None:
            # Committed rollouts whose every call came back are trained on as they are.
            for rollout_id in sorted(set(pending) - self.trained):
                if held.get(rollout_id) == self.plan.calls_per_rollout:
                    manifest = self.journal.loop.run(self.journal.ledger.manifest(rollout_id))
                    if len(manifest.get("records", ())) == self.plan.calls_per_rollout:
                        self.complete.put(rollout_id)
                        held.pop(rollout_id)
        if self.journal is not None and self.trained & set(pending):
            # A crash between a snapshot and its retire left rollouts it trained on: retire them now.
            self.journal.loop.run(self.journal.ledger.retire(sorted(self.trained & set(pending))))
        for rollout_id in sorted(held):
            self.work_list.put(rollout_id)
            self.next_rollout = max(self.next_rollout, _index(rollout_id) + 1)

    # --------------------------------------------------------------- generation

    def generate(self, rollout_id: str) -> None:
        """Generate the rollout's calls it does not hold yet, staging and recording each; then it is complete."""
        for call in self.calls(rollout_id):
            if not self.store.has(call.key):
                threading.Event().wait(self.plan.sleep_s)
                if self.journal is None:
                    result = self.store.stage(call.record, attachments=call.attachments)
                else:
                    result = self.journal.sink.stage(call.record, attachments=call.attachments)
                if not result.ok:
                    raise RuntimeError(f"stage of {call.key} failed: {result.error}")
                self.out.say(ack=call.key, cost=call.generation_seconds)
            if self.journal is not None:
                self.journal.loop.run(self.journal.ledger.record(call.commit))
        self.complete.put(rollout_id)

    def _next_new_rollout(self) -> str | None:
        """A new rollout to start, once it is at most two steps ahead of training; ``None`` when stopped."""
        with self.progress:
            ahead = (self.step + 2) * self.plan.rollouts_per_step
            while self.next_rollout >= ahead and not self.stop.is_set():
                self.progress.wait(0.05)
                ahead = (self.step + 2) * self.plan.rollouts_per_step
            if self.stop.is_set():
                return None
            self.next_rollout += 1
            return rollout_name(self.next_rollout - 1)

    def generator(self) -> None:
        """One rollout worker: resume the restored rollouts first, then start new ones."""
        while not self.stop.is_set():
            try:
                rollout_id: str | None = self.work_list.get_nowait()
            except queue.Empty:
                rollout_id = self._next_new_rollout()
            if rollout_id is None:
                return
            try:
                self.generate(rollout_id)
            except BaseException as exc:
                self.failures.append(exc)
                self.stop.set()
                self.complete.put("")
                return

    # ----------------------------------------------------------------- training

    def run(self) -> None:
        self.restore()
        per_step = self.plan.rollouts_per_step
        threads = [threading.Thread(target=self.generator, daemon=True) for _ in range(self.plan.generators)]
        for thread in threads:
            thread.start()
        since_snapshot: list[str] = []
        while self.step < self.plan.steps:
            batch: list[str] = []
            while len(batch) < per_step:
                rollout_id = self.complete.get()
                if self.failures:
                    raise self.failures[0]
                batch.append(rollout_id)
            for rollout_id in batch:
                self.store.take(rollout_id)
                self.trained.add(rollout_id)
            since_snapshot += batch
            with self.progress:
                self.step += 1
                self.progress.notify_all()
            if self.step % self.plan.save_period == 0:
                self.snapshot(since_snapshot)
                since_snapshot = []
        self.stop.set()
        for thread in threads:
            thread.join()
        self.out.say(done={"step": self.step, "trained": len(self.trained)})

    def snapshot(self, trained_since: list[str]) -> None:
        """Cursor first, then the durable snapshot, then retire what the snapshot trained on."""
        cursor = None if self.journal is None else self.journal.sink.cursor(f"step-{self.step}").to_json()
        self.killer.reached("cursor")
        _write_snapshot(
            self.work,
            {
                "step": self.step,
                "next_rollout": self.next_rollout,
                "trained": sorted(self.trained),
                "rows": self.store.dumped(),
                "cursor": cursor,
            },
        )
        self.out.say(snapshot=self.step)
        if self.journal is not None:
            self.journal.loop.run(self.journal.ledger.retire(trained_since))


def main(argv: list[str] | None = None) -> int:
    """Run one incarnation of the trainer from the configuration given as JSON."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    trainer = Trainer(config)
    try:
        trainer.run()
    finally:
        if trainer.journal is not None:
            trainer.journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
