"""When a materializer is ready: it owns its partitions and has applied the log as it was when it started.

A trainer reading the store before then would wait on freezes behind the whole backlog; an orchestrator's
readiness probe (``/healthz``, ``tokcap.cli.metrics_http``) holds it back instead. Readiness is lost again when the
loop stops owning its partitions: it failed (another process owns the directory, the topic was created again,
offsets were deleted before they were read) or it stopped.

The ends to catch up to are read once, as soon as the loop owns its partitions, with one request per
partition; later messages do not move the target, so a run that never pauses still becomes ready.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from tokcap.cli.metrics_http import DEFAULT_METRICS_HOST, Health, MetricsServer
from tokcap.metrics import LoopStatus

__all__ = ["MaterializerReadiness", "ReadinessSubject", "logger", "serve_metrics"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1
"""How often the watcher looks whether the loop owns its partitions yet."""


class ReadinessSubject(Protocol):
    """What readiness reads of a materializer (``transports.kafka.materializer.Materializer`` is one)."""

    @property
    def topic(self) -> str: ...

    def loop_status(self) -> LoopStatus: ...

    def high_watermarks(self, timeout_s: float = 10.0) -> dict[int, int]: ...


class MaterializerReadiness:
    """The health check of one materializer; call it (``/healthz`` does) to get its ``Health`` now."""

    def __init__(self, materializer: ReadinessSubject, *, timeout_s: float = 10.0) -> None:
        """Start watching; ``timeout_s`` bounds the one request for the partitions' ends."""
        self._materializer = materializer
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._targets: dict[int, int] | None = None
        self._target_error: str | None = None
        self._caught_up = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._take_targets, name="tokcap-readiness", daemon=True)
        self._thread.start()

    def _take_targets(self) -> None:
        """Once the loop owns its partitions, read their ends: what it must apply before it is ready."""
        while not self._stop.is_set():
            status = self._materializer.loop_status()
            if status.failure is not None:
                return
            if status.running:
                break
            self._stop.wait(_POLL_S)
        else:
            return
        try:
            targets = self._materializer.high_watermarks(self._timeout_s)
        except Exception as exc:
            logger.warning(
                "could not read the ends of %s to decide readiness: %s", self._materializer.topic, exc
            )
            with self._lock:
                self._target_error = f"could not read the ends of the topic's partitions: {exc}"
            return
        with self._lock:
            self._targets = targets

    def __call__(self) -> Health:
        """Healthy once every partition is applied up to its end at start, and while the loop still runs."""
        status = self._materializer.loop_status()
        if status.failure is not None:
            return Health(False, f"the materializer stopped: {status.failure}")
        if not status.running:
            with self._lock:
                started = self._targets is not None
            if started:
                return Health(False, "the materializer no longer owns its partitions: it stopped")
            return Health(False, "starting: the materializer does not own its partitions yet")
        with self._lock:
            targets, error, caught_up = self._targets, self._target_error, self._caught_up
        if error is not None:
            return Health(False, error)
        if targets is None:
            return Health(False, "starting: reading the ends of the topic's partitions")
        if not caught_up:
            applied = {p.partition: p.applied_next for p in status.partitions}
            behind = {p: end - applied.get(p, 0) for p, end in targets.items() if applied.get(p, 0) < end}
            if behind:
                worst = max(behind, key=lambda p: behind[p])
                return Health(
                    False,
                    f"catching up: {sum(behind.values())} messages to apply on {len(behind)} partition(s) "
                    f"(partition {worst}: {behind[worst]})",
                )
            with self._lock:
                self._caught_up = True
        return Health(True, f"applying {len(status.partitions)} partition(s) of {status.topic}")

    def close(self) -> None:
        """Stop the watcher if it still waits for the loop."""
        self._stop.set()
        self._thread.join()


def serve_metrics(
    materializer: ReadinessSubject, *, host: str = DEFAULT_METRICS_HOST, port: int = 0
) -> MetricsServer:
    """Serve ``/metrics`` and this materializer's ``/healthz`` from a daemon thread; close the server to stop."""
    readiness = MaterializerReadiness(materializer)
    try:
        server = MetricsServer(readiness, host=host, port=port, on_close=readiness.close)
    except BaseException:
        readiness.close()
        raise
    return server.start()
