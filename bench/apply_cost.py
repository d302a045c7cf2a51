"""CPU per event of the store's apply step and per intent + put of the file sink, against Gym 0.7.0's store.

``python -m bench --only apply_cost --baseline DIR`` builds the main workload's entries once (64 rollouts x 2
rounds x 8 turns, 1k-token system prompt) and measures, one call at a time from one thread, with real syncs:

- the apply step, the materializer's own path: ``Projection.apply(event, position)`` over the event stream a
  materializer applies (intent and put per turn, a freeze per rollout, log positions on four partitions), with
  a ``flush`` per block of the size the measured tree's materializer sweeps (``block_messages``), or
  ``--block``; the whole stream (``projection_us_per_event``), then CPU per event by kind, and each flush
  (lines, state writes and the sync) shared out over the block's events;
- the file sink: ``begin_call_now`` + ``append`` per turn and ``freeze_now`` per rollout, as ``bench/cpu_cost``;
- Gym 0.7.0's file store (its wheel, loaded as the tests load it) on the same entries, as the anchor.

CPU is ``time.process_time`` (user + system of this process), not wall time, so the figures hold on a
machine other jobs share; the ratios of trials run side by side in one run are the evidence.
The scenario measures this checkout and ``--baseline DIR`` (``git worktree add /tmp/apply-base main``) in the
same run, trials alternating, each in its own process (``bench.trials.apply_cost``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["measure"]

_REPO = Path(__file__).resolve().parent.parent
_PARTITIONS = 4


def _shape(args: argparse.Namespace) -> Any:
    from bench.options import WorkloadShape

    return WorkloadShape(
        rollouts=args.rollouts, rounds=args.rounds, turns=args.turns, prompt_tokens=args.prompt
    )


def _rollouts_in_load_order(workload: Any) -> list[list[tuple[str, list[Any]]]]:
    """Rounds of rollouts: every slot's first rollout, then every slot's second, as the load runs them."""
    rounds = max(len(slot) for slot in workload.slots)
    return [[slot[index] for slot in workload.slots if index < len(slot)] for index in range(rounds)]


def _events(workload: Any) -> list[tuple[str, Any, Any]]:
    """The materializer's stream: per round, turn by turn an intent and a put for each rollout, then the freezes."""
    from tokcap.log.events import FreezeEvent, IntentEvent, LogPosition, PutEvent

    offsets = [0] * _PARTITIONS
    stream: list[tuple[str, Any, Any]] = []

    def add(kind: str, event: Any, rollout_index: int) -> None:
        partition = rollout_index % _PARTITIONS
        stream.append((kind, event, LogPosition("bench-apply", partition, offsets[partition])))
        offsets[partition] += 1

    index_of: dict[str, int] = {}
    for rollouts in _rollouts_in_load_order(workload):
        for rollout_id, _ in rollouts:
            index_of.setdefault(rollout_id, len(index_of))
        for turn in range(workload.shape.turns):
            for rollout_id, entries in rollouts:
                entry = entries[turn]
                add(
                    "intent",
                    IntentEvent(rollout_id=rollout_id, model_call_id=entry.model_call_id),
                    index_of[rollout_id],
                )
                add("put", PutEvent(rollout_id=rollout_id, entry=entry), index_of[rollout_id])
        for rollout_id, _ in rollouts:
            add("freeze", FreezeEvent(rollout_id=rollout_id), index_of[rollout_id])
    return stream


def _apply_step(workload: Any, directory: Path, block_size: int) -> dict[str, float]:
    """CPU us per event of ``Projection.apply`` with a ``flush`` per block: the whole stream, then by kind.

    The headline (``projection_us_per_event`` and its user/system split) comes from a pass with no clock read
    between events: reading the process CPU clock is a system call, two per event would add to every event
    a cost comparable to its own system calls and pull the ratio of two trees towards one. A second pass
    over the same stream into another directory times each event by kind; its flushes are shared over
    all events.
    """
    figures = _apply_step_whole(workload, directory / "whole", block_size)
    figures.update(_apply_step_by_kind(workload, directory / "by-kind", block_size))
    return figures


def _projection(directory: Path) -> Any:
    from tokcap.files.log_projection import Projection
    from tokcap.files.store import TokenCaptureStore

    return Projection(TokenCaptureStore(directory))


