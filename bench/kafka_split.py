"""The Kafka load with the trainer in its own process, as a run deploys it: the sinks here, the source there.

The main load runs the sinks of 64 producing rollouts, the source and its materializer in one interpreter, so
every freeze waits for the GIL behind the rollouts' encoding and hashing. In a run the model servers' sinks and
the trainer are different processes (usually different nodes). Here the load's process keeps the sinks and
hands each finished rollout to a trainer process (``bench.kafka_trainer``: a source with its in-process
materializer), which freezes it and answers with the snapshot's call ids. Each snapshot is checked against
the calls the load wrote for that rollout. Two latencies are kept per freeze: the trainer's own (from calling
``freeze`` to holding the snapshot) and the load's round trip (which adds the pipe and the load's busy loop).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.kafka_trial import delete_topic
from bench.load import BenchmarkCheckError, LoadResult, PreparedWorkload, drive
from tokcap.log.records import TokenEntry
from transports.kafka.client.topics import ensure_topic
from transports.kafka.sink import KafkaTokenSink

__all__ = ["SplitTrial", "TrainerProcessError", "run_with_trainer_process"]

_REPO = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S = 60.0
_EXIT_TIMEOUT_S = 120.0


class TrainerProcessError(RuntimeError):
    """The trainer process failed to start, failed a freeze or exited badly; its log tail says why."""


@dataclass(frozen=True)
class SplitTrial:
    """The load's figures (its freeze latencies are round trips) and the trainer's own freeze latencies."""

    load: LoadResult
    trainer_freeze_under_load_ms: list[float]
    trainer_freeze_after_load_ms: list[float]


@dataclass(frozen=True)
class _Frozen:
    """A snapshot as the trainer described it: its entries' call ids, in order."""

    entries: tuple[str, ...]
    incomplete: bool


@dataclass
class _TrainerLatencies:
    puts_done: bool = False
    under_load_ms: list[float] = field(default_factory=list)
    after_load_ms: list[float] = field(default_factory=list)


class _Trainer:
    """The trainer process: one JSON line per freeze each way, answers matched by rollout id."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self._process = process
        self._log = log
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read_answers())

    def _failure(self, what: str) -> TrainerProcessError:
        tail = self._log.read_text(errors="replace")[-3000:] if self._log.exists() else ""
        return TrainerProcessError(f"the trainer process {what}; its log ends with:\n{tail}")

    async def _read_answers(self) -> None:
        assert self._process.stdout is not None
        while line := await self._process.stdout.readline():
            answer: dict[str, Any] = orjson.loads(line)
            waiter = self._waiting.pop(answer["rollout_id"], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(answer)
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(self._failure("closed its output with freezes unanswered"))

    async def freeze(self, rollout_id: str) -> dict[str, Any]:
        assert self._process.stdin is not None
        if rollout_id in self._waiting:
            raise BenchmarkCheckError(f"rollout {rollout_id} was handed to the trainer twice")
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rollout_id] = waiter
        self._process.stdin.write(orjson.dumps({"rollout_id": rollout_id}) + b"\n")
        await self._process.stdin.drain()
        answer = await waiter
        if "error" in answer:
            raise TrainerProcessError(f"the trainer could not freeze {rollout_id}: {answer['error']}")
        return answer

    async def close(self) -> None:
        """End the trainer's input and wait for it to answer what is left and exit."""
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            code = await asyncio.wait_for(self._process.wait(), _EXIT_TIMEOUT_S)
        except TimeoutError:
            self._process.kill()
            await self._process.wait()
            raise self._failure(f"did not exit within {_EXIT_TIMEOUT_S:.0f} s") from None
        await self._reader
        if code != 0:
            raise self._failure(f"exited with status {code}")


class _SplitTarget:
    """The load's view: its own sink writes, the trainer process freezes; each snapshot is checked here."""

    def __init__(self, sink: KafkaTokenSink, trainer: _Trainer, latencies: _TrainerLatencies) -> None:
        self._sink = sink
        self._trainer = trainer
        self._latencies = latencies
        self._written: dict[str, list[str]] = {}

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._sink.begin_call(rollout_id, model_call_id)

    async def put(self, entry: TokenEntry) -> None:
        await self._sink.put(entry)
        self._written.setdefault(entry.rollout_id, []).append(entry.model_call_id)

    async def freeze(self, rollout_id: str) -> _Frozen:
        under_load = not self._latencies.puts_done
        answer = await self._trainer.freeze(rollout_id)
        calls = tuple(answer["model_call_ids"])
        if list(calls) != self._written.get(rollout_id, []):
            raise BenchmarkCheckError(
                f"the trainer's snapshot of {rollout_id} holds calls {list(calls)}, but the load wrote "
                f"{self._written.get(rollout_id, [])}"
            )
        latency = float(answer["latency_ms"])
        (self._latencies.under_load_ms if under_load else self._latencies.after_load_ms).append(latency)
        return _Frozen(calls, bool(answer["incomplete"]))


async def _start_trainer(bootstrap: str, topic: str, directory: Path) -> _Trainer:
    log = directory / "trainer.log"
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "bench.kafka_trainer", "--bootstrap", bootstrap, "--topic", topic]
    command += ["--dir", str(directory / "live")]
    pythonpath = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH", "")]))
    with log.open("wb") as errors:
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env={**os.environ, "PYTHONPATH": pythonpath},
        )
    assert process.stdout is not None
    try:
        ready = await asyncio.wait_for(process.stdout.readline(), _READY_TIMEOUT_S)
    except TimeoutError:
        ready = b""
    if ready.strip() != b"ready":
        process.kill()
        await process.wait()
        tail = log.read_text(errors="replace")[-3000:]
        raise TrainerProcessError(f"the trainer process did not start; its log ends with:\n{tail}")
    return _Trainer(process, log)


async def run_with_trainer_process(
    workload: PreparedWorkload, bootstrap: str, directory: Path, load_niceness: int = 0
) -> SplitTrial:
    """Drive the load through a fresh topic whose freezes a trainer process serves.

    A ``load_niceness`` above 0 lowers this (the load's) process's CPU priority once the trainer runs, so the
    scheduler serves the trainer and the broker first: how far a trainer with cores of its own would get.
    """
    topic = f"tokcap.bench-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    try:
        trainer = await _start_trainer(bootstrap, topic, directory)
        if load_niceness:
            os.nice(load_niceness)
        latencies = _TrainerLatencies()
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        try:

            def note_puts_done() -> None:
                latencies.puts_done = True

            load = await drive(workload, _SplitTarget(sink, trainer, latencies), note_puts_done)
        finally:
            await sink.close()
            await trainer.close()
    finally:
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return SplitTrial(load, latencies.under_load_ms, latencies.after_load_ms)
