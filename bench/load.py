"""The capture load: N concurrent rollouts, each awaiting its intent and put per turn, then its freeze.

The same driver runs against the file store and against the Kafka sink and source, so the two are
measured on the same entries in the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.options import WorkloadShape
from bench.workload import rollouts_of, tokens_of
from tokcap.log.records import TokenEntry

__all__ = [
    "BenchmarkCheckError",
    "CaptureTarget",
    "FrozenRollout",
    "LoadResult",
    "PreparedWorkload",
    "drive",
    "prepare",
]


class BenchmarkCheckError(RuntimeError):
    """A snapshot did not hold what the load wrote; the figures of such a run would be meaningless."""


class FrozenRollout(Protocol):
    """What the load checks of a freeze's answer: one entry per call written, nothing masked."""

    @property
    def entries(self) -> Sequence[object]: ...

    @property
    def incomplete(self) -> bool: ...


class CaptureTarget(Protocol):
    """What the load calls: the capture side and the freeze side of one transport."""

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    async def put(self, entry: TokenEntry) -> None: ...

    async def freeze(self, rollout_id: str) -> FrozenRollout: ...


@dataclass(frozen=True)
class PreparedWorkload:
    """Every entry of a trial, built before the clock starts, per slot and rollout."""

    shape: WorkloadShape
    slots: list[list[tuple[str, list[TokenEntry]]]]
    puts: int
    tokens: int
    generated_tokens: int


def prepare(shape: WorkloadShape, prefix: str) -> PreparedWorkload:
    """Build a trial's entries up front, so generating tokens never competes with the transport."""
    slots: list[list[tuple[str, list[TokenEntry]]]] = []
    puts = tokens = generated = 0
    for slot in rollouts_of(shape, prefix):
        prepared_slot = []
        for rollout in slot:
            entries = list(rollout.entries())
            puts += len(entries)
            tokens += sum(tokens_of(entry) for entry in entries)
            generated += sum(len(entry.generation_token_ids) for entry in entries)
            prepared_slot.append((rollout.rollout_id, entries))
        slots.append(prepared_slot)
    return PreparedWorkload(shape, slots, puts, tokens, generated)


@dataclass
class LoadResult:
    """Wall time of the load and the freeze latencies seen under it."""

    seconds: float = 0.0
    puts: int = 0
    calls: int = 0
    generated_tokens: int = 0
    tokens: int = 0
    freeze_under_load_ms: list[float] = field(default_factory=list)
    freeze_after_load_ms: list[float] = field(default_factory=list)

    @property
    def puts_per_s(self) -> float:
        """Put calls completed per second of wall time."""
        return self.puts / self.seconds

    @property
    def calls_per_s(self) -> float:
        """Intent and put calls completed per second of wall time."""
        return self.calls / self.seconds

    @property
    def generated_tokens_per_s(self) -> float:
        """Generated tokens captured per second of wall time."""
        return self.generated_tokens / self.seconds


async def drive(
    workload: PreparedWorkload, target: CaptureTarget, on_puts_done: Callable[[], None] | None = None
) -> LoadResult:
    """Run every slot concurrently; freezes run beside the load, as a trainer freezes while agents keep going.

    A slot hands its finished rollout to a freeze task and starts the next rollout at once.
    ``on_puts_done`` runs in a thread when the last put has returned, while the remaining freezes complete.
    Put throughput is counted until the last put returns; a freeze is under load when it starts before that.
    """
    result = LoadResult()
    puts_done = False
    freezes: list[asyncio.Task[None]] = []

    async def freeze(rollout_id: str, written: int) -> None:
        under_load = not puts_done
        started = time.perf_counter()
        snapshot = await target.freeze(rollout_id)
        latency_ms = (time.perf_counter() - started) * 1000.0
        (result.freeze_under_load_ms if under_load else result.freeze_after_load_ms).append(latency_ms)
        if len(snapshot.entries) != written or snapshot.incomplete:
            raise BenchmarkCheckError(
                f"snapshot of {rollout_id} holds {len(snapshot.entries)} entries (incomplete="
                f"{snapshot.incomplete}), but {written} were written; the transport lost or masked a turn"
            )

    async def run_slot(rollouts: list[tuple[str, list[TokenEntry]]]) -> None:
        for rollout_id, entries in rollouts:
            for entry in entries:
                await target.begin_call(rollout_id, entry.model_call_id)
                await target.put(entry)
                result.puts += 1
                result.calls += 2
                result.generated_tokens += len(entry.generation_token_ids)
                result.tokens += tokens_of(entry)
            freezes.append(asyncio.create_task(freeze(rollout_id, len(entries))))

    started = time.perf_counter()
    await asyncio.gather(*(run_slot(slot) for slot in workload.slots))
    result.seconds = time.perf_counter() - started
    puts_done = True
    if on_puts_done is not None:
        await asyncio.to_thread(on_puts_done)
    await asyncio.gather(*freezes)
    return result
