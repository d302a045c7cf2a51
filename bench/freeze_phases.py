"""Where a Kafka freeze's time goes under the main load: the produce round trip, the read, the answer, the wake.

    python -m bench.freeze_phases --bootstrap 127.0.0.1:9092 [--trials 3] [--rollouts 64]

The main table's Kafka freeze p99 is one number. This runs the same in-process shape (the load's sinks, and a
source whose materializer answers freezes ahead of their rollouts' backlog, in one process) and times each
freeze in four phases:

- ``ack``: from the call until the broker acknowledged the freeze event (acks=all);
- ``read``: from the call until the materializer routed the freeze and began its answer;
- ``answer``: the answer's own wall time, and the CPU time the materializer thread spent on it; what the
  wall adds to the CPU is time the thread waited for Python's interpreter lock;
- ``wake``: from the later of the acknowledgement and the answer until the caller had its snapshot back.

Every phase is measured on the freezes started while puts were still running (the figure the target is about).
``answers_wall_ms`` and ``answers_cpu_ms`` add each answer's wall and CPU time over those freezes: a round of
rollouts ends in lockstep, so its freezes are answered one after another, and the last one waits for all of them.
Each trial runs in a fresh interpreter with its own topic; the medians over trials are printed last.

The tracer wraps two private methods of one source (its producer bridge's ``send`` and its materializer's
``_answer_ahead``) on that instance only; a test runs this command against a real broker, so a rename fails it.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kafka_trial import KafkaTarget
from bench.load import LoadResult, PreparedWorkload, drive
from bench.stats import percentile
from tokcap.protocols import TokenCaptureSnapshot
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource

__all__ = ["FreezePhases", "PhaseTracer", "main", "run_traced_load"]

_FIGURES = (
    "freeze_p50_ms",
    "freeze_p99_ms",
    "ack_p50_ms",
    "ack_p99_ms",
    "read_p50_ms",
    "read_p99_ms",
    "answer_wall_p50_ms",
    "answer_cpu_p50_ms",
    "answers_wall_ms",
    "answers_cpu_ms",
    "wake_p50_ms",
    "wake_p99_ms",
    "answered_ahead",
    "freezes",
)

_freezing: contextvars.ContextVar[str | None] = contextvars.ContextVar("freezing", default=None)
"""The rollout the current task is freezing, so the traced ``send`` knows whose acknowledgement it saw."""


@dataclass
class _Answer:
    """What the materializer thread saw of one freeze: when it began the answer, when it ended, its CPU time."""

    began: float
    ended: float
    cpu_s: float


@dataclass
class _Call:
    """What the caller's event loop saw of one freeze."""

    sent: float
    acknowledged: float | None = None
    returned: float | None = None


@dataclass
class FreezePhases:
    """Per freeze started under load, each phase in milliseconds (only freezes answered ahead have ``read``)."""

    total_ms: list[float] = field(default_factory=list)
    ack_ms: list[float] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)
    answer_wall_ms: list[float] = field(default_factory=list)
    answer_cpu_ms: list[float] = field(default_factory=list)
    wake_ms: list[float] = field(default_factory=list)
    freezes: int = 0

    def figures(self) -> dict[str, float]:
        """The trial's figures: percentiles per phase and the answers' summed wall and CPU time."""
        if not self.total_ms:
            raise ValueError("no freeze started under load; use more rollouts or rounds")
        answered = bool(self.answer_wall_ms)
        return {
            "freeze_p50_ms": percentile(self.total_ms, 0.50),
            "freeze_p99_ms": percentile(self.total_ms, 0.99),
            "ack_p50_ms": percentile(self.ack_ms, 0.50),
            "ack_p99_ms": percentile(self.ack_ms, 0.99),
            "read_p50_ms": percentile(self.read_ms, 0.50) if answered else 0.0,
            "read_p99_ms": percentile(self.read_ms, 0.99) if answered else 0.0,
            "answer_wall_p50_ms": percentile(self.answer_wall_ms, 0.50) if answered else 0.0,
            "answer_cpu_p50_ms": percentile(self.answer_cpu_ms, 0.50) if answered else 0.0,
            "answers_wall_ms": sum(self.answer_wall_ms),
            "answers_cpu_ms": sum(self.answer_cpu_ms),
            "wake_p50_ms": percentile(self.wake_ms, 0.50),
            "wake_p99_ms": percentile(self.wake_ms, 0.99),
            "answered_ahead": float(len(self.answer_wall_ms)),
            "freezes": float(self.freezes),
        }


