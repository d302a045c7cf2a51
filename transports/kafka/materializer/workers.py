"""Materializer worker processes: N processes applying disjoint partition subsets into one directory.

One materializer applies in one Python thread, so it is capped by one core. A rollout's events all lie in
one partition, and everything a partition writes into a directory is its own (its rollouts' files, its
checkpoint ``kafka-checkpoint-p<N>.json``, dead letters ``kafka-dead-letters-p<N>``, owner record
``kafka-owner-p<N>.json``), so partitions can be applied by separate processes into the same directory:

- the partitions are dealt round-robin to the workers, so the subsets are disjoint by construction;
- each worker takes its partitions' ownership locks (``kafka-materializer-p<N>.lock``) before applying, so
  a second ``tokcap materialize`` on an overlapping subset of the same directory is refused, as with one worker;
- per-rollout file locks serialize any two writers of one rollout, and temporary files are named by process,
  so neither the store nor the checkpoints are shared between workers.

The directory is therefore byte-identical to what one worker, or a clean replay, writes.

Workers are started with ``spawn`` (the parent already runs librdkafka threads, which ``fork`` would copy
half-way) and get their settings over a pipe, not the command line, so client secrets never show in ``ps``.

Stopping: SIGINT or SIGTERM to the parent closes each worker's control pipe; every worker finishes its batch,
writes its checkpoints and exits. A worker signalled directly stops the same way, and the supervisor then
stops the others. A worker whose parent died sees its control pipe closed and stops too, so no worker outlives
its supervisor. Nothing is shared between the processes but pipes, one pair per worker: a worker killed at any
moment cannot leave a lock held that the others would wait on (a ``multiprocessing.Event`` can: its lock, held
by a killed waiter, blocks every other process). A worker that dies (killed, or stopped by an error) is
reported and the others are stopped cleanly: the supervisor does not restart it, since a worker that failed on
a damaged store or a refused login would fail again, and a restart of the whole command by the service manager
resumes every partition exactly from its checkpoint.
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from tokcap.errors import InvalidInputError
from transports.kafka.errors import MaterializerFailedError

__all__ = ["MaterializerWorkers", "WorkerReport", "WorkerSpec", "split_partitions"]

_POLL_S = 0.1
_STOP_GRACE_S = 60.0
"""How long a stopping worker may take to finish its batch before it is killed."""


def split_partitions(partitions: Sequence[int], workers: int) -> list[list[int]]:
    """Deal the partitions round-robin to ``workers`` disjoint, non-empty subsets."""
    chosen = sorted(set(partitions))
    if workers < 1:
        raise InvalidInputError(f"--workers must be at least 1, got {workers}")
    if workers > len(chosen):
        raise InvalidInputError(
            f"--workers {workers} is more than the {len(chosen)} partitions to apply ({chosen}); a partition "
            "is applied by one worker, so use at most one worker per partition"
        )
    return [chosen[i::workers] for i in range(workers)]


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process applies; sent to it pickled over the process pipe."""

    index: int
    bootstrap: str
    topic: str
    directory: str
    partitions: tuple[int, ...]
    consumer_config: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """Client settings; kept out of ``repr``, since they may hold credentials."""
    until: Mapping[int, int] | None = None
    """Stop once every partition has applied the offsets below these (``--until-caught-up``)."""
    block_messages: int | None = None
    """The worker's durable block bound (``Materializer(block_messages=...)``); ``None`` for the default."""


