"""Sends through the Kafka producer bridge alone, this checkout against another one, trials alternating.

    python -m bench.producer_sends --baseline /var/tmp/base --bootstrap 127.0.0.1:9092 [--trials 4]

Concurrent senders (64 by default, as the main load's rollouts) each await one small message at a time
through one ``ProducerBridge`` (acks=all, idempotent), on a fresh topic. It measures what the bridge adds to
every intent and put of a sink: sends per second, process CPU per send (the poll thread and librdkafka's
threads included) and send latency p50 and p99. Each trial runs in its own process (``bench.alternating``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_FIGURES = ("sends_per_s", "cpu_us_per_send", "p50_ms", "p99_ms")
_VALUE = b"x" * 2000


async def _trial(directory: Path, bootstrap: str, senders: int, sends: int) -> dict[str, float]:
    """One trial in this process: ``senders`` tasks each awaiting ``sends`` sends, one at a time."""
    from transports.kafka.codec import OutgoingMessage
    from transports.kafka.producer_bridge import ProducerBridge
    from transports.kafka.topics import ensure_topic

    topic = f"tokcap.bench-sends-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    bridge = ProducerBridge(bootstrap)
    latencies: list[float] = []

    async def sender(name: str, count: int) -> None:
        message = OutgoingMessage(key=name.encode(), value=_VALUE, headers=[])
        for _ in range(count):
            started = time.perf_counter()
            await bridge.send(topic, [message], what="bench send")
            latencies.append(time.perf_counter() - started)

    try:
        await sender("warm-up", 50)  # connection, producer id and metadata first
        latencies.clear()
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(sender(f"s{index}", sends) for index in range(senders)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await asyncio.to_thread(bridge.close)
    ordered = sorted(latencies)
    return {
        "sends_per_s": len(ordered) / wall,
        "cpu_us_per_send": cpu / len(ordered) * 1e6,
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[int(len(ordered) * 0.99)] * 1000,
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from bench.alternating import ab_parser

    parser = ab_parser("python -m bench.producer_sends", __doc__, trials=4, kafka=True, load=False)
    parser.add_argument("--senders", type=int, default=64, help="concurrent senders (default 64)")
    parser.add_argument("--sends", type=int, default=60, help="sends per sender (default 60)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating trials and print every trial and the medians per tree."""
    from bench.alternating import run_against_baseline

    args = _parse_args(argv)
    arguments = [args.bootstrap, args.senders, args.sends]
    trial_file = Path(__file__).resolve()
    return run_against_baseline(
        trial_file, args.baseline, "transports/kafka", args.trials, arguments, _FIGURES
    )


if __name__ == "__main__":
    sys.exit(main())