class PhaseTracer:
    """Times every freeze of one in-process source, from the caller's side and the materializer's."""

    def __init__(self, source: KafkaTokenSource) -> None:
        self._calls: dict[str, _Call] = {}
        """Written on the caller's event loop only."""
        self._answers: dict[str, _Answer] = {}
        """Written on the materializer thread only."""
        self._wrap_send(source)
        self._wrap_answer(source)

    def _wrap_send(self, source: KafkaTokenSource) -> None:
        bridge = source._bridge
        send = bridge.send

        async def traced_send(topic: str, messages: Sequence[Any], *, what: str) -> Any:
            delivered = await send(topic, messages, what=what)
            rollout_id = _freezing.get()
            if what == "freeze" and rollout_id is not None:
                self._calls[rollout_id].acknowledged = time.perf_counter()
            return delivered

        bridge.send = traced_send  # type: ignore[method-assign]

    def _wrap_answer(self, source: KafkaTokenSource) -> None:
        from transports.kafka.schedule import rollout_of

        materializer = source.materializer
        answer: Callable[[int, Any, int], None] = materializer._answer_ahead

        def traced_answer(partition: int, read: Any, index: int) -> None:
            began, cpu_began = time.perf_counter(), time.thread_time()
            answer(partition, read, index)
            rollout_id = rollout_of(read.routed[index])
            if read.answered_ahead and rollout_id is not None:
                self._answers[rollout_id] = _Answer(
                    began, time.perf_counter(), time.thread_time() - cpu_began
                )

        materializer._answer_ahead = traced_answer  # type: ignore[method-assign]

    async def freeze(self, source: KafkaTokenSource, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze through ``source``, noting when the call began and when it returned."""
        call = self._calls[rollout_id] = _Call(time.perf_counter())
        token = _freezing.set(rollout_id)
        try:
            return await source.freeze(rollout_id)
        finally:
            _freezing.reset(token)
            call.returned = time.perf_counter()

    def phases(self, puts_done_at: float) -> FreezePhases:
        """The phases of the freezes sent before ``puts_done_at`` (``time.perf_counter``)."""
        phases = FreezePhases(freezes=len(self._calls))
        for rollout_id, call in self._calls.items():
            if call.sent >= puts_done_at:
                continue
            if call.acknowledged is None or call.returned is None:
                raise ValueError(f"freeze of {rollout_id} was not acknowledged or did not return")
            phases.total_ms.append((call.returned - call.sent) * 1e3)
            phases.ack_ms.append((call.acknowledged - call.sent) * 1e3)
            ready = call.acknowledged
            answer = self._answers.get(rollout_id)
            if answer is not None:
                phases.read_ms.append((answer.began - call.sent) * 1e3)
                phases.answer_wall_ms.append((answer.ended - answer.began) * 1e3)
                phases.answer_cpu_ms.append(answer.cpu_s * 1e3)
                ready = max(ready, answer.ended)
            phases.wake_ms.append(max(0.0, call.returned - ready) * 1e3)
        return phases


class _TracedTarget(KafkaTarget):
    """The load's view of the Kafka path, with every freeze going through the tracer."""

    def __init__(self, sink: KafkaTokenSink, source: KafkaTokenSource, tracer: PhaseTracer) -> None:
        super().__init__(sink, source)
        self._tracer = tracer

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze through the source, timed by the tracer."""
        return await self._tracer.freeze(self._source, rollout_id)


async def run_traced_load(
    workload: PreparedWorkload, bootstrap: str, directory: Path
) -> tuple[LoadResult, FreezePhases]:
    """Drive the Kafka main load through a fresh topic with every freeze traced; delete the topic after."""
    from bench.kafka_trial import delete_topic, warm_up_broker
    from transports.kafka.topics import ensure_topic

    await warm_up_broker(bootstrap)
    topic = f"tokcap.bench-phases-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    puts_done_at: list[float] = []
    try:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        source = KafkaTokenSource(bootstrap_servers=bootstrap, store_dir=directory / "live", topic=topic)
        try:
            tracer = PhaseTracer(source)
            load = await drive(
                workload,
                _TracedTarget(sink, source, tracer),
                lambda: puts_done_at.append(time.perf_counter()),
            )
        finally:
            await sink.close()
            await source.close()
    finally:
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return load, tracer.phases(puts_done_at[0])


async def _trial(directory: Path, rollouts: int, bootstrap: str) -> dict[str, float]:
    """One traced trial of the main shape in this interpreter."""
    from bench.load import prepare
    from bench.options import WorkloadShape

    workload = prepare(WorkloadShape(rollouts=rollouts), f"phases{uuid.uuid4().hex[:6]}")
    _, phases = await run_traced_load(workload, bootstrap, directory)
    return phases.figures()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the traced trials, each in a fresh interpreter; print every trial and the medians."""
    from bench.alternating import REPO, ab_parser, alternate_arms

    parser = ab_parser(
        "python -m bench.freeze_phases", __doc__, trials=3, kafka=True, load=True, baseline=False
    )
    args = parser.parse_args(argv)
    if args.trials < 1 or args.rollouts < 1:
        parser.error("--trials and --rollouts must be 1 or more")
    arms = {"kafka": (REPO, [args.rollouts, args.bootstrap])}
    alternate_arms(Path(__file__).resolve(), arms, args.trials, _FIGURES, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
