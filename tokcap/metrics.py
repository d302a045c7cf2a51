"""Every Prometheus metric tokcap exports, on one registry a process can serve or mount.

Sinks run inside model servers and workers, materializers on trainer nodes; each process exposes what its own
parts did. ``REGISTRY`` holds every family below and nothing else, so mounting it
(``prometheus_client.make_asgi_app(REGISTRY)`` in a FastAPI app, ``make_wsgi_app`` elsewhere) adds tokcap's
metrics without mixing them with the process's own. ``tokcap materialize --metrics-port`` serves it too.

Labels stay few and bounded: a transport, an operation, an event type, a reason kind drawn from a fixed
list, a topic and partition. A rollout id or call id is never a label: each would be a new series.

An instrumented call reads ``time.perf_counter`` twice and observes one histogram bucket; nothing is counted
per token. ``docs/operations.md`` lists every family with the alert to set on it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "BLOCK_KINDS",
    "COMMAND_KINDS",
    "COMMAND_READ_DELAY_SECONDS",
    "COMMAND_WAIT_SECONDS",
    "DEAD_LETTERS",
    "DEAD_LETTER_KINDS",
    "EVENTS_APPLIED",
    "FLUSH_SECONDS",
    "FREEZE_SECONDS",
    "HTTP_DROPPED",
    "HTTP_DROP_KINDS",
    "LATENCY_BUCKETS",
    "MARKERS_FORWARDED",
    "MARKERS_SPILLED",
    "MASK_KINDS",
    "PAUSE_BUCKETS",
    "REGISTRY",
    "ROLLOUTS_MASKED",
    "SENT_BYTES",
    "SINK_FAILURES",
    "SINK_SECONDS",
    "SOURCE_FAILURES",
    "SOURCE_SECONDS",
    "LoopStatus",
    "PartitionStatus",
    "StatusReporter",
    "failure_kind",
    "logger",
    "sink_timed",
    "source_timed",
    "stage_timed",
    "watch_loop",
]

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
"""tokcap's own registry: serve it, or mount it in an ASGI or WSGI app."""

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""From a tmpfs put (about 100 µs) to a delivery timeout (30 s)."""

PAUSE_BUCKETS = (*LATENCY_BUCKETS[LATENCY_BUCKETS.index(0.001) :], 60.0, 120.0)
"""From a flush of a few files (about 1 ms) to a pause longer than a source's default timeout (30 s)."""

# ------------------------------------------------------------------------------------------ sinks

