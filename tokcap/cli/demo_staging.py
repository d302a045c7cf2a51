"""``tokcap demo --engine-side``: the demo workload staged by inference workers, on the file store.

Each rollout is the same agent conversation as the default demo, but its token arrays never reach the model
server: a worker thread stages each call's delta through ``FileStagingSink`` before it answers, the model
server records a token-free row through the file ``CaptureLedger``, and a trainer reads the manifest,
fetches the staged rows through ``FileStagingSource`` and turns the rollout into one verified row or a
masked placeholder (``finalize_rollout``). Trained rollouts are retired; masked ones are kept as evidence,
for ``tokcap inspect`` to show.

With faults on, four rollouts misbehave, one fault each:

- ``lost-call``: a worker dies after staging a call but before answering; the model server records a
  failure row, which masks the rollout.
- ``failed-write``: a stage fails (as a full disk would); the model server records ``capture_failed`` and the
  rollout is masked.
- ``retry``: a worker stages a call twice (a retried completion) and the ledger row is recorded twice; both
  repeats are no-ops, so the rollout still trains.
- ``late-write``: a worker stages one more call after the trainer retired the rollout; the retire fence
  refuses it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokcap.cli.demo import (
    FAULT_FAILED_WRITE,
    FAULT_LATE_WRITE,
    FAULT_LOST_CALL,
    FAULT_RETRY,
    VOCABULARY,
    DemoReport,
    DemoSettings,
    ProgressCallback,
    RolloutOutcome,
    StoreDirectory,
    fault_of,
    rollout_id_of,
)
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource, finalize_rollout
from tokcap.staging.example_calls import ExampleCall, commit_of, staged_record

__all__ = ["run_staging_demo_over_files"]


def _sizes(rng: random.Random, settings: DemoSettings, number: int) -> tuple[int, int]:
    """New prompt tokens and generated tokens of a call: the task prompt first, then tool output."""
    prompt = (
        settings.prompt_tokens if number == 0 else max(1, int(settings.tool_tokens * rng.uniform(0.5, 1.5)))
    )
    return prompt, max(1, int(settings.generation_tokens * rng.uniform(0.5, 1.5)))


def _calls(index: int, settings: DemoSettings) -> list[ExampleCall]:
    """The rollout's staged calls: a text root, then token-in continuations of the whole history."""
    rng = random.Random(settings.seed * 1_000_003 + index)
    rollout_id = rollout_id_of(index)
    calls: list[ExampleCall] = []
    history: list[dict[str, Any]] = []
    for number in range(settings.turns):
        prompt_size, generated_size = _sizes(rng, settings, number)
        prompt = [rng.randrange(VOCABULARY) for _ in range(prompt_size)]
        generated = [rng.randrange(VOCABULARY) for _ in range(generated_size)]
        history = [*history, {"role": "user", "content": f"{rollout_id} step {number}"}]
        parent = calls[-1] if calls else None
        record, tokens = staged_record(rollout_id, f"call-{number}", prompt, generated, parent)
        call = ExampleCall(record, tokens, list(history), f"{rollout_id} answer {number}")
        calls.append(call)
        history = [*history, *call.response]
    return calls


class _Worker:
    """One rollout served engine-side: stage, then record, call after call."""

    def __init__(
        self, index: int, settings: DemoSettings, sink: FileStagingSink, ledger: FileLineageResolver
    ) -> None:
        self.fault = fault_of(index, settings)
        self.calls = _calls(index, settings)
        self.sink, self.ledger = sink, ledger
        self.outcome = RolloutOutcome(rollout_id=rollout_id_of(index), fault=self.fault)

    def run(self) -> RolloutOutcome:
        outcome, chain = self.outcome, list[str]()
        for number, call in enumerate(self.calls):
            outcome.calls_attempted += 1
            record = call.record
            failed = self.fault == FAULT_FAILED_WRITE and number == len(self.calls) // 2
            result = None if failed else self.sink.stage(record)
            if result is None or not result.ok:
                outcome.writes_failed += 1
                self.ledger.record_failure_now(record.rollout_id, record.model_call_id, "capture_failed")
                continue
            if self.fault == FAULT_RETRY and number == 1:
                outcome.samples_discarded += int(not self.sink.stage(record).ok)
            outcome.calls_captured += 1
            outcome.prompt_tokens += sum(mask == 0.0 for mask in record.token_mask_delta)
            outcome.generated_tokens += sum(mask == 1.0 for mask in record.token_mask_delta)
            if self.fault == FAULT_LOST_CALL and number == len(self.calls) - 1:
                outcome.calls_lost += 1
                self.ledger.record_failure_now(record.rollout_id, record.model_call_id, "worker_died")
                continue
            commit = commit_of(call, chain)
            self.ledger.record_now(commit)
            if self.fault == FAULT_RETRY:
                self.ledger.record_now(commit)
            chain.append(call.key)
        return outcome

    def finalize(self, source: FileStagingSource) -> None:
        """The trainer's side: manifest, fetch, verify and linearize or mask, then retire."""
        outcome = self.outcome
        rollout_id = outcome.rollout_id
        done = finalize_rollout(self.ledger.manifest_now(rollout_id), source)
        outcome.masked = done.masked
        outcome.mask_reasons = [] if done.masked_reason is None else [done.masked_reason]
        outcome.trained_tokens = 0 if done.row is None else len(done.row.token_ids)
        if not done.masked:
            outcome.retired = rollout_id in asyncio.run(self.ledger.retire([rollout_id]))["removed"]
        if self.fault == FAULT_LATE_WRITE:
            record, _ = staged_record(rollout_id, "straggler", [1, 2], [3, 4], None)
            result = self.sink.stage(record)
            outcome.late_write = (
                f"stage refused: {result.error}" if not result.ok else "acknowledged after the retire"
            )


def run_staging_demo_over_files(
    settings: DemoSettings,
    directory: Path | None = None,
    keep: bool = False,
    on_progress: ProgressCallback | None = None,
) -> DemoReport:
    """The workload staged engine-side into a file store, recorded in its ledger, finalized and retired."""
    store_dir = StoreDirectory.prepare(directory, keep)
    try:
        sink, ledger = FileStagingSink(store_dir.path), FileLineageResolver(store_dir.path)
        source = FileStagingSource(store_dir.path)
        workers = [_Worker(index, settings, sink, ledger) for index in range(settings.rollouts)]
        progress: Callable[[str], None] = on_progress or (lambda phase: None)

        def serve(worker: _Worker) -> None:
            worker.run()
            progress("captured")

        def train(worker: _Worker) -> None:
            worker.finalize(source)
            progress("finalized")

        with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
            started = time.perf_counter()
            list(pool.map(serve, workers))
            capture_s = time.perf_counter() - started
            started = time.perf_counter()
            list(pool.map(train, workers))
            finalize_s = time.perf_counter() - started
        return DemoReport(
            transport="file-staging",
            store_dir=str(store_dir.path),
            store_kept=store_dir.keep,
            settings=settings,
            capture_seconds=capture_s,
            finalize_seconds=finalize_s,
            rollouts=[worker.outcome for worker in workers],
        )
    finally:
        store_dir.finish()
