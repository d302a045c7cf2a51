"""Request-time parent resolution latency under the main workload's shape, Kafka and file store.

Closed loop (the ``resolve`` scenario of ``python -m bench``): each of the main shape's concurrent rollouts
makes its calls as a model server would: resolve the parent of the request (timed), then put the call's entry,
stamped with that decision and its continuation metadata. The prompt grows by the previous generation and the
tool tokens every turn, as in the main workload (1000-token system prompt, 200 generated and 100 tool tokens
per turn). One resolver per transport serves every rollout, as one model-server process would. It reports
p50/p99/max of ``resolve`` (continuations only; roots answer without reading) and checks that every
continuation resolved to the previous call.

One long rollout (the ``resolve_long`` scenario): one rollout per size, stored as delta records (a 1000-token
root prompt, then 20 generated and 10 tool tokens per call): all but the last ``samples`` calls are written,
both resolvers warmed, then each remaining call is put and the next request resolved (timed) by tokcap's
``FileLineageResolver`` and Gym 0.7.0's ``FileLineageStore`` on the same directory, in alternating order; with
a broker also by the ``KafkaLineageResolver`` over a fresh topic. Then the frozen rollout is built by tokcap's
and Gym's ``prefix_merging`` builders on the same snapshot, alternating, ``build_trials`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness import turn_order
from bench.stats import median, percentile
from tokcap.builder import run_builder
from tokcap.files.store import TokenCaptureStore
from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from tokcap.lineage import FileLineageResolver, LineageResolution, stamp_continuation
from tokcap.log.records import (
    ParentResolutionStatus,
    TokenEntry,
    digest_of_packed,
    pack_token_ids,
    stamp_lineage,
)
from tokcap.protocols import LineageResolver, TokenSink

__all__ = [
    "LongRollout",
    "LongRolloutFigures",
    "kafka_resolve",
    "long_rollout",
    "file_resolve",
    "long_rollout_figures",
    "measure_long_rollout",
    "resolve_args",
    "resolve_then_put",
]

_TESTS = Path(__file__).resolve().parent.parent / "tests"


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


def file_resolve(args: argparse.Namespace, directory: Path) -> tuple[list[float], int]:
    """Resolve latencies in seconds (continuations only) through a file store, and how many resolved wrong."""
    return asyncio.run(_measure(args, TokenCaptureStore(directory), FileLineageResolver(directory)))


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
    """The closed loop's options."""
    return argparse.Namespace(
        rollouts=rollouts,
        turns=turns,
        partitions=partitions,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        tool_tokens=tool_tokens,
    )


# ---------------------------------------------------------------- one long rollout, tokcap beside Gym


@dataclass(frozen=True)
class LongRollout:
    """One rollout's calls as delta records, and the request that continues each call (``requests[k]`` asks
    for the parent ``entries[k - 1]``; ``requests[0]`` is the root's)."""

    rollout_id: str
    entries: list[TokenEntry]
    requests: list[list[dict[str, Any]]]


class _TaggedStream:
    """sha256 over tagged, length-delimited fields, as ``tokcap.fingerprint`` hashes them, with copies of the
    running state: the stamps of call k extend those of call k - 1, so a rollout of n calls is stamped in O(n)
    hashing instead of O(n^2). Checked against ``tokcap.fingerprint`` in ``long_rollout``."""

    def __init__(self, domain: bytes) -> None:
        self._hash = hashlib.sha256(domain)

    def add(self, tag: int, text: str) -> None:
        data = text.encode()
        self._hash.update(bytes((tag,)) + len(data).to_bytes(8, "big") + data)

    def hexdigest(self) -> str:
        return self._hash.copy().hexdigest()


def _stamp_checked(entry: TokenEntry, request: list[dict[str, Any]]) -> None:
    expected = TokenEntry.model_validate(entry.model_dump())
    stamp_continuation(expected, request)
    for name in ("continuation_fingerprint", "continuation_context_len", "continuation_context_digest"):
        if getattr(entry, name) != getattr(expected, name):
            raise AssertionError(
                f"streamed {name} of {entry.model_call_id} differs from tokcap.fingerprint's"
            )