SINK_SECONDS = Histogram(
    "tokcap_sink_operation_seconds",
    "Time a sink call took until its record was durable (file) or acknowledged (Kafka).",
    ["transport", "operation"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SINK_FAILURES = Counter(
    "tokcap_sink_failures",
    "Sink calls that raised, by the class of the error raised.",
    ["transport", "operation", "kind"],
    registry=REGISTRY,
)
SENT_BYTES = Counter(
    "tokcap_sink_sent_bytes",
    "Key and value bytes of the messages a Kafka sink had acknowledged by the broker.",
    ["transport"],
    registry=REGISTRY,
)
MARKERS_SPILLED = Counter(
    "tokcap_sink_markers_spilled",
    "Incomplete markers left in the local spill because the broker did not acknowledge them.",
    registry=REGISTRY,
)
MARKERS_FORWARDED = Counter(
    "tokcap_sink_markers_forwarded",
    "Spilled incomplete markers the broker acknowledged later.",
    registry=REGISTRY,
)

# ------------------------------------------------------------------------------- sources, ledgers

SOURCE_SECONDS = Histogram(
    "tokcap_source_operation_seconds",
    "Time a source, ledger or lineage resolver call took (freeze, fetch, resolve, record).",
    ["transport", "operation"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SOURCE_FAILURES = Counter(
    "tokcap_source_failures",
    "Source, ledger or resolver calls that raised, by the class of the error raised.",
    ["transport", "operation", "kind"],
    registry=REGISTRY,
)

# --------------------------------------------------------------------------------- materializer

DEAD_LETTER_KINDS = (
    "undecodable",
    "orphaned_chunk",
    "broken_chunk_group",
    "abandoned_chunk_group",
    "refused_staging",
)
"""Why a message was dead-lettered, as a label: its free-text reason stays in the dead-letter log."""

MASK_KINDS = ("dangling_intent", "dead_letter", "marked_lost")
"""Why a frozen rollout is masked: a dispatched call left no entry, the materializer dead-lettered one of its
events, or a writer marked a call lost."""

EVENTS_APPLIED = Counter(
    "tokcap_materializer_events_applied",
    "Events the materializer applied to its store, by event type.",
    ["type"],
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "tokcap_materializer_dead_letters",
    "Messages (or abandoned chunk groups) written to a dead-letter log, by reason kind.",
    ["reason"],
    registry=REGISTRY,
)
ROLLOUTS_MASKED = Counter(
    "tokcap_materializer_rollouts_masked",
    "Rollouts frozen incomplete (the trainer masks them), by the first reason kind that applies.",
    ["reason"],
    registry=REGISTRY,
)
FREEZE_SECONDS = Histogram(
    "tokcap_materializer_freeze_seconds",
    "Time from reading a freeze off the log to answering it (applied, or answered ahead of its apply).",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)

COMMAND_KINDS = ("freeze", "drop", "retire", "delete")
"""The source commands (their event types, the ``type`` label): the events a trainer waits on."""

COMMAND_WAIT_SECONDS = Histogram(
    "tokcap_materializer_command_wait_seconds",
    "Time from reading a source command off the log to its answer: applied and durable (its checkpoint written), "
    "or a freeze answered from memory to an in-process source.",
    ["type"],
    buckets=PAUSE_BUCKETS,
    registry=REGISTRY,
)
COMMAND_READ_DELAY_SECONDS = Histogram(
    "tokcap_materializer_command_read_delay_seconds",
    "Time from a source command's log timestamp (its producer's clock when sent) to the materializer fetching it: "
    "how long it waited in the log, delivery included. With command_wait_seconds it splits a source's wait into "
    "not yet read and read but not yet answered. Across hosts it includes their clocks' skew.",
    ["type"],
    buckets=PAUSE_BUCKETS,
    registry=REGISTRY,
)
BLOCK_KINDS = ("commands", "sweep")
"""Which block a flush closed (the ``kind`` label): the commands carried out ahead, or the sweep in log order."""

FLUSH_SECONDS = Histogram(
    "tokcap_materializer_flush_seconds",
    "Time the materializer took to write and sync its projection's block before a checkpoint.",
    ["kind"],
    buckets=PAUSE_BUCKETS,
    registry=REGISTRY,
)

# ------------------------------------------------------------------------------ the metrics server

HTTP_DROP_KINDS = ("refused", "shed", "idle_timeout", "header_timeout", "send_timeout", "busy", "bad_request")
"""Why the metrics server let a connection go unserved: at its connection limit (``refused``), closed to make
room for a new one (``shed``), too slow (the three timeouts), no thread free (``busy``), or not a request it
serves (``bad_request``)."""

HTTP_DROPPED = Counter(
    "tokcap_metrics_http_dropped",
    "Connections the /metrics and /healthz server refused or closed without an answer, by why.",
    ["reason"],
    registry=REGISTRY,
)

for _kind in DEAD_LETTER_KINDS:
    DEAD_LETTERS.labels(_kind)
for _kind in MASK_KINDS:
    ROLLOUTS_MASKED.labels(_kind)
for _kind in COMMAND_KINDS:
    COMMAND_WAIT_SECONDS.labels(_kind)
    COMMAND_READ_DELAY_SECONDS.labels(_kind)
for _kind in BLOCK_KINDS:
    FLUSH_SECONDS.labels(_kind)
for _kind in HTTP_DROP_KINDS:
    HTTP_DROPPED.labels(_kind)


def failure_kind(exc: BaseException) -> str:
    """The label of a failure: its class name, a bounded set (tokcap's error tree and a few library errors)."""
    return type(exc).__name__


_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(histogram: Histogram, failures: Counter, transport: str, operation: str) -> Callable[[_F], _F]:
    """Time each call of the decorated function (sync or async) and count the calls that raise.

    The histogram's child is bound once, at decoration; a call costs two clock reads and one observation.
    A cancelled call is timed but not counted as a failure: the caller gave up, the transport did not fail.
    """
    seconds = histogram.labels(transport, operation)

    def failed(exc: Exception) -> None:
        failures.labels(transport, operation, failure_kind(exc)).inc()

    def decorate(function: _F) -> _F:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await function(*args, **kwargs)
                except Exception as exc:
                    failed(exc)
                    raise
                finally:
                    seconds.observe(time.perf_counter() - started)

            return cast("_F", timed_async)

        @functools.wraps(function)
        def timed_sync(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                failed(exc)
                raise
            finally:
                seconds.observe(time.perf_counter() - started)

        return cast("_F", timed_sync)

    return decorate


def sink_timed(transport: str, operation: str) -> Callable[[_F], _F]:
    """Decorate a sink call (put, intent, cancel, mark, stage) of a transport (file, kafka)."""
    return _timed(SINK_SECONDS, SINK_FAILURES, transport, operation)


def stage_timed(transport: str) -> Callable[[_F], _F]:
    """Decorate a staging sink's ``stage``, which answers a failure with a ``StageResult`` instead of raising.

    A failed result counts as a failure of kind ``conflict`` (another payload holds the key), ``retired`` (the
    rollout's fence refused it) or ``not_staged`` (the write or the delivery failed); a raised error by its class.
    """
    timed = _timed(SINK_SECONDS, SINK_FAILURES, transport, "stage")
    failures = {kind: SINK_FAILURES.labels(transport, "stage", kind) for kind in _STAGE_FAILURES}

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            if getattr(result, "ok", True) is False:
                failures[_stage_failure_kind(str(getattr(result, "error", "")))].inc()
            return result

        return timed(cast("_F", counted))

    return decorate


_STAGE_FAILURES = ("conflict", "retired", "not_staged")


def _stage_failure_kind(error: str) -> str:
    if "already staged with a different payload" in error:
        return "conflict"
    if "is retired" in error:
        return "retired"
    return "not_staged"


def source_timed(transport: str, operation: str) -> Callable[[_F], _F]:
    """Decorate a source, ledger or resolver call (freeze, fetch, resolve, record) of a transport."""
    return _timed(SOURCE_SECONDS, SOURCE_FAILURES, transport, operation)


# ------------------------------------------------------------------- read at scrape time


@dataclass(frozen=True)
class PartitionStatus:
    """Where a materializer stands on one partition it owns, as of the moment it is asked."""

    topic: str
    partition: int
    applied_next: int
    """Every offset below it is applied and checkpointed."""
    high_watermark: int | None
    """The offset after the last message the consumer last saw in the log; ``None`` before it saw one."""
    oldest_unapplied_age_s: float
    """Age (by its log timestamp) of the oldest message read and not applied yet; 0 when none waits."""
    checkpoint_age_s: float
    """Seconds since this partition's checkpoint last moved forward (or since it was loaded, if it has not)."""

    @property
    def lag(self) -> int:
        """Messages in the log not applied yet, as far as the consumer knows the log's end."""
        if self.high_watermark is None:
            return 0
        return max(0, self.high_watermark - self.applied_next)


@dataclass(frozen=True)
class LoopStatus:
    """A materializer loop at one moment: what it owns, how far it is, and what it holds in memory."""

    topic: str
    running: bool
    """It owns its partitions and its loop has not stopped or failed."""
    failure: str | None
    """Why the loop stopped with an error, if it did."""
    partitions: Sequence[PartitionStatus]
    rollouts_held: int
    """Rollouts with decisions read and not carried out yet."""
    messages_held: int
    """Messages read ahead and not applied yet."""
    kept_tokens: int
    """Tokens of applied entries kept in memory to answer freezes ahead."""


class StatusReporter(Protocol):
    """What a loop offers the scrape: its status now, read without stopping it."""

    def loop_status(self) -> LoopStatus: ...


_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_watched_lock = threading.Lock()


def watch_loop(reporter: StatusReporter) -> None:
    """Report this loop's gauges at every scrape for as long as it exists; a loop garbage-collected drops out."""
    with _watched_lock:
        _watched.add(reporter)


class _LoopGauges(Collector):
    """The materializer gauges, computed from each watched loop's status when the registry is scraped.

    Reading them at scrape time costs the loop nothing, and a loop stuck in one apply still shows its lag
    growing (the consumer learns the log's end in the background). Two loops on one topic and partition (two
    directories) report the larger lag.
    """

    def collect(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "tokcap_materializer_lag_messages",
            "Messages in the log not applied yet, per partition.",
            labels=["topic", "partition"],
        )
        lag_s = GaugeMetricFamily(
            "tokcap_materializer_lag_seconds",
            "Age of the oldest message read and not applied yet, per partition (0 when none waits).",
            labels=["topic", "partition"],
        )
        checkpoint_age = GaugeMetricFamily(
            "tokcap_materializer_checkpoint_age_seconds",
            "Seconds since the partition's checkpoint last moved forward.",
            labels=["topic", "partition"],
        )
        owned = GaugeMetricFamily(
            "tokcap_materializer_owned_partitions",
            "Partitions a running materializer owns (0 once it stopped or failed).",
            labels=["topic"],
        )
        held = GaugeMetricFamily(
            "tokcap_materializer_hot_state",
            "What a materializer holds in memory: rollouts with pending decisions, messages read ahead, "
            "tokens of applied entries kept for freezes answered ahead.",
            labels=["topic", "kind"],
        )
        with _watched_lock:
            reporters = list(_watched)
        per_partition: dict[tuple[str, str], tuple[float, float, float]] = {}
        per_topic: dict[str, list[int]] = {}
        for reporter in reporters:
            try:
                status = reporter.loop_status()
            except Exception:
                # One loop that cannot say where it stands must not take every other family off the scrape.
                logger.warning(
                    "could not read the status of %r for the metrics scrape", reporter, exc_info=True
                )
                continue
            totals = per_topic.setdefault(status.topic, [0, 0, 0, 0])
            if status.running:
                totals[0] += len(status.partitions)
            totals[1] += status.rollouts_held
            totals[2] += status.messages_held
            totals[3] += status.kept_tokens
            if not status.running:
                continue
            for partition in status.partitions:
                key = (partition.topic, str(partition.partition))
                before = per_partition.get(key, (0.0, 0.0, 0.0))
                per_partition[key] = (
                    max(before[0], float(partition.lag)),
                    max(before[1], partition.oldest_unapplied_age_s),
                    max(before[2], partition.checkpoint_age_s),
                )
        for key, (messages, seconds, age) in sorted(per_partition.items()):
            lag.add_metric(list(key), messages)
            lag_s.add_metric(list(key), seconds)
            checkpoint_age.add_metric(list(key), age)
        for topic, (partitions, rollouts, messages_held, tokens) in sorted(per_topic.items()):
            owned.add_metric([topic], partitions)
            held.add_metric([topic, "rollouts"], rollouts)
            held.add_metric([topic, "messages"], messages_held)
            held.add_metric([topic, "kept_tokens"], tokens)
        yield from (lag, lag_s, checkpoint_age, owned, held)

    def describe(self) -> Iterator[Metric]:
        """Nothing to check at registration: these names are tokcap's own."""
        return iter(())


REGISTRY.register(_LoopGauges())
