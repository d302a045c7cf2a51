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
    from bench.stats import percentile

    # The anchor is this checkout's, read from its file: the baseline tree may predate it.
    gym_anchor = runpy.run_path(str(Path(__file__).with_name("file_store_ab.py")))["gym_anchor"]
    workload = prepare(WorkloadShape(rollouts=rollouts), "ab")
    gym_load = await gym_anchor(workload, directory / "gym")
    trial = await run_kafka_trial(workload, bootstrap, directory / "tokcap")
    freezes = trial.load.freeze_under_load_ms
    return {
        "puts_per_s": trial.load.puts_per_s,
        "vs_gym": trial.load.puts_per_s / gym_load.puts_per_s,
        "freeze_p50_ms": percentile(freezes, 0.50),
        "freeze_p99_ms": percentile(freezes, 0.99),
        "replay_per_s": trial.replay.puts_per_s,
        "backlog": float(trial.lag_at_end_of_puts),
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kafka_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree)")
    parser.add_argument("--bootstrap", required=True, help="the broker, HOST:PORT")
    parser.add_argument("--trials", type=int, default=5, help="trials per tree (default 5)")
    parser.add_argument(
        "--rollouts", type=int, default=64, help="concurrent rollouts of the main shape (default 64)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where trial directories go (default: a temp dir)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating trials and print every trial and the medians per tree."""
    args = _parse_args(argv)
    if not (args.baseline / "transports" / "kafka").is_dir():
        print(f"--baseline {args.baseline} holds no transports/kafka/; give a checkout of this repository")
        return 2
    from bench.alternating import alternate

    arguments = [args.rollouts, args.bootstrap]
    alternate(Path(__file__).resolve(), args.baseline, args.trials, arguments, _FIGURES, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