def _apply_step_whole(workload: Any, directory: Path, block_size: int) -> dict[str, float]:
    """CPU us per event of the whole stream, user and system apart; four clock reads in all.

    The total comes from the process CPU clock (nanoseconds); ``os.times`` splits it into user and system
    time, but it counts in scheduler ticks (10 ms here), too coarse for a pass of about 100 ms to be the
    headline: a tick more or less moved a trial's figure by a tenth.
    """
    stream: list[tuple[str, Any, Any] | None] = list(_events(workload))
    events = len(stream)
    projection = _projection(directory)
    before, cpu_before = os.times(), time.process_time()
    for first in range(0, events, block_size):
        for index in range(first, min(first + block_size, events)):
            _, event, position = _released(stream, index)
            projection.apply(event, position)
            del event
        projection.flush()
    cpu_after, after = time.process_time(), os.times()
    user = (after.user - before.user) / events * 1e6
    system = (after.system - before.system) / events * 1e6
    total = (cpu_after - cpu_before) / events * 1e6
    return {"projection_us_per_event": total, "user_us_per_event": user, "system_us_per_event": system}


def _apply_step_by_kind(workload: Any, directory: Path, block_size: int) -> dict[str, float]:
    """CPU us per event by kind, each event timed on its own; flushes shared over all events."""
    stream: list[tuple[str, Any, Any] | None] = list(_events(workload))
    events = len(stream)
    projection = _projection(directory)
    cpu = {"intent": 0.0, "put": 0.0, "freeze": 0.0, "block_end": 0.0}
    counts = {"intent": 0, "put": 0, "freeze": 0}
    clock = time.process_time
    for first in range(0, events, block_size):
        for index in range(first, min(first + block_size, events)):
            kind, event, position = _released(stream, index)
            started = clock()
            projection.apply(event, position)
            cpu[kind] += clock() - started
            counts[kind] += 1
            del event
        started = clock()
        projection.flush()
        cpu["block_end"] += clock() - started
    figures = {f"{kind}_us": cpu[kind] / counts[kind] * 1e6 for kind in counts}
    figures["block_end_us_per_event"] = cpu["block_end"] / events * 1e6
    figures["timed_us_per_event"] = sum(cpu.values()) / events * 1e6
    return figures


def _released(stream: list[tuple[str, Any, Any] | None], index: int) -> tuple[str, Any, Any]:
    """Take one event out of the stream, as a materializer lets go of each message once it is applied.

    Holding every event to the end would keep what each one caches (a put's encoded line, ~19 kB), and
    the heap would grow by the whole stream: the page faults of that growth measured about 60 us per put,
    a cost no materializer pays and trees without the cache did not pay either.
    """
    item = stream[index]
    if item is None:
        raise ValueError(f"event {index} of the stream was applied already")
    stream[index] = None
    return item


def _timed_calls(
    rounds: Any,
    turns: int,
    begin_call: Callable[..., object],
    append: Callable[..., object],
    freeze: Callable[..., object],
) -> dict[str, float]:
    """CPU us per intent, put and freeze when the rounds' calls are made one at a time in load order."""
    cpu = {"intent": 0.0, "put": 0.0, "freeze": 0.0}
    counts = {"intent": 0, "put": 0, "freeze": 0}
    clock = time.process_time

    def timed(kind: str, call: Callable[..., object], *args: object) -> None:
        started = clock()
        call(*args)
        cpu[kind] += clock() - started
        counts[kind] += 1

    for rollouts in rounds:
        for turn in range(turns):
            for rollout_id, entries in rollouts:
                entry = entries[turn]
                timed("intent", begin_call, rollout_id, entry.model_call_id)
                timed("put", append, entry)
        for rollout_id, _ in rollouts:
            timed("freeze", freeze, rollout_id)
    figures = {f"{kind}_us": cpu[kind] / counts[kind] * 1e6 for kind in counts}
    figures["intent_put_us"] = figures["intent_us"] + figures["put_us"]
    return figures


