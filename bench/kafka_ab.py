"""The Kafka main load, this checkout against another one, trials alternating, Gym 0.7.0's store beside each.

    python -m bench.kafka_ab --baseline /var/tmp/base --bootstrap 127.0.0.1:9092 [--trials 5] [--dir /var/tmp]

``git worktree add /var/tmp/base <rev>`` makes the baseline; ``scripts/kafka_broker.py start`` gives a local
broker. Each trial runs in its own process with the tree's ``tokcap``, ``transports`` and ``bench`` first on
``sys.path`` (``bench.alternating``): Gym's store drives the main load first (the anchor), then the tree's Kafka
sink and source with their in-process materializer on a fresh topic, as the main table's Kafka column; then the
topic is replayed. It prints each trial's figures and the medians per tree: put/s, put/s over Gym's in the same
trial, freeze p50 and p99 under load, replayed entries per second, and the live materializer's backlog when the
last put returned.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_FIGURES = ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "replay_per_s", "backlog")


async def _trial(directory: Path, rollouts: int, bootstrap: str) -> dict[str, float]:
    """One trial in this process: Gym's store, then tokcap over Kafka, on the same prepared entries."""
    from bench.kafka_trial import run_kafka_trial
    from bench.load import prepare
    from bench.options import WorkloadShape

    # The anchor and the shared figures are this checkout's, read from its file: the baseline may predate them.
    file_store_ab = runpy.run_path(str(Path(__file__).with_name("file_store_ab.py")))
    workload = prepare(WorkloadShape(rollouts=rollouts), "ab")
    gym_load = await file_store_ab["gym_anchor"](workload, directory / "gym")
    trial = await run_kafka_trial(workload, bootstrap, directory / "tokcap")
    figures: dict[str, float] = file_store_ab["load_figures"](trial.load, gym_load)
    return {**figures, "replay_per_s": trial.replay.puts_per_s, "backlog": float(trial.lag_at_end_of_puts)}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from bench.alternating import ab_parser

    return ab_parser("python -m bench.kafka_ab", __doc__, trials=5, kafka=True, load=True).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating trials and print every trial and the medians per tree."""
    from bench.alternating import run_against_baseline

    args = _parse_args(argv)
    arguments = [args.rollouts, args.bootstrap]
    trial_file = Path(__file__).resolve()
    return run_against_baseline(
        trial_file, args.baseline, "transports/kafka", args.trials, arguments, _FIGURES, args.dir
    )


if __name__ == "__main__":
    sys.exit(main())
