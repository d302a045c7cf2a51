"""``tokcap demo``: a synthetic multi-turn agent workload, captured, built and retired end to end.

Each rollout is an agent conversation: a task prompt, then several model calls whose prompts grow by the
previous generation and the tool output that followed it.
Every call goes through the real capture path (``CaptureContext``, ``set_token_sink``,
``register_call_intent``, ``capture_tokens``), so the demo exercises what a model server runs.
A trainer then freezes, builds, masks and finalizes every rollout through ``tokcap.delivery`` and retires
exactly the snapshots it consumed.

With faults on (the default) four rollouts misbehave on purpose, one fault each:

- ``lost-call``: a call's server dies after dispatch; the agent retries, but the dangling intent masks the rollout.
- ``failed-write``: a sink write fails; the model call still succeeds and the rollout is marked incomplete.
- ``retry``: a request fails before generation (its intent is cancelled) and a sample is thrown away and
  redrawn; the builder resolves both, so the rollout still trains.
- ``late-write``: an attempt still running writes after the freeze; the write is rejected, the version moves,
  and the consumed snapshot is kept as evidence instead of being retired.

The workload is transport-agnostic: it runs here over the file store (no broker); a mounted transport runs
it over its own sinks and source (``tokcap demo --bootstrap``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokcap.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from tokcap.errors import InjectedFaultError, InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver
from tokcap.log.records import TokenEntry, strip_token_arrays
from tokcap.protocols import LineageResolver, TokenSource
from tokcap.sink import (
    CaptureContext,
    cancel_call_intent,
    capture_tokens,
    register_call_intent,
    reset_token_sink,
    resolve_parent,
    set_token_sink,
)

__all__ = [
    "FAULTS",
    "FAULT_FAILED_WRITE",
    "FAULT_LATE_WRITE",
    "FAULT_LOST_CALL",
    "FAULT_RETRY",
    "MODEL",
    "VOCABULARY",
    "CallSink",
    "DemoReport",
    "DemoSettings",
    "FaultySink",
    "ProgressCallback",
    "RolloutOutcome",
    "StoreDirectory",
    "fault_of",
    "rollout_id_of",
    "run_demo_over_files",
    "run_workload",
    "store_directory",
]

MODEL = "tokcap-demo-policy"
"""The model name every demo call reports."""

VOCABULARY = 151_000
"""Token ids are drawn below this, like a modern tokenizer's vocabulary."""

FAULT_LOST_CALL = "lost-call"
FAULT_FAILED_WRITE = "failed-write"
FAULT_RETRY = "retry"
FAULT_LATE_WRITE = "late-write"
FAULTS: tuple[str, ...] = (FAULT_LOST_CALL, FAULT_FAILED_WRITE, FAULT_RETRY, FAULT_LATE_WRITE)
"""Rollouts 1, 2, 3 and 4 get these faults, in this order, when faults are on."""


class CallSink(Protocol):
    """The sink surface the demo needs: the capture protocol plus intents and reasons."""

    async def put(self, entry: TokenEntry) -> None: ...

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class DemoSettings:
    """How big the workload is; every value is validated so a typo fails before anything runs."""

    rollouts: int = 64
    turns: int = 4
    prompt_tokens: int = 512
    generation_tokens: int = 64
    tool_tokens: int = 96
    concurrency: int = 32
    faults: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse sizes that cannot describe a workload."""
        for name in ("rollouts", "turns", "prompt_tokens", "generation_tokens", "concurrency"):
            value = getattr(self, name)
            if value < 1:
                raise InvalidInputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.tool_tokens < 0:
            raise InvalidInputError(f"--tool-tokens must be at least 0, got {self.tool_tokens}")


def rollout_id_of(index: int) -> str:
    """The demo's rollout ids sort in creation order: ``demo-00000``, ``demo-00001``, ..."""
    return f"demo-{index:05d}"


def fault_of(index: int, settings: DemoSettings) -> str | None:
    """The fault rollout ``index`` gets: rollouts 1 to 4 carry one each when faults are on."""
    if not settings.faults or not 1 <= index <= len(FAULTS):
        return None
    return FAULTS[index - 1]


