"""The file-store main load, this checkout against another one, trials alternating, Gym 0.7.0's store beside each.

    python -m bench.file_store_ab --baseline /var/tmp/base [--trials 5] [--dir /var/tmp]

``git worktree add /var/tmp/base <rev>`` makes the baseline. Each trial runs in its own process with the
tree's ``tokcap`` and ``bench`` first on ``sys.path`` (the baseline needs ``bench.load``,
``bench.file_store_trial`` and ``bench.batch_freeze.load_gym_store``, as every tree since the batch section
has). Gym's store drives the main load first (the anchor), then the tree's ``TokenCaptureStore``, both into
fresh directories that are removed only after the last trial (ext4 charges a removal of thousands of files to
the creates of the next half minute). The trees alternate, so a slow stretch of the machine hits both. It
prints each trial's figures and the medians per tree: put/s, put/s over Gym's in the same trial, freeze p50 and
p99 under load, puts per filesystem sync, and the process CPU of the tokcap load.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["gym_anchor", "load_figures", "main", "run_trial"]

_FIGURES = ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "puts_per_sync", "cpu_s")


async def gym_anchor(workload: Any, directory: Path) -> Any:
    """Gym 0.7.0's own store driven by the main load on the same entries: the anchor of a trial."""
    from bench.batch_freeze import load_gym_store
    from bench.load import drive

    gym_store_class, gym_entry_class = load_gym_store()
    # Written out here rather than shared with bench.suite: a baseline tree older than any shared helper runs this.
    gym_workload = replace(
        workload,
        slots=[
            [
                (rid, [gym_entry_class.model_validate(e.model_dump()) for e in entries])
                for rid, entries in slot
            ]
            for slot in workload.slots
        ],
    )
    gym_store = gym_store_class(directory)
    try:
        return await drive(gym_workload, gym_store)
    finally:
        await gym_store.close()


async def _trial(directory: Path, rollouts: int) -> dict[str, float]:
    """One trial in this process: Gym's store, then tokcap's, on the same prepared entries."""
    from bench.file_store_trial import run_file_store_trial
    from bench.load import prepare
    from bench.options import WorkloadShape

    workload = prepare(WorkloadShape(rollouts=rollouts), "ab")
    gym_load = await gym_anchor(workload, directory / "gym")
    started = time.process_time()
    trial = await run_file_store_trial(workload, directory / "tokcap")
    cpu = time.process_time() - started
    return {**load_figures(trial.load, gym_load), "puts_per_sync": trial.puts_per_sync, "cpu_s": cpu}


def load_figures(load: Any, gym_load: Any) -> dict[str, float]:
    """The main load's figures every A/B trial prints: put/s, put/s over Gym's, freeze p50 and p99 under load."""
    from bench.stats import percentile

    freezes = load.freeze_under_load_ms
    return {
        "puts_per_s": load.puts_per_s,
        "vs_gym": load.puts_per_s / gym_load.puts_per_s,
        "freeze_p50_ms": percentile(freezes, 0.50),
        "freeze_p99_ms": percentile(freezes, 0.99),
    }


def run_trial(tree: Path, directory: Path, rollouts: int = 64) -> dict[str, float]:
    """Run one trial of ``tree`` in a fresh interpreter; return its figures."""
    # Imported here, not at the top: a trial runs this file against a tree that may predate the module.
    from bench.alternating import run_trial_file

    return run_trial_file(Path(__file__).resolve(), tree, directory, [int(rollouts)])


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from bench.alternating import ab_parser

    return ab_parser("python -m bench.file_store_ab", __doc__, trials=5, kafka=False, load=True).parse_args(
        argv
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating trials and print every trial and the medians per tree."""
    from bench.alternating import run_against_baseline

    args = _parse_args(argv)
    trial_file = Path(__file__).resolve()
    return run_against_baseline(
        trial_file, args.baseline, "tokcap", args.trials, [args.rollouts], _FIGURES, args.dir
    )


if __name__ == "__main__":
    sys.exit(main())
