"""The materializer's apply step alone (decode + apply), this checkout against another, trials alternating.

    python -m bench.apply_rate_ab --baseline /var/tmp/base --bootstrap 127.0.0.1:9092 [--trials 5] [--dir /var/tmp]

This is the figure the main table calls "apply step alone" and the issue that asked for the apply step's CPU to
halve quoted (5,118 events/s then): each tree runs its own Kafka main load on a fresh topic, then reads the topic
into memory and decodes and applies every message to an empty store, in its own block size, with nothing else
running (``bench.apply_rate``). Decoding is part of it: the materializer decodes every event it applies, and a
put's canonical line, which the apply step writes, is built while the event is decoded.

Each trial runs in its own process with the tree first on ``sys.path`` (``bench.alternating``), so the baseline
may be any tree with ``bench.kafka_trial.run_kafka_trial``. Events per second depend on how many messages a
tree writes per call; tokens per second and microseconds per put compare trees that write different events.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_FIGURES = ("events_per_s", "tokens_per_s", "us_per_put", "events")


async def _trial(directory: Path, rollouts: int, bootstrap: str) -> dict[str, float]:
    """One trial in this process: the tree's Kafka main load, then its apply step over the topic."""
    from bench.kafka_trial import run_kafka_trial
    from bench.load import prepare
    from bench.options import WorkloadShape

    workload = prepare(WorkloadShape(rollouts=rollouts), "ab")
    trial = await run_kafka_trial(workload, bootstrap, directory / "tokcap")
    apply = trial.apply
    puts = sum(len(calls) for slot in workload.slots for _, calls in slot)
    return {
        "events_per_s": apply.events_per_s,
        "tokens_per_s": apply.tokens_per_s,
        "us_per_put": apply.seconds / puts * 1e6,
        "events": float(apply.events),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating trials and print every trial and the medians per tree."""
    from bench.alternating import ab_parser, run_against_baseline

    parser = ab_parser("python -m bench.apply_rate_ab", __doc__, trials=5, kafka=True, load=True)
    args = parser.parse_args(argv)
    trial_file = Path(__file__).resolve()
    arguments = [args.rollouts, args.bootstrap]
    return run_against_baseline(
        trial_file, args.baseline, "transports/kafka", args.trials, arguments, _FIGURES, args.dir
    )


if __name__ == "__main__":
    sys.exit(main())