def _file_sink(workload: Any, directory: Path) -> dict[str, float]:
    """CPU us per intent, put and freeze of the file sink's synchronous calls, with real syncs."""
    from tokcap.files.store import TokenCaptureStore

    store = TokenCaptureStore(directory)
    rounds = _rollouts_in_load_order(workload)
    return _timed_calls(rounds, workload.shape.turns, store.begin_call_now, store.append, store.freeze_now)


def _gym_store(workload: Any, directory: Path) -> dict[str, float]:
    """The same calls on Gym 0.7.0's file store: ``_begin_call`` + ``append`` per turn, ``freeze_now`` per rollout."""
    gym = _load_gym()
    store = gym.store.TokenCaptureStore(directory)
    as_gym = gym.records.TokenEntry.model_validate
    rounds = [
        [
            (rollout_id, [as_gym(entry.model_dump(mode="json")) for entry in entries])
            for rollout_id, entries in rollouts
        ]
        for rollouts in _rollouts_in_load_order(workload)
    ]
    return _timed_calls(rounds, workload.shape.turns, store._begin_call, store.append, store.freeze_now)


class _GymTarget:
    """Gym's store driven by the load: its async calls, entries converted to Gym's class up front."""

    def __init__(self, store: Any, entries: dict[tuple[str, str], Any]) -> None:
        self._store = store
        self._entries = entries

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._store.begin_call(rollout_id, model_call_id)

    async def put(self, entry: Any) -> None:
        await self._store.put(self._entries[entry.rollout_id, entry.model_call_id])

    async def freeze(self, rollout_id: str) -> Any:
        return await self._store.freeze(rollout_id)


def _under_load(workload: Any, directory: Path, *, gym: bool) -> dict[str, float]:
    """The main load (``bench/load.py``) on one store: CPU per put; put/s and freeze p99 as sanity checks."""
    import asyncio

    from bench.load import drive

    if gym:
        modules = _load_gym()
        as_gym = modules.records.TokenEntry.model_validate
        converted = {
            (entry.rollout_id, entry.model_call_id): as_gym(entry.model_dump(mode="json"))
            for slot in workload.slots
            for _, entries in slot
            for entry in entries
        }
        target: Any = _GymTarget(modules.store.TokenCaptureStore(directory), converted)
    else:
        from tokcap.files.store import TokenCaptureStore

        target = TokenCaptureStore(directory)

    async def run() -> Any:
        try:
            return await drive(workload, target)
        finally:
            if not gym:
                await target.close()

    started = time.process_time()
    load = asyncio.run(run())
    cpu = time.process_time() - started
    freezes = sorted(load.freeze_under_load_ms) or [0.0]
    return {
        "cpu_us_per_put": cpu / load.puts * 1e6,
        "puts_per_s": load.puts_per_s,
        "freeze_p99_ms": freezes[min(len(freezes) - 1, int(len(freezes) * 0.99))],
    }


def _load_gym() -> Any:
    """Gym 0.7.0's modules from its wheel, as the tests load them (``tests/gym_wheel.py``)."""
    sys.path.insert(0, str(_REPO / "tests"))
    gym_wheel = importlib.import_module("gym_wheel")
    return gym_wheel.load_gym()


def _materializer_block() -> int:
    """The block size the imported tree's materializer sweeps in."""
    try:
        settings = importlib.import_module("transports.kafka.materializer.settings")
    except ModuleNotFoundError:  # a tree from before the settings value
        return int(importlib.import_module("transports.kafka.materializer").SWEEP_BLOCK_MESSAGES)
    return int(settings.DEFAULT_SETTINGS.block_messages)


def measure(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """One trial of every measurement this process's tokcap can run; Gym's store when asked."""
    import tokcap
    from bench.load import prepare

    workload = prepare(_shape(args), "apply")
    if args.block is None:
        args.block = _materializer_block()
    figures: dict[str, Any] = {"tokcap": str(Path(tokcap.__file__).resolve().parent), "block": args.block}
    figures["apply"] = _apply_step(workload, directory / "apply", args.block)
    if args.apply_only:
        return figures
    figures["sink"] = _file_sink(workload, directory / "sink")
    figures["load"] = _under_load(workload, directory / "load", gym=False)
    if args.gym:
        figures["gym"] = _gym_store(workload, directory / "gym")
        figures["gym_load"] = _under_load(workload, directory / "gym-load", gym=True)
    return figures
