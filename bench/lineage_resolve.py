"""Request-time parent resolution latency under the main workload's shape, Kafka and file store.

    python -m bench.lineage_resolve [--bootstrap HOST:PORT] [--rollouts 64] [--turns 8] [--partitions 4]

Each of ``--rollouts`` concurrent rollouts makes ``--turns`` calls as a model server would: resolve the
parent of the request (timed), then put the call's entry, stamped with that decision and its continuation
metadata. The prompt grows by the previous generation and the tool tokens every turn, as in the main
workload (1000-token system prompt, 200 generated and 100 tool tokens per turn). One resolver per
transport serves every rollout, as one model-server process would. Prints p50/p99/max of ``resolve``
(continuations only; roots answer without reading) and checks that every continuation resolved to the
previous call. Without ``--bootstrap`` a local broker is started and stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.broker import local_broker
from bench.stats import percentile
from tokcap.lineage import FileLineageResolver, stamp_continuation
from tokcap.protocols import LineageResolver, TokenSink
from tokcap.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.store import TokenCaptureStore

__all__ = ["kafka_resolve", "main", "resolve_args", "resolve_then_put"]


def _entry(rollout: str, turn: int, prompt: list[int], generation: list[int]) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout,
        model_call_id=f"{rollout}-call-{turn}",
        model="policy",
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=[-0.25] * len(generation),
        output_items=[{"role": "assistant", "content": f"turn {turn} of {rollout}"}],
    )


async def resolve_then_put(
    rollout: str, args: argparse.Namespace, sink: TokenSink, resolver: LineageResolver, latencies: list[float]
) -> int:
    """Run one rollout, each turn resolving its parent (timed into ``latencies``, continuations only) and then
    putting the call stamped with that decision; return how many continuations did not resolve to the previous
    call."""
    request: list[dict[str, Any]] = [{"role": "user", "content": f"task {rollout}"}]
    prompt = list(range(1, args.prompt_tokens + 1))
    wrong = 0
    for turn in range(args.turns):
        start = time.perf_counter()
        resolution = await resolver.resolve(rollout, request)
        if turn:
            latencies.append(time.perf_counter() - start)
            match = resolution.match
            if match is None or match.model_call_id != f"{rollout}-call-{turn - 1}":
                wrong += 1
        generation = [50_000 + turn * 1000 + n for n in range(args.generated_tokens)]
        entry = _entry(rollout, turn, prompt, generation)
        stamp_continuation(entry, request)
        parent = resolution.match.model_call_id if resolution.match is not None else None
        stamp_lineage(entry, parent, parent_resolution=ParentResolutionStatus(resolution.status.value))
        await sink.put(entry)
        tool = [90_000 + turn * 1000 + n for n in range(args.tool_tokens)]
        prompt = [*prompt, *generation, *tool]
        request = [*request, *entry.output_items, {"role": "tool", "tool_call_id": "", "content": f"r{turn}"}]
    return wrong


async def _measure(
    args: argparse.Namespace, sink: TokenSink, resolver: LineageResolver
) -> tuple[list[float], int]:
    latencies: list[float] = []
    run = uuid.uuid4().hex[:6]
    wrong = await asyncio.gather(
        *(resolve_then_put(f"b{run}-{n}", args, sink, resolver, latencies) for n in range(args.rollouts))
    )
    await asyncio.gather(sink.close(), resolver.close())
    return latencies, sum(wrong)


def _report(name: str, latencies: list[float], wrong: int) -> None:
    ms = [value * 1000 for value in latencies]
    print(
        f"{name:<12} resolves {len(ms):>5}  p50 {percentile(ms, 0.5):8.2f} ms  p99 {percentile(ms, 0.99):8.2f} ms"
        f"  max {max(ms):8.2f} ms  wrong parent {wrong}"
    )


def kafka_resolve(args: argparse.Namespace, bootstrap: str) -> tuple[list[float], int]:
    """Resolve latencies in seconds (continuations only) over a fresh topic, and how many resolved wrong."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from transports.kafka import KafkaTokenSink
    from transports.kafka.lineage import KafkaLineageResolver

    topic = f"tokcap-bench-lineage-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=args.partitions, replication_factor=1)])[
        topic
    ].result(60)
    try:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        resolver = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic)
        return asyncio.run(_measure(args, sink, resolver))
    finally:
        admin.delete_topics([topic])[topic].result(60)


def resolve_args(
    rollouts: int = 64,
    turns: int = 8,
    partitions: int = 4,
    prompt_tokens: int = 1000,
    generated_tokens: int = 200,
    tool_tokens: int = 100,
) -> argparse.Namespace:
    """The options ``main`` parses, for callers that run the measurement without a command line."""
    return argparse.Namespace(
        rollouts=rollouts,
        turns=turns,
        partitions=partitions,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        tool_tokens=tool_tokens,
    )


def _kafka(args: argparse.Namespace, bootstrap: str) -> None:
    _report("kafka", *kafka_resolve(args, bootstrap))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: start a local one)")
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--generated-tokens", type=int, default=200)
    parser.add_argument("--tool-tokens", type=int, default=100)
    parser.add_argument("--skip-file", action="store_true", help="measure the Kafka resolver only")
    args = parser.parse_args()
    print(
        f"{args.rollouts} concurrent rollouts x {args.turns} turns, {args.prompt_tokens}-token prompt, "
        f"{args.generated_tokens} generated + {args.tool_tokens} tool tokens per turn, {args.partitions} partitions"
    )
    with ExitStack() as stack:
        if not args.skip_file:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            _report(
                "file store", *asyncio.run(_measure(args, TokenCaptureStore(root), FileLineageResolver(root)))
            )
        bootstrap = args.bootstrap or stack.enter_context(
            local_broker(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        )
        _kafka(args, bootstrap)


if __name__ == "__main__":
    main()
