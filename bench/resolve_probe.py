"""Resolve latency under the main load, probed from a model-server process of its own.

The main load (``bench.load``: 64 concurrent rollouts, intent + put per turn, freezes) runs over Kafka in the
benchmark process, with the source's in-process materializer, as ``python -m bench``'s main shape does. A
second process, started first, plays one more model server on the same run topic: it resolves each turn's
parent through its own ``KafkaLineageResolver`` (timed, continuations only), then puts the call stamped with
that decision, one rollout after another for as long as the main load runs. Every resolve must see the
put just before it, and the resolver reads partitions that also carry the main load's messages.

This is the latency a request sees on a model server while the cluster is under the main load. The other
resolve figure (``bench.lineage_resolve``) makes the 64 loaded rollouts resolve in the load's own process
and event loop, a closed loop whose latency follows that process's CPU.

``python -m bench.resolve_probe BOOTSTRAP TOPIC`` is the probe process itself: it warms up (its first
resolve per partition assigns and fetches), prints ``ready``, starts at ``go`` and stops at ``stop`` on its
standard input, then prints its latencies as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kafka_trial import KafkaTarget, delete_topic
from bench.lineage_resolve import resolve_args, resolve_then_put
from bench.load import BenchmarkCheckError, LoadResult, PreparedWorkload, drive
from bench.options import WorkloadShape

__all__ = ["ProbeResult", "main", "probe_under_main_load"]

_REPO = Path(__file__).resolve().parent.parent
_WARM_UP_ROLLOUTS = 16
_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ProbeResult:
    """The probe's resolve latencies (seconds), how many resolved to a wrong parent, and the main load's figures."""

    latencies: list[float]
    wrong: int
    load: LoadResult


async def _probe(bootstrap: str, topic: str) -> dict[str, Any]:
    from transports.kafka import KafkaTokenSink
    from transports.kafka.lineage import KafkaLineageResolver

    shape = WorkloadShape()
    args = resolve_args(
        rollouts=1,
        turns=shape.turns,
        prompt_tokens=shape.prompt_tokens,
        generated_tokens=shape.generated_tokens,
        tool_tokens=shape.tool_tokens,
    )
    run = uuid.uuid4().hex[:6]
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    resolver = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic)
    stop = threading.Event()
    latencies: list[float] = []
    wrong = 0
    try:
        # A long-lived model server has assigned and fetched every partition before the run: not timed.
        for n in range(_WARM_UP_ROLLOUTS):
            wrong += await resolve_then_put(f"probe-{run}-warm-{n}", args, sink, resolver, [])
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the probe expected 'go' on its standard input")
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
        rollout = 0
        while not stop.is_set():
            wrong += await resolve_then_put(f"probe-{run}-{rollout}", args, sink, resolver, latencies)
            rollout += 1
    finally:
        await sink.close()
        await resolver.close()
    return {"latencies": latencies, "wrong": wrong}


def main() -> None:
    """The probe process: ``python -m bench.resolve_probe BOOTSTRAP TOPIC``."""
    bootstrap, topic = sys.argv[1], sys.argv[2]
    print(json.dumps(asyncio.run(_probe(bootstrap, topic))), flush=True)


def _line(process: subprocess.Popen[str], what: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise BenchmarkCheckError(f"the resolve probe exited before {what} (exit code {process.wait()})")
    return line.strip()


def _tell(process: subprocess.Popen[str], word: str) -> None:
    assert process.stdin is not None
    process.stdin.write(word + "\n")
    process.stdin.flush()


async def probe_under_main_load(workload: PreparedWorkload, bootstrap: str, directory: Path) -> ProbeResult:
    """Run the main load over a fresh topic while a probe process resolves on the same topic."""
    from transports.kafka.client.topics import ensure_topic
    from transports.kafka.sink import KafkaTokenSink
    from transports.kafka.source import KafkaTokenSource

    topic = f"tokcap.bench-probe-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    probe = subprocess.Popen(
        [sys.executable, "-m", "bench.resolve_probe", bootstrap, topic],
        cwd=_REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = await asyncio.wait_for(asyncio.to_thread(_line, probe, "it was ready"), _READY_TIMEOUT_S)
        if ready != "ready":
            raise BenchmarkCheckError(f"the resolve probe said {ready!r} instead of 'ready'")
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        source = KafkaTokenSource(bootstrap_servers=bootstrap, store_dir=directory, topic=topic)
        try:
            _tell(probe, "go")
            load = await drive(workload, KafkaTarget(sink, source))
            _tell(probe, "stop")
        finally:
            await sink.close()
            await source.close()
        outcome = json.loads(await asyncio.to_thread(_line, probe, "it reported"))
        probe.wait(60)
    finally:
        if probe.poll() is None:
            probe.kill()
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return ProbeResult(list(outcome["latencies"]), int(outcome["wrong"]), load)


if __name__ == "__main__":
    main()
