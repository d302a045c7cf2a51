"""A trainer process for the split Kafka load: a source with its in-process materializer, freezing on request.

    python -m bench.kafka_trainer --bootstrap HOST:PORT --topic TOPIC --dir DIR

In a run the model servers' sinks and the trainer are different processes, often on different nodes; the main
load runs both in one interpreter, so a freeze there waits for the GIL behind 64 producing rollouts. Here the
trainer has its own interpreter. It prints ``ready`` once its materializer follows the topic, then reads one
JSON request per line on stdin, ``{"rollout_id": ...}``, freezes that rollout (requests run concurrently, as a
trainer freezes rollouts as they finish) and answers each with one JSON line on stdout: the rollout id, the
model call ids of the snapshot's entries in order, whether it is incomplete, and the freeze's latency as the
trainer saw it (from calling ``freeze`` to holding the snapshot). A failed freeze answers with ``error``.
It stops at the end of stdin, once every answer is written.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from transports.kafka.source import KafkaTokenSource

__all__ = ["main"]


def _answer(rollout_id: str, started: float, snapshot: Any) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "model_call_ids": [entry.model_call_id for entry in snapshot.entries],
        "incomplete": snapshot.incomplete,
        "latency_ms": (time.perf_counter() - started) * 1000.0,
    }


async def _serve(source: KafkaTokenSource) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    freezes: set[asyncio.Task[None]] = set()

    def write(answer: dict[str, Any]) -> None:
        sys.stdout.buffer.write(orjson.dumps(answer) + b"\n")
        sys.stdout.buffer.flush()

    async def freeze(rollout_id: str) -> None:
        started = time.perf_counter()
        try:
            snapshot = await source.freeze(rollout_id)
        except Exception as exc:  # the load raises it with the rollout it belongs to
            write({"rollout_id": rollout_id, "error": f"{type(exc).__name__}: {exc}"})
            return
        write(_answer(rollout_id, started, snapshot))

    while line := await reader.readline():
        rollout_id = orjson.loads(line)["rollout_id"]
        task = asyncio.create_task(freeze(rollout_id))
        freezes.add(task)
        task.add_done_callback(freezes.discard)
    if freezes:
        await asyncio.gather(*freezes)


async def _run(args: argparse.Namespace) -> None:
    source = KafkaTokenSource(bootstrap_servers=args.bootstrap, store_dir=Path(args.dir), topic=args.topic)
    try:
        sys.stdout.buffer.write(b"ready\n")
        sys.stdout.buffer.flush()
        await _serve(source)
    finally:
        await source.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Serve freezes until stdin ends."""
    parser = argparse.ArgumentParser(prog="python -m bench.kafka_trainer", description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--dir", required=True)
    asyncio.run(_run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
