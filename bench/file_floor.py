"""The file work of the main load with nothing around it: the floor tokcap's file store is read against.

    python -m bench --only file_floor [--dir /var/tmp] [--trials 3] [--rollouts 64]

The floor takes the main workload's entries in the order the load writes them (a round's rollouts turn by
turn) and, from one thread, does only the writing a durable intent and put need:

- a rollout's intents file and entries file are created at its first call and kept open;
- per call, one small intent line is appended, then the entry's canonical line (``TokenEntry.canonical_json``,
  the bytes tokcap stores), hashed with sha256;
- after a rollout's last put, a state file is written beside it and renamed into place;
- one ``syncfs`` of the directory's filesystem per ``PUTS_PER_SYNC`` puts (6: what the main load shares).

It checks nothing, decides nothing, keeps no state, takes no lock and reads nothing back, so it shows how much
of a put is the file work itself. Gym 0.7.0's store and tokcap's file store run the main load on the same
entries, the four taking turns (``bench.harness``), each in a fresh directory under ``--dir``.

A fourth column runs the load's own driver (the same coroutines, awaiting each intent and put) against a
target that hands every call to a ``WriteQueue`` thread, as tokcap's file store does, and does nothing there.
It is the ceiling the load and the hop to the writer thread leave any store, so it shows whether the harness
or the store bounds the put rate.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.harness import Variant
from bench.load import PreparedWorkload
from tokcap.files.group_commit import filesystem_sync_for
from tokcap.log.records import TokenEntry

__all__ = ["PUTS_PER_SYNC", "FloorRun", "HopOnly", "floor_variants", "run_floor", "run_hop_only"]

PUTS_PER_SYNC = 6
"""Puts that share one filesystem sync; the main load's tokcap file store shared one among 6.3 (11:15 run)."""


@dataclass(frozen=True)
class FloorRun:
    """What the floor wrote and how long it took."""

    puts: int
    seconds: float
    cpu_seconds: float

    @property
    def puts_per_s(self) -> float:
        """Intent + put pairs written and made durable per second of wall time."""
        return self.puts / self.seconds

    @property
    def cpu_us_per_put(self) -> float:
        """Process CPU per intent + put, in microseconds."""
        return self.cpu_seconds / self.puts * 1e6


def _calls_in_load_order(workload: PreparedWorkload) -> list[tuple[str, TokenEntry, bool]]:
    """Every call as (rollout, entry, is the rollout's last): a round's rollouts turn by turn, as the load runs."""
    calls: list[tuple[str, TokenEntry, bool]] = []
    rounds = max(len(slot) for slot in workload.slots)
    for index in range(rounds):
        rollouts = [slot[index] for slot in workload.slots if index < len(slot)]
        turns = max(len(entries) for _, entries in rollouts)
        for turn in range(turns):
            for rollout_id, entries in rollouts:
                if turn < len(entries):
                    calls.append((rollout_id, entries[turn], turn == len(entries) - 1))
    return calls


def run_floor(workload: PreparedWorkload, directory: Path, puts_per_sync: int = PUTS_PER_SYNC) -> FloorRun:
    """Write every call's intent and entry lines into ``directory`` as described in the module docstring."""
    if puts_per_sync < 1:
        raise ValueError(f"puts_per_sync must be 1 or more, got {puts_per_sync}")
    calls = _calls_in_load_order(workload)
    sync = filesystem_sync_for(directory)
    files: dict[str, tuple[int, int]] = {}
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    wall_started, cpu_started = time.perf_counter(), time.process_time()
    try:
        for count, (rollout_id, entry, last) in enumerate(calls, start=1):
            opened = files.get(rollout_id)
            if opened is None:
                base = directory / rollout_id
                opened = files[rollout_id] = (
                    os.open(f"{base}.intents.jsonl", flags, 0o644),
                    os.open(f"{base}.tokens.jsonl", flags, 0o644),
                )
            intent = {"model_call_id": entry.model_call_id, "op": "begin", "rollout_id": rollout_id}
            os.write(opened[0], orjson.dumps(intent, option=orjson.OPT_SORT_KEYS) + b"\n")
            line = entry.canonical_json() + b"\n"
            digest = hashlib.sha256(line).hexdigest()
            os.write(opened[1], line)
            if last:
                state = directory / f"{rollout_id}.state.json"
                temporary = state.with_suffix(".tmp")
                temporary.write_bytes(orjson.dumps({"last_digest": digest, "lines": count}))
                os.replace(temporary, state)
            if count % puts_per_sync == 0:
                sync()
        sync()
    finally:
        for descriptors in files.values():
            for descriptor in descriptors:
                os.close(descriptor)
    return FloorRun(len(calls), time.perf_counter() - wall_started, time.process_time() - cpu_started)


@dataclass(frozen=True)
class _Unwritten:
    """A freeze's answer from the hop-only target: as many entries as the load put, nothing masked."""

    entries: list[None]
    incomplete: bool = False


class HopOnly:
    """A capture target that hands each call to a writer thread and only counts it there."""

    def __init__(self) -> None:
        from tokcap.files.write_queue import WriteQueue

        self._queue = WriteQueue(lambda function, args: function(*args), lambda: None, "tokcap-bench-hop")
        self._puts: dict[str, int] = {}
        self.ran_on = collections.Counter[str]()
        """Calls run, by the name of the thread that ran them."""

    def _count(self) -> None:
        self.ran_on[threading.current_thread().name] += 1

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Hop to the writer thread."""
        await self._queue.submit(self._count)

    async def put(self, entry: TokenEntry) -> None:
        """Hop to the writer thread; remember how many puts the rollout had."""
        await self._queue.submit(self._count)
        self._puts[entry.rollout_id] = self._puts.get(entry.rollout_id, 0) + 1

    async def freeze(self, rollout_id: str) -> _Unwritten:
        """Hop to the writer thread as an urgent call; answer as many entries as were put."""
        await self._queue.submit(self._count, urgent=True)
        return _Unwritten([None] * self._puts.get(rollout_id, 0))

    def close(self) -> None:
        """Stop the writer thread."""
        self._queue.close()


async def run_hop_only(workload: PreparedWorkload, target: HopOnly | None = None) -> float:
    """The load's driver against a target that only hops each call to a writer thread; its put/s."""
    from bench.load import drive

    target = target or HopOnly()
    try:
        return (await drive(workload, target)).puts_per_s
    finally:
        target.close()


def floor_variants(workload: PreparedWorkload, puts_per_sync: int = PUTS_PER_SYNC) -> dict[str, Variant]:
    """The four columns: the file work alone, Gym's store, tokcap's file store, the load and hop alone."""
    from bench.file_store_trial import run_file_store_trial
    from bench.trials import gym_anchor

    async def floor(directory: Path) -> dict[str, float]:
        run = run_floor(workload, directory, puts_per_sync)
        return {"puts_per_s": run.puts_per_s, "cpu_us_per_put": run.cpu_us_per_put}

    async def gym(directory: Path) -> dict[str, float]:
        return {"puts_per_s": (await gym_anchor(workload, directory)).puts_per_s}

    async def file(directory: Path) -> dict[str, float]:
        started = time.process_time()
        trial = await run_file_store_trial(workload, directory)
        cpu = time.process_time() - started
        return {"puts_per_s": trial.load.puts_per_s, "cpu_us_per_put": cpu / trial.load.puts * 1e6}

    async def hop(directory: Path) -> dict[str, float]:
        return {"puts_per_s": await run_hop_only(workload)}

    return {"floor": floor, "gym": gym, "file": file, "hop": hop}