def long_rollout(
    calls: int, *, prompt_tokens: int = 1000, generated: int = 20, tool: int = 10
) -> LongRollout:
    """A rollout of ``calls`` calls stored as delta records, each linked to the one before (as the sink writes
    them with ``delta_records``), with Gym's digests and continuation stamps."""
    rollout = f"long-{uuid.uuid4().hex[:8]}"
    requests: list[list[dict[str, Any]]] = []
    entries: list[TokenEntry] = []
    items: list[dict[str, Any]] = [{"role": "user", "content": f"task {rollout}"}]
    fingerprint = _TaggedStream(b"nemo-gym-lineage")
    context = _TaggedStream(b"nemo-gym-lineage-context")
    context.add(0, "user")
    context.add(1, "text")
    context.add(2, items[0]["content"])
    packed = bytearray()
    prompt = list(range(1, prompt_tokens + 1))
    for turn in range(calls):
        requests.append(list(items))
        context_digest = context.hexdigest()
        generation = [50_000 + (turn * generated + n) % 100_000 for n in range(generated)]
        output = {"role": "assistant", "content": f"turn {turn}"}
        fingerprint.add(0, "text")
        fingerprint.add(1, output["content"])
        packed += pack_token_ids(prompt)
        packed += pack_token_ids(generation)
        entry = TokenEntry(
            rollout_id=rollout,
            model_call_id=f"{rollout}-call-{turn:05d}",
            model="policy",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=[-0.25] * generated,
            output_items=[output],
            continuation_fingerprint=fingerprint.hexdigest(),
            continuation_context_len=len(items),
            continuation_context_digest=context_digest,
            fingerprint_version=FINGERPRINT_VERSION,
            prompt_is_delta=turn > 0,
            parent_call_id=entries[-1].model_call_id if entries else None,
            parent_resolution="resolved" if entries else "root",
            cum_len=len(packed) // 8,
            digest=digest_of_packed(bytes(packed)),
        )
        entries.append(entry)
        result = {"role": "user", "content": f"result {turn}"}
        for item in (output, result):
            items.append(item)
            context.add(0, item["role"])
            context.add(1, "text")
            context.add(2, item["content"])
        prompt = [90_000 + (turn * tool + n) % 100_000 for n in range(tool)]
    for turn in {0, 1, calls // 2, calls - 1}:
        if 0 <= turn < calls:
            _stamp_checked(entries[turn], requests[turn])
    if calls > 1 and assistant_fingerprint(requests[-1]) != entries[-2].continuation_fingerprint:
        raise AssertionError("the last request does not look up the call before it")
    if conversation_digest(requests[-1][: entries[-2].continuation_context_len]) != (
        entries[-2].continuation_context_digest
    ):
        raise AssertionError("the last request does not continue the context of the call before it")
    requests.append(list(items))
    return LongRollout(rollout, entries, requests)


@dataclass
class LongRolloutFigures:
    """Warm-resolve latencies (seconds) per resolver and build times (seconds) per builder, one rollout size."""

    calls: int
    resolve: dict[str, list[float]]
    build: dict[str, list[float]]


def _load_gym() -> Any:
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    return importlib.import_module("gym_wheel").load_gym()


def _check(name: str, resolution: Any, parent: TokenEntry) -> None:
    match = resolution.match
    if (
        match is None
        or match.model_call_id != parent.model_call_id
        or len(match.cumulative_token_ids) != (parent.cum_len)
    ):
        raise AssertionError(
            f"{name} did not resolve {parent.model_call_id} with its {parent.cum_len} tokens"
        )


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


async def _kafka_long(rollout: LongRollout, samples: int, bootstrap: str) -> list[float]:
    from confluent_kafka.admin import AdminClient, NewTopic

    from transports.kafka import KafkaTokenSink
    from transports.kafka.lineage import KafkaLineageResolver

    topic = f"tokcap-bench-long-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(60)
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    resolver = KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic)
    try:
        written = len(rollout.entries) - samples
        for entry in rollout.entries[:written]:
            await sink.put(entry)
        await asyncio.to_thread(resolver.resolve_now, rollout.rollout_id, rollout.requests[written])
        latencies = []
        for turn in range(written, len(rollout.entries)):
            await sink.put(rollout.entries[turn])
            request = rollout.requests[turn + 1]
            seconds, resolution = await asyncio.to_thread(
                _timed, partial(resolver.resolve_now, rollout.rollout_id, request)
            )
            _check("KafkaLineageResolver", resolution, rollout.entries[turn])
            latencies.append(seconds)
        return latencies
    finally:
        await asyncio.gather(sink.close(), resolver.close())
        admin.delete_topics([topic])[topic].result(60)