class FaultySink:
    """Passes everything to a real sink except the puts it was told to fail, like a full disk would."""

    def __init__(self, inner: CallSink, failing_puts: set[tuple[str, str]]) -> None:
        self._inner = inner
        self._failing_puts = failing_puts

    async def put(self, entry: TokenEntry) -> None:
        """Fail the chosen puts with ``InjectedFaultError``; store every other entry."""
        if (entry.rollout_id, entry.model_call_id) in self._failing_puts:
            raise InjectedFaultError(
                f"demo: injected write failure for call {entry.model_call_id!r} of rollout {entry.rollout_id!r}",
                rollout_id=entry.rollout_id,
                model_call_id=entry.model_call_id,
            )
        await self._inner.put(entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Record the intent in the real sink."""
        await self._inner.begin_call(rollout_id, model_call_id)

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Close the intent in the real sink."""
        await self._inner.cancel_call(rollout_id, model_call_id)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "", reason: str = "") -> None:
        """Mark the rollout incomplete in the real sink; the capture path calls this after a failed put."""
        await self._inner.mark_incomplete(rollout_id, model_call_id, reason or "put failed (demo fault)")

    async def close(self) -> None:
        """The wrapped sink is closed by whoever opened it."""


@dataclass
class RolloutOutcome:
    """What happened to one rollout, from its first call to its retirement."""

    rollout_id: str
    fault: str | None
    calls_attempted: int = 0
    calls_captured: int = 0
    calls_lost: int = 0
    writes_failed: int = 0
    attempts_cancelled: int = 0
    samples_discarded: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    masked: bool = False
    mask_reasons: list[str] = field(default_factory=list)
    trained_tokens: int = 0
    snapshot_id: str | None = None
    version: int | None = None
    retired: bool = False
    late_write: str | None = None


