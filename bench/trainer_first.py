"""The trainer in its own process, served the CPU first: how far a trainer with cores of its own would get.

    python -m bench.trainer_first --bootstrap 127.0.0.1:9092 [--trials 3] [--rollouts 64] [--nice 19]

This machine has two cores for the broker, the load and the trainer, so the split shape (``bench.kafka_split``:
the sinks in the load's process, a source with its materializer in a trainer process) cannot show what a trainer
node with cores of its own would see. Here the load's process lowers its own CPU priority (``os.nice``) once the
trainer process is running, so the scheduler serves the trainer and the broker first and gives the load what they
leave. Trials alternate between that and equal priority, each in a fresh interpreter; each prints the trainer's
freeze p50, p99 and max under load, the load's put/s, and the load process's niceness (checked, not assumed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_FIGURES = ("freeze_p50_ms", "freeze_p99_ms", "freeze_max_ms", "puts_per_s", "niceness")


async def _trial(directory: Path, rollouts: int, bootstrap: str, nice: int) -> dict[str, float]:
    """One split-shape trial; the load's process takes ``nice`` right after its trainer process has started."""
    import bench.kafka_split as split
    from bench.load import prepare
    from bench.options import WorkloadShape
    from bench.stats import percentile

    start_trainer = split._start_trainer

    async def started_then_yield_cpu(*args: object) -> object:
        trainer = await start_trainer(*args)  # type: ignore[arg-type]
        os.nice(nice)
        return trainer

    split._start_trainer = started_then_yield_cpu  # type: ignore[assignment]
    workload = prepare(WorkloadShape(rollouts=rollouts), f"first{os.getpid()}")
    trial = await split.run_with_trainer_process(workload, bootstrap, directory)
    latencies = trial.trainer_freeze_under_load_ms or trial.trainer_freeze_after_load_ms
    return {
        "freeze_p50_ms": percentile(latencies, 0.50),
        "freeze_p99_ms": percentile(latencies, 0.99),
        "freeze_max_ms": max(latencies),
        "puts_per_s": trial.load.puts_per_s,
        "niceness": float(os.nice(0)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate trials with the load at equal priority and at ``--nice``; print each and the medians."""
    from bench.alternating import REPO, ab_parser, alternate_arms

    parser = ab_parser(
        "python -m bench.trainer_first", __doc__, trials=3, kafka=True, load=True, baseline=False
    )
    parser.add_argument("--nice", type=int, default=19, help="the load's niceness in the served-first trials")
    args = parser.parse_args(argv)
    if not 1 <= args.nice <= 19:
        parser.error(f"--nice must be 1 to 19 (a lower priority for the load), got {args.nice}")
    arguments = {"equal": 0, "trainer_first": args.nice}
    arms = {name: (REPO, [args.rollouts, args.bootstrap, nice]) for name, nice in arguments.items()}
    alternate_arms(Path(__file__).resolve(), arms, args.trials, _FIGURES, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