def measure_long_rollout(
    calls: int, samples: int, build_trials: int, directory: Path, gym: Any, bootstrap: str | None
) -> LongRolloutFigures:
    """Resolve and build figures of one rollout of ``calls`` delta records, tokcap beside Gym on the same files."""
    rollout = long_rollout(calls)
    samples = min(samples, calls - 2)
    written = calls - samples
    root = Path(tempfile.mkdtemp(dir=directory, prefix=f"long-{calls}-"))
    store = TokenCaptureStore(root)
    for entry in rollout.entries[:written]:
        store.append(entry)
    ours = FileLineageResolver(root)
    theirs = gym.lineage.FileLineageStore(root)
    rollout_id = rollout.rollout_id
    resolvers: dict[str, Callable[[Sequence[Any]], LineageResolution]] = {
        "tokcap FileLineageResolver": lambda request: ours.resolve_now(rollout_id, request),
        "Gym 0.7.0 FileLineageStore": lambda request: theirs._resolve(rollout_id, list(request)),
    }
    for name, resolve in resolvers.items():
        _check(name, resolve(rollout.requests[written]), rollout.entries[written - 1])
    resolve_seconds: dict[str, list[float]] = {name: [] for name in resolvers}
    for turn in range(written, calls):
        store.append(rollout.entries[turn])
        request = rollout.requests[turn + 1]
        for name in turn_order(list(resolvers), turn - written):
            seconds, resolution = _timed(partial(resolvers[name], request))
            _check(name, resolution, rollout.entries[turn])
            resolve_seconds[name].append(seconds)
    snapshot = store.freeze_now(rollout_id)
    ours_entries = list(snapshot.entries)
    gym_entries = [
        gym.records.TokenEntry.model_validate_json(entry.canonical_json()) for entry in ours_entries
    ]
    builders: dict[str, Callable[[], Any]] = {
        "tokcap prefix_merging": lambda: run_builder(ours_entries),
        "Gym 0.7.0 prefix_merging": lambda: gym.builder.run_builder(gym_entries),
    }
    build_seconds: dict[str, list[float]] = {name: [] for name in builders}
    for trial in range(build_trials):
        for name in turn_order(list(builders), trial):
            seconds, output = _timed(builders[name])
            chain = output.chains[0] if output.chains else None
            if len(output.chains) != 1 or chain is None or len(chain.links) != calls:
                raise AssertionError(f"{name} did not build one chain of {calls} calls")
            build_seconds[name].append(seconds)
    asyncio.run(ours.close())
    asyncio.run(theirs.close())
    asyncio.run(store.close())
    if bootstrap is not None:
        resolve_seconds["tokcap KafkaLineageResolver"] = asyncio.run(_kafka_long(rollout, samples, bootstrap))
    return LongRolloutFigures(calls, resolve_seconds, build_seconds)


def long_rollout_figures(
    sizes: Sequence[int], samples: int, build_trials: int, directory: Path, bootstrap: str | None
) -> dict[str, Any]:
    """Per rollout size, warm-resolve p50/p99 per resolver and build median per builder, with ratios to Gym's."""
    gym = _load_gym()
    figures: dict[str, Any] = {}
    for size in sizes:
        measured = measure_long_rollout(size, samples, build_trials, directory, gym, bootstrap)
        gym_resolve = median(measured.resolve["Gym 0.7.0 FileLineageStore"])
        gym_build = median(measured.build["Gym 0.7.0 prefix_merging"])
        figures[str(size)] = {
            "resolve": {
                name: {
                    "p50_ms": median(seconds) * 1000,
                    "p99_ms": percentile(seconds, 0.99) * 1000,
                    "vs_gym": median(seconds) / gym_resolve,
                }
                for name, seconds in measured.resolve.items()
            },
            "build": {
                name: {"median_ms": median(seconds) * 1000, "vs_gym": median(seconds) / gym_build}
                for name, seconds in measured.build.items()
            },
        }
    return figures
