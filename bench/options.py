"""What one benchmark run measures: workload shape, repeats and where the broker comes from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.scenarios import DEFAULT

__all__ = ["BenchOptions", "WorkloadShape"]


@dataclass(frozen=True)
class WorkloadShape:
    """The synthetic rollouts of one trial.

    ``rollouts`` run concurrently; each slot runs ``rounds`` rollouts one after another,
    so the freezes of all but the last round happen while the other slots are still writing.
    """

    rollouts: int = 64
    rounds: int = 2
    turns: int = 8
    prompt_tokens: int = 1000
    generated_tokens: int = 200
    tool_tokens: int = 100
    seed: int = 7

    @property
    def total_rollouts(self) -> int:
        """How many rollouts a trial writes and freezes."""
        return self.rollouts * self.rounds

    @property
    def total_puts(self) -> int:
        """How many entries a trial writes."""
        return self.total_rollouts * self.turns

    def label(self) -> str:
        """A short name for tables: turns and prompt size."""
        prompt = f"{self.prompt_tokens // 1000}k" if self.prompt_tokens >= 1000 else str(self.prompt_tokens)
        return f"{self.turns} turns, {prompt} prompt"


@dataclass(frozen=True)
class BenchOptions:
    """Everything the command line sets."""

    shape: WorkloadShape = field(default_factory=WorkloadShape)
    repeats: int = 3
    bootstrap: str | None = None
    growth_rollouts: int = 8
    growth_turns: tuple[int, ...] = (4, 16, 64)
    growth_prompts: tuple[int, ...] = (1000, 32000)
    work_dir: Path | None = None
    output: Path = Path("bench/results/latest.json")
    update_readme: bool = False
    only: tuple[str, ...] = DEFAULT
    batch_rollouts: int = 200
    workers_rollouts: int = 1000
    workers_turns: int = 8
    workers_trials: int = 3
    baseline: Path | None = None
    """Another checkout, for the scenarios that compare two trees."""
    straw: Path | None = None
    """Where straw-queue 0.1.6 is (or gets) installed; the staging scenario measures it only when given."""
    staging_calls: int = 320
    staging_images: int = 64
    staging_threads: int = 16
    senders: int = 64
    sends: int = 60
    long_rollouts: tuple[int, ...] = (1000, 2000)
    """resolve_long: calls of each long rollout."""
    long_samples: int = 40
    long_build_trials: int = 5
    intent_pairs: tuple[int, ...] = (1000, 2000, 4000)
    metrics_puts: int = 1000
    crash_kills: int = 4
    """journal_crash: trainer SIGKILLs per transport."""
    crash_steps: int = 12
    """journal_crash: trainer steps of the run the kills interrupt."""

    def growth_shapes(self) -> list[WorkloadShape]:
        """The growth grid: every turn count with every prompt size, fewer rollouts so long ones fit in memory."""
        return [
            replace(self.shape, rollouts=self.growth_rollouts, turns=turns, prompt_tokens=prompt)
            for prompt in self.growth_prompts
            for turns in self.growth_turns
        ]

    def to_json(self) -> dict[str, Any]:
        """The options as recorded beside the results."""
        data = asdict(self)
        data["work_dir"] = None if self.work_dir is None else str(self.work_dir)
        data["output"] = str(self.output)
        data["baseline"] = None if self.baseline is None else str(self.baseline)
        data["straw"] = None if self.straw is None else str(self.straw)
        return data