@dataclass
class DemoReport:
    """The demo's summary; ``to_dict`` is what ``--json`` prints."""

    transport: str
    store_dir: str
    store_kept: bool
    settings: DemoSettings
    capture_seconds: float
    finalize_seconds: float
    rollouts: list[RolloutOutcome]
    topic: str | None = None
    bootstrap: str | None = None
    servers: int = 1

    def totals(self) -> dict[str, Any]:
        """Counts over every rollout, as the summary table shows them."""
        reasons: Counter[str] = Counter(reason for r in self.rollouts for reason in r.mask_reasons)
        captured_tokens = sum(r.prompt_tokens + r.generated_tokens for r in self.rollouts)
        calls = sum(r.calls_captured for r in self.rollouts)
        seconds = max(self.capture_seconds, 1e-9)
        return {
            "rollouts": len(self.rollouts),
            "trained": sum(not r.masked for r in self.rollouts),
            "masked": sum(r.masked for r in self.rollouts),
            "mask_reasons": dict(sorted(reasons.items())),
            "retired": sum(r.retired for r in self.rollouts),
            "kept_as_evidence": sum(not r.retired for r in self.rollouts),
            "calls_attempted": sum(r.calls_attempted for r in self.rollouts),
            "calls_captured": calls,
            "calls_lost": sum(r.calls_lost for r in self.rollouts),
            "writes_failed": sum(r.writes_failed for r in self.rollouts),
            "attempts_cancelled": sum(r.attempts_cancelled for r in self.rollouts),
            "samples_discarded": sum(r.samples_discarded for r in self.rollouts),
            "late_writes": sum(r.late_write is not None for r in self.rollouts),
            "prompt_tokens": sum(r.prompt_tokens for r in self.rollouts),
            "generated_tokens": sum(r.generated_tokens for r in self.rollouts),
            "trained_tokens": sum(r.trained_tokens for r in self.rollouts),
            "calls_per_second": calls / seconds,
            "tokens_per_second": captured_tokens / seconds,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything in the report as plain JSON values."""
        return {
            "transport": self.transport,
            "store_dir": self.store_dir,
            "store_kept": self.store_kept,
            "topic": self.topic,
            "bootstrap": self.bootstrap,
            "servers": self.servers,
            "settings": asdict(self.settings),
            "capture_seconds": self.capture_seconds,
            "finalize_seconds": self.finalize_seconds,
            "totals": self.totals(),
            "rollouts": [asdict(r) for r in self.rollouts],
        }


# ------------------------------------------------------------------ the agent


def _response(
    call_id: str, prompt: list[int], generation: list[int], log_probs: list[float]
) -> dict[str, Any]:
    """A Responses-API payload whose assistant message carries the token arrays, as a vLLM server returns it."""
    return {
        "id": f"resp_{call_id}",
        "object": "response",
        "model": MODEL,
        "output": [
            {
                "type": "message",
                "id": f"msg_{call_id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": f"step {call_id}", "annotations": []}],
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": log_probs,
            }
        ],
    }


class _Agent:
    """One rollout's conversation: its context grows by each kept generation and the tool output after it."""

    def __init__(
        self, index: int, settings: DemoSettings, sink: CallSink, lineage: LineageResolver | None = None
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.lineage = lineage
        # The messages the harness sends: the task, then each kept answer and the tool result after it.
        self.request: list[dict[str, Any]] = [{"role": "user", "content": f"demo task {index}"}]
        self.last_response: dict[str, Any] | None = None
        self.final_response: dict[str, Any] | None = None
        self.rng = random.Random(settings.seed * 1_000_003 + index)
        self.outcome = RolloutOutcome(rollout_id_of(index), fault_of(index, settings))
        self.context = self._tokens(settings.prompt_tokens)

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(VOCABULARY) for _ in range(count)]

    def _jittered(self, size: int) -> int:
        return max(1, self.rng.randint(size // 2, size + size // 2)) if size else 0

    async def call(self, call_id: str, kind: str = "generate") -> list[int] | None:
        """One model call through the capture path; return its generation, or ``None`` if it produced none.

        ``kind`` is ``generate`` (a normal call), ``cancel`` (the request fails before generation) or
        ``lost`` (the server dies after dispatch: nothing captures or cancels the call).
        """
        outcome = self.outcome
        context = CaptureContext(
            outcome.rollout_id, call_id, token_sink=self.sink, model=MODEL, lineage_store=self.lineage
        )
        token = set_token_sink(context)
        try:
            outcome.calls_attempted += 1
            await register_call_intent()
            await resolve_parent(copy.deepcopy(self.request))
            if kind == "cancel":
                await cancel_call_intent()
                outcome.attempts_cancelled += 1
                return None
            if kind == "lost":
                outcome.calls_lost += 1
                return None
            await asyncio.sleep(0)
            prompt = list(self.context)
            generation = self._tokens(self._jittered(self.settings.generation_tokens))
            log_probs = [round(-self.rng.expovariate(3.0), 6) for _ in generation]
            response = _response(call_id, prompt, generation, log_probs)
            self.last_response = response
            entry = await capture_tokens(response, copy.deepcopy(self.request))
            if entry is None:
                outcome.writes_failed += 1
            else:
                outcome.calls_captured += 1
                outcome.prompt_tokens += len(prompt)
                outcome.generated_tokens += len(generation)
            return generation
        finally:
            reset_token_sink(token)

    async def run(self) -> RolloutOutcome:
        """Play every turn, with this rollout's fault if it has one."""
        fault = self.outcome.fault
        for turn in range(self.settings.turns):
            call_id = f"turn-{turn}"
            if fault == FAULT_RETRY and turn == 0:
                await self.call(f"{call_id}-attempt-0", "cancel")
                await self.call(f"{call_id}-sample-0")
                self.outcome.samples_discarded += 1
                call_id = f"{call_id}-sample-1"
            if fault == FAULT_LOST_CALL and turn == min(1, self.settings.turns - 1):
                await self.call(f"{call_id}-lost", "lost")
                call_id = f"{call_id}-retry"
            generation = await self.call(call_id)
            if generation is not None and self.last_response is not None:
                self.context.extend(generation)
                self.context.extend(self._tokens(self._jittered(self.settings.tool_tokens)))
                # What the harness keeps: the answer without token arrays, echoed in the next request.
                kept = {
                    **self.last_response,
                    "output": [strip_token_arrays(item) for item in self.last_response["output"]],
                }
                self.final_response = kept
                self.request = [
                    *self.request,
                    *kept["output"],
                    {"role": "user", "content": f"tool output {turn}"},
                ]
        return self.outcome

    async def write_late(self) -> None:
        """An attempt that was still running writes after the freeze; record what its sink said.

        The late call counts as attempted but never as captured: the snapshot was cut before it.
        """
        outcome = self.outcome
        counted = (
            outcome.calls_captured,
            outcome.prompt_tokens,
            outcome.generated_tokens,
            outcome.writes_failed,
        )
        try:
            await self.call("straggler")
        except Exception as exc:
            outcome.late_write = f"intent refused at once ({type(exc).__name__})"
        else:
            refused = outcome.writes_failed > counted[3]
            outcome.late_write = (
                "write refused at once; capture marked the rollout incomplete"
                if refused
                else "acknowledged by the sink; the log order decides"
            )
        outcome.calls_captured, outcome.prompt_tokens, outcome.generated_tokens, outcome.writes_failed = (
            counted
        )


# ------------------------------------------------------------ the whole run


async def _finalize(agent: _Agent, source: TokenSource) -> None:
    """The trainer's side: freeze, build, mask, finalize the record, then retire what was consumed."""
    outcome = agent.outcome
    # The response the verifier scored is the last kept answer; it names the chain to deliver.
    scored = copy.deepcopy(agent.final_response) if agent.final_response is not None else {"output": []}
    record: dict[str, Any] = {"rollout_id": outcome.rollout_id, "reward": 1.0, "response": scored}
    result = await finalize_rollout_token_capture(record, source)
    outcome.masked = result.masked
    outcome.mask_reasons = list(result.mask_reasons)
    outcome.snapshot_id = result.snapshot_id
    outcome.version = result.version
    if result.response is not None:
        outcome.trained_tokens = int(result.response["usage"]["total_tokens"])
    if outcome.fault == FAULT_LATE_WRITE:
        await agent.write_late()
    outcome.retired = await retire_rollout_token_capture(outcome.rollout_id, source, result)


ProgressCallback = Callable[[str], None]
"""Called with ``"captured"`` or ``"finalized"`` each time a rollout finishes that phase."""


async def run_workload(
    settings: DemoSettings,
    sink_for: Callable[[int], CallSink],
    source: TokenSource,
    on_progress: ProgressCallback | None = None,
    lineage_for: Callable[[int], LineageResolver | None] | None = None,
) -> tuple[list[RolloutOutcome], float, float]:
    """Run every rollout concurrently, then finalize them all; return outcomes and the two phases' seconds.

    ``sink_for(index)`` picks the sink ("model server") that serves rollout ``index``.
    """
    notify = on_progress or (lambda phase: None)
    limit = asyncio.Semaphore(settings.concurrency)
    agents: list[_Agent] = []
    for index in range(settings.rollouts):
        sink = sink_for(index)
        if fault_of(index, settings) == FAULT_FAILED_WRITE:
            failing_turn = min(1, settings.turns - 1)
            sink = FaultySink(sink, {(rollout_id_of(index), f"turn-{failing_turn}")})
        agents.append(_Agent(index, settings, sink, lineage_for(index) if lineage_for is not None else None))

    async def bounded(step: Awaitable[Any], phase: str) -> None:
        async with limit:
            await step
        notify(phase)

    started = time.perf_counter()
    await asyncio.gather(*(bounded(agent.run(), "captured") for agent in agents))
    captured = time.perf_counter()
    await asyncio.gather(*(bounded(_finalize(agent, source), "finalized") for agent in agents))
    finished = time.perf_counter()
    return [agent.outcome for agent in agents], captured - started, finished - captured


@dataclass
class StoreDirectory:
    """Where the demo's store lives: a directory the user named, or a fresh temporary one."""

    path: Path
    keep: bool

    @classmethod
    def prepare(cls, directory: Path | None, keep: bool) -> StoreDirectory:
        """Use ``directory`` if it is absent or empty (and keep it), else a new temporary directory.

        Raise ``InvalidInputError`` for a directory that already holds files, so no earlier run is mixed in.
        """
        if directory is None:
            return cls(Path(tempfile.mkdtemp(prefix="tokcap-demo-")), keep)
        if directory.exists() and not directory.is_dir():
            raise InvalidInputError(f"--dir {directory} exists and is not a directory")
        if directory.is_dir() and any(directory.iterdir()):
            raise InvalidInputError(f"--dir {directory} is not empty; the demo needs a fresh store directory")
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory, True)

    def finish(self) -> None:
        """Remove a temporary directory nobody asked to keep."""
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def store_directory(directory: Path | None, keep: bool) -> Iterator[StoreDirectory]:
    """The demo's store directory for the length of the block, removed afterwards unless it is kept."""
    store_dir = StoreDirectory.prepare(directory, keep)
    try:
        yield store_dir
    finally:
        store_dir.finish()


def run_demo_over_files(
    settings: DemoSettings,
    directory: Path | None = None,
    keep: bool = False,
    on_progress: ProgressCallback | None = None,
) -> DemoReport:
    """The workload over the file store, which is both the sink and the source."""
    with store_directory(directory, keep) as store_dir:

        async def run() -> tuple[list[RolloutOutcome], float, float]:
            store = TokenCaptureStore(store_dir.path)
            lineage = FileLineageResolver(store_dir.path)
            try:
                return await run_workload(
                    settings, lambda index: store, store, on_progress, lambda index: lineage
                )
            finally:
                await lineage.close()
                await store.close()

        outcomes, capture_s, finalize_s = asyncio.run(run())
        return DemoReport(
            transport="file",
            store_dir=str(store_dir.path),
            store_kept=store_dir.keep,
            settings=settings,
            capture_seconds=capture_s,
            finalize_seconds=finalize_s,
            rollouts=outcomes,
        )