@dataclass(frozen=True)
class WorkerReport:
    """What a worker tells the supervisor: ``ready``, ``progress``, ``dead_letter``, ``caught_up`` (its ``until``
    reached), ``stopped`` or ``failed``."""

    kind: str
    index: int
    applied: Mapping[int, int] = field(default_factory=dict)
    cpu_s: float = 0.0
    """User plus system CPU seconds of the worker process so far."""
    wait_s: float = 0.0
    """Seconds its threads spent waiting for a CPU so far (``/proc/self/task/*/schedstat``)."""
    at: float = 0.0
    """``time.monotonic()`` when the report was made (one clock for every process of the machine)."""
    text: str = ""


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_queue_wait_s() -> float:
    """Seconds this process's threads spent runnable but waiting for a CPU (Linux schedstat; 0 elsewhere).

    On a machine shared with a broker and other jobs it tells a worker starved of CPU from one that is idle.
    """
    total = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _worker_main(spec: WorkerSpec, control: Connection, reports: Connection) -> None:
    """Run one worker's materializer until its control pipe closes (or its ``until``), reporting as it goes.

    Each worker reports over a pipe of its own: a worker killed while writing can damage only its own pipe,
    where a shared queue's lock, held by a dead writer, would block every other worker's reports.
    """

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sending = threading.Lock()

    def report(kind: str, applied: Mapping[int, int] | None = None, text: str = "") -> None:
        message = WorkerReport(
            kind, spec.index, dict(applied or {}), _cpu_s(), _run_queue_wait_s(), time.monotonic(), text
        )
        with sending:
            reports.send(message)

    try:
        from transports.kafka.materializer import Materializer

        materializer = Materializer(
            spec.bootstrap,
            spec.topic,
            spec.directory,
            spec.partitions,
            consumer_config=spec.consumer_config,
            on_dead_letter=lambda line: report("dead_letter", text=line.describe()),
            block_messages=spec.block_messages,
        )
        materializer.start()
        try:
            applied = materializer.applied_offsets()
            until = spec.until or {}
            report("ready", applied, text=f"blocks of up to {materializer.block_messages} messages")
            while not stop.is_set():
                behind = [p for p, end in until.items() if applied.get(p, 0) < end]
                if spec.until is not None and not behind:
                    report("caught_up", applied)
                    break
                if behind:
                    # Wake as soon as the partition is applied, so ``caught_up`` times the apply itself.
                    materializer.wait_for(behind[0], until[behind[0]] - 1, _POLL_S)
                else:
                    materializer.wait_for(spec.partitions[0], -1, 0)
                now = materializer.applied_offsets()
                if now != applied:
                    applied = now
                    report("progress", applied)
                if control.poll(0 if behind else _POLL_S):
                    break  # closed by the supervisor, or by its death
        finally:
            materializer.stop()
        materializer.wait_for(spec.partitions[0], -1, 0)
        report("stopped", materializer.applied_offsets())
    except BaseException as exc:
        report("failed", text=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


@dataclass
class _Worker:
    spec: WorkerSpec
    process: BaseProcess
    reports: Connection
    control: Connection
    """Closing it stops the worker."""
    open: bool = True
    applied: dict[int, int] = field(default_factory=dict)
    ready: WorkerReport | None = None
    first_progress: WorkerReport | None = None
    caught_up: WorkerReport | None = None
    stopped: WorkerReport | None = None
    failure: str = ""


class MaterializerWorkers:
    """Supervises N worker processes materializing disjoint partition subsets of a topic into one directory."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        store_dir: str | Path,
        partitions: Sequence[int],
        workers: int,
        *,
        consumer_config: Mapping[str, Any] | None = None,
        until: Mapping[int, int] | None = None,
        on_dead_letter: Callable[[str], object] | None = None,
        block_messages: int | None = None,
    ) -> None:
        """``on_dead_letter`` gets each dead-letter line (``partition P offset O rollout R: reason``) in ``poll``.

        ``block_messages`` is each worker's durable block bound, checked here before any worker starts.
        """
        if block_messages is not None:
            from transports.kafka.materializer.settings import check_block_messages

            check_block_messages(block_messages)
        context = multiprocessing.get_context("spawn")
        self._on_dead_letter = on_dead_letter
        self._until = until
        self._workers: list[_Worker] = []
        self._child_ends: list[Connection] = []
        for index, subset in enumerate(split_partitions(partitions, workers)):
            spec = WorkerSpec(
                index=index,
                bootstrap=bootstrap_servers,
                topic=topic,
                directory=str(store_dir),
                partitions=tuple(subset),
                consumer_config=dict(consumer_config or {}),
                until=None if until is None else {p: until[p] for p in subset if p in until},
                block_messages=block_messages,
            )
            receiving, sending = context.Pipe(duplex=False)
            control_end, control = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(spec, control_end, sending),
                name=f"tokcap-materializer-worker-{index}",
            )
            self._workers.append(_Worker(spec, process, receiving, control))
            self._child_ends += [sending, control_end]

    @property
    def subsets(self) -> list[tuple[int, ...]]:
        """Each worker's partitions, in worker order."""
        return [worker.spec.partitions for worker in self._workers]

    @property
    def pids(self) -> list[int | None]:
        """Each worker's process id (``None`` before ``start``)."""
        return [worker.process.pid for worker in self._workers]

    def start(self) -> None:
        """Start every worker and wait until each has its partitions assigned; a failed start stops the others."""
        for worker in self._workers:
            worker.process.start()
        # The parent keeps no writing end: a worker's pipe then reads as closed once the worker is gone.
        for end in self._child_ends:
            end.close()
        self._child_ends.clear()
        while not all(worker.ready is not None for worker in self._workers):
            self.poll(_POLL_S)

    def applied_offsets(self) -> dict[int, int]:
        """Per partition of every worker, the next offset to apply (everything below is applied)."""
        applied: dict[int, int] = {}
        for worker in self._workers:
            applied.update(worker.applied)
        return applied

    def reports(self) -> list[tuple[WorkerSpec, WorkerReport | None, WorkerReport | None]]:
        """Per worker: its spec, its first ``progress`` and its ``caught_up`` report.

        Benchmarks time the apply between the two, leaving out start-up and the consumer's first connection.
        """
        return [(worker.spec, worker.first_progress, worker.caught_up) for worker in self._workers]

    def ready_reports(self) -> list[WorkerReport | None]:
        """Per worker, its ``ready`` report: partitions assigned, before it applied anything.

        Timing from it instead of the first ``progress`` counts every event of a topic a worker reads from
        the start; the first progress can come only once a whole partition is applied.
        """
        return [worker.ready for worker in self._workers]

    def finished(self) -> bool:
        """Every worker stopped cleanly (each reached its ``until``, or was asked to stop)."""
        return all(worker.stopped is not None for worker in self._workers)

    def poll(self, timeout_s: float) -> None:
        """Take the workers' reports for up to ``timeout_s``; a worker that died stops the others and raises."""
        self._take_for(timeout_s)
        if self._until is None and any(worker.stopped is not None for worker in self._workers):
            # A worker signalled directly stopped cleanly: the others follow.
            self.request_stop()
        dead = next((w for w in self._workers if w.failure or self._died(w)), None)
        if dead is not None:
            why = dead.failure or f"exited with code {dead.process.exitcode} before stopping cleanly"
            self.stop()
            raise MaterializerFailedError(
                f"materializer worker {dead.spec.index} (partitions {list(dead.spec.partitions)}) of "
                f"{dead.spec.topic!r} failed: {why}; the other workers stopped with their checkpoints written. "
                "Fix the cause and start `tokcap materialize` again: every partition resumes from its checkpoint"
            )

    def request_stop(self) -> None:
        """Ask every worker to finish its batch and stop (close its control pipe); idempotent."""
        for worker in self._workers:
            worker.control.close()

    def stop(self, timeout_s: float = _STOP_GRACE_S) -> None:
        """Stop every worker cleanly and wait for it; one that does not stop in time is killed."""
        self.request_stop()
        started = [worker.process for worker in self._workers if worker.process.pid is not None]
        deadline = time.monotonic() + timeout_s
        # Keep reading reports while waiting: a worker exits only once its queued reports are in the pipe.
        while any(process.is_alive() for process in started) and time.monotonic() < deadline:
            self._take_for(_POLL_S)
        for process in started:
            if process.is_alive():
                process.kill()
            process.join()
        self._drain()

    def _died(self, worker: _Worker) -> bool:
        process = worker.process
        if process.pid is None or process.is_alive() or worker.stopped is not None:
            return False
        # Its last reports may still be in the pipe: take them before calling it dead.
        self._drain()
        return worker.stopped is None

    def _take_for(self, timeout_s: float) -> None:
        """Take reports as they come for up to ``timeout_s``, then whatever is already in the pipes."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._read(left):
            pass
        self._drain()

    def _drain(self) -> None:
        while self._read(0):
            pass

    def _read(self, timeout_s: float) -> bool:
        """Take the reports of every pipe that has some within ``timeout_s``; ``False`` when none had any."""
        pipes = {worker.reports: worker for worker in self._workers if worker.open}
        if not pipes:
            return False
        ready = wait(list(pipes), timeout_s)
        for pipe in ready:
            worker = pipes[pipe]  # type: ignore[index]
            try:
                self._take(worker.reports.recv())
            except (EOFError, OSError):
                worker.open = False
        return bool(ready)

    def _take(self, report: WorkerReport) -> None:
        worker = self._workers[report.index]
        if report.applied:
            worker.applied = dict(report.applied)
        if report.kind == "ready":
            worker.ready = report
        elif report.kind == "progress" and worker.first_progress is None:
            worker.first_progress = report
        elif report.kind == "caught_up":
            worker.caught_up = report
        elif report.kind == "stopped":
            worker.stopped = report
        elif report.kind == "failed":
            worker.failure = report.text
        elif report.kind == "dead_letter" and self._on_dead_letter is not None:
            self._on_dead_letter(report.text)

    def close(self) -> None:
        """Close the report pipes once the workers are stopped."""
        for worker in self._workers:
            worker.reports.close()
            worker.open = False
