"""Where a file-store put's CPU goes: the loop of ``bench/cpu_cost``, each microsecond given to one step.

``python -m bench.put_profile --dir /dev/shm`` runs the main load's first rollouts turn by turn from one thread
(an intent, then the timed put, as ``bench/cpu_cost`` does). Runs alternate: a plain one for the put's thread CPU,
then one with the step functions below timed, each step's time counted without the steps it calls, and the
garbage collector's passes and the filesystem sync as steps of their own, so the steps sum to the timed total.

This is a profiler, not a benchmark: no figure or target of the suite reads it. It wraps the step functions in
its own process, because ``cProfile`` gave a wrong picture (its hooks tripled the kept-copy step, whose calls are
few, and its per-call cost swamped the many small ones); the wrappers add two clock reads per step call, about
10% of a put. A step function renamed or moved makes it stop with the name, rather than print a wrong table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokcap.events
import tokcap.group_commit
import tokcap.locks
import tokcap.state
import tokcap.store
from bench.load import prepare
from bench.options import WorkloadShape

__all__ = ["PutProfile", "main", "profile_puts"]

_STEPS: tuple[tuple[Any, str, str], ...] = (
    (tokcap.store, "accept_entry", "input validation (accept_entry: token id range, finite floats, ids)"),
    (tokcap.events.PutEvent, "entry_line", "canonical JSON encode (orjson)"),
    (tokcap.events.PutEvent, "payload_digest", "payload digest (sha256 of the line)"),
    (tokcap.store, "decide", "decide (rules.decide, _put)"),
    (tokcap.state.RolloutState, "next_copy", "state copy for the decision (RolloutState.next_copy)"),
    (
        tokcap.store.TokenCaptureStore,
        "_keep_appended_entry",
        "kept copy of the entry for the freeze (KeptEntries)",
    ),
    (tokcap.store, "append_durably", "line write (open, fstat, write, close)"),
    (tokcap.store, "replace_atomically", "state file write and rename"),
    (tokcap.state.RolloutState, "encode", "state encode"),
    (tokcap.store, "_files_identity", "files identity (3 lstat)"),
    (tokcap.locks.RolloutLocks, "_acquire", "rollout lock: acquire (open lock file, flock)"),
    (tokcap.locks.RolloutLocks, "_release", "rollout lock: release (close)"),
    (tokcap.locks.RolloutLocks, "hold", "rollout lock: acquire (open lock file, flock)"),
    (tokcap.group_commit.GroupCommitter, "wait_durable", "group commit: wait_durable and note_write"),
    (tokcap.group_commit.GroupCommitter, "note_write", "group commit: wait_durable and note_write"),
    (tokcap.store.TokenCaptureStore, "_end_of_operation", "store: apply, recover, carry out, verdict"),
    (tokcap.store.TokenCaptureStore, "apply", "store: apply, recover, carry out, verdict"),
    (tokcap.store.TokenCaptureStore, "_apply_locked", "store: apply, recover, carry out, verdict"),
    (tokcap.store.TokenCaptureStore, "_recovered_with_identity", "store: apply, recover, carry out, verdict"),
    (tokcap.store.TokenCaptureStore, "_carry_out", "store: apply, recover, carry out, verdict"),
    (tokcap.store.TokenCaptureStore, "_raise_for", "store: apply, recover, carry out, verdict"),
)
"""Owner, attribute and step of every timed function; ``store.append``'s own time is the PutEvent's build."""

_PUT_CALL = "put call: builds the PutEvent (pydantic)"
_SYNC = "filesystem sync (syncfs, kernel CPU included)"
_GC = "garbage collector passes during the put"


class _Clock:
    """Exclusive thread CPU per step: a stack of the time each open step's callees took."""

    def __init__(self) -> None:
        self.active = False
        self.seconds: dict[str, float] = defaultdict(float)
        self._callees: list[float] = []
        self._gc_started = 0.0

    def timed(self, step: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return function(*args, **kwargs)
            self._callees.append(0.0)
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self._close(step, time.thread_time() - started)

        return run

    def _close(self, step: str, elapsed: float) -> None:
        self.seconds[step] += elapsed - self._callees.pop()
        if self._callees:
            self._callees[-1] += elapsed

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._gc_started = time.thread_time()
            return
        elapsed = time.thread_time() - self._gc_started
        self.seconds[_GC] += elapsed
        if self._callees:
            self._callees[-1] += elapsed

    def put(self, store: tokcap.store.TokenCaptureStore, entry: Any) -> float:
        self.active = True
        self._callees.append(0.0)
        started = time.thread_time()
        store.append(entry)
        elapsed = time.thread_time() - started
        self._close(_PUT_CALL, elapsed)
        self.active = False
        return elapsed


@contextmanager
def _installed(clock: _Clock) -> Iterator[None]:
    """Time the step functions while the block runs; put every one back after it."""
    undo: list[Callable[[], None]] = []
    try:
        for owner, name, step in _STEPS:
            found = owner.__dict__.get(name)
            if found is None:
                raise SystemExit(f"{owner.__name__}.{name} is gone: update bench/put_profile.py's steps")
            if isinstance(found, functools.cached_property):  # time what it computes
                computed = found.func
                found.func = clock.timed(step, computed)
                undo.append(functools.partial(setattr, found, "func", computed))
            else:
                setattr(owner, name, clock.timed(step, found))
                undo.append(functools.partial(setattr, owner, name, found))
        gc.callbacks.append(clock.on_gc)
        undo.append(functools.partial(gc.callbacks.remove, clock.on_gc))
        yield
    finally:
        for step_back in reversed(undo):
            step_back()


def _run(directory: Path, rollouts: int, clock: _Clock | None) -> float:
    """Intent and put per turn over the first ``rollouts`` rollouts; return the thread CPU per put in us."""
    shape = WorkloadShape(rollouts=rollouts, rounds=1)
    workload = prepare(shape, "profile")
    store = tokcap.store.TokenCaptureStore(directory)
    if clock is not None:
        sync = store._commit._sync
        store._commit._sync = clock.timed(_SYNC, sync)
    chosen = [rollout for slot in workload.slots for rollout in slot][:rollouts]
    cpu, puts = 0.0, 0
    for turn in range(shape.turns):
        for rollout_id, entries in chosen:
            entry = entries[turn]
            store.begin_call_now(rollout_id, entry.model_call_id)
            if clock is None:
                started = time.thread_time()
                store.append(entry)
                cpu += time.thread_time() - started
            else:
                cpu += clock.put(store, entry)
            puts += 1
    return cpu / puts * 1e6


@dataclass(frozen=True)
class PutProfile:
    """Thread CPU per put of the plain and the timed trials, and of every step of the timed ones (us)."""

    plain_us: list[float]
    timed_us: list[float]
    steps_us: dict[str, float]


def profile_puts(directory: Path, rollouts: int = 16, trials: int = 5) -> PutProfile:
    """Alternate plain and timed trials of sequential puts in stores under ``directory``."""
    clock = _Clock()
    plain: list[float] = []
    timed: list[float] = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory(dir=directory) as store_dir:
            plain.append(_run(Path(store_dir), rollouts, None))
        with _installed(clock), tempfile.TemporaryDirectory(dir=directory) as store_dir:
            timed.append(_run(Path(store_dir), rollouts, clock))
    puts = trials * rollouts * WorkloadShape().turns
    return PutProfile(plain, timed, {name: seconds / puts * 1e6 for name, seconds in clock.seconds.items()})


def main(argv: list[str] | None = None) -> None:
    """Print the table of microseconds per put per step for one directory's filesystem."""
    parser = argparse.ArgumentParser(prog="python -m bench.put_profile", description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="parent of the store")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts of the main load, 8 puts each")
    parser.add_argument("--trials", type=int, default=5, help="plain and timed runs, alternating")
    args = parser.parse_args(argv)
    result = profile_puts(args.dir, args.rollouts, args.trials)
    puts = args.rollouts * WorkloadShape().turns
    print(
        f"{args.dir}: {puts} puts per trial, {args.trials} plain and {args.trials} timed trials alternating"
    )
    for kind, figures in (("plain", result.plain_us), ("timed", result.timed_us)):
        listed = ", ".join(f"{us:.0f}" for us in figures)
        print(f"CPU per put, {kind}: median {statistics.median(figures):.0f} us ({listed})")
    print("| step | us per put |")
    print("| --- | ---: |")
    for name, us in sorted(result.steps_us.items(), key=lambda item: -item[1]):
        print(f"| {name} | {us:.1f} |")
    print(f"| sum (the timed trials' CPU per put) | {sum(result.steps_us.values()):.1f} |")


if __name__ == "__main__":
    main()
