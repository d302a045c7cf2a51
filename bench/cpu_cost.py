"""CPU time per file-store call, measured one call at a time: the ceiling concurrency cannot beat.

Python runs one thread at a time (the GIL), so the store's put rate under any concurrency is bounded by
one core divided by the CPU time of an intent plus a put. The sync itself runs outside the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.load import PreparedWorkload
from tokcap.files.store import TokenCaptureStore

__all__ = ["CallCosts", "measure_call_costs"]


@dataclass(frozen=True)
class CallCosts:
    """Thread CPU time and wall time per call kind, in microseconds, from a sequential run."""

    intent_cpu_us: float
    put_cpu_us: float
    freeze_cpu_us: float
    intent_wall_us: float
    put_wall_us: float
    freeze_wall_us: float

    @property
    def cpu_bound_puts_per_s(self) -> float:
        """Puts per second one core could sustain if it did nothing but intents and puts."""
        return 1e6 / (self.intent_cpu_us + self.put_cpu_us)


def measure_call_costs(workload: PreparedWorkload, directory: Path, rollouts: int = 16) -> CallCosts:
    """Run the first ``rollouts`` rollouts turn by turn from one thread, timing each call kind."""
    store = TokenCaptureStore(directory)
    chosen = [rollout for slot in workload.slots for rollout in slot][:rollouts]
    cpu = {"intent": 0.0, "put": 0.0, "freeze": 0.0}
    wall = {"intent": 0.0, "put": 0.0, "freeze": 0.0}
    counts = {"intent": 0, "put": 0, "freeze": 0}

    def timed(kind: str, call: Callable[..., object], *args: object) -> None:
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        call(*args)
        cpu[kind] += time.thread_time() - started_cpu
        wall[kind] += time.perf_counter() - started_wall
        counts[kind] += 1

    for turn in range(workload.shape.turns):
        for rollout_id, entries in chosen:
            entry = entries[turn]
            timed("intent", store.begin_call_now, rollout_id, entry.model_call_id)
            timed("put", store.append, entry)
    for rollout_id, _ in chosen:
        timed("freeze", store.freeze_now, rollout_id)

    def per_call(totals: dict[str, float], kind: str) -> float:
        return totals[kind] / counts[kind] * 1e6

    return CallCosts(
        intent_cpu_us=per_call(cpu, "intent"),
        put_cpu_us=per_call(cpu, "put"),
        freeze_cpu_us=per_call(cpu, "freeze"),
        intent_wall_us=per_call(wall, "intent"),
        put_wall_us=per_call(wall, "put"),
        freeze_wall_us=per_call(wall, "freeze"),
    )
