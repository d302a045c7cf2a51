"""The marker forwarder: sends spilled incomplete markers to the broker until it takes them.

A background thread, started only when there is something to forward (a marker whose send failed, or the
markers of a dead session adopted at start-up), retries with a growing pause until every pending marker is
acknowledged, then waits to be woken again. A marker a caller is sending itself is claimed and skipped, so
the forwarder never sends a marker at the same time as its writer; forwarding passes never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from tokcap.errors import TransportError
from tokcap.log.events import IncompleteEvent
from tokcap.metrics import MARKERS_FORWARDED
from transports.kafka.write.marker_spill import MarkerSpill

__all__ = ["FIRST_RETRY_S", "LAST_RETRY_S", "MarkerForwarder", "Send", "logger"]

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
"""Pause after the first failed forwarding pass; it doubles after each failure."""

LAST_RETRY_S = 5.0
"""Longest pause between forwarding passes while the broker does not answer."""

Send = Callable[[IncompleteEvent], Coroutine[Any, Any, object]]
"""Publishes one marker and returns once the broker acknowledged it; raises ``TransportError`` otherwise."""


class MarkerForwarder:
    """Forwards a spill's pending markers through ``send``, from its own thread."""

    def __init__(self, spill: MarkerSpill, send: Send) -> None:
        self._spill = spill
        self._send = send
        self._pass_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._claimed: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self, marker_id: str) -> None:
        """A caller is sending this marker itself: skip it until it is released."""
        with self._state_lock:
            self._claimed.add(marker_id)

    def release(self, marker_id: str) -> None:
        """The caller is done with its marker (sent and removed, or left for the forwarder)."""
        with self._state_lock:
            self._claimed.discard(marker_id)

    def wake(self) -> None:
        """Forward soon: start the thread if it is not running, or cut its pause short."""
        with self._state_lock:
            if self._stop.is_set():
                return
            self._wake.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tokcap-marker-forwarder", daemon=True)
                self._thread.start()

    def forward_pending(self) -> int:
        """One pass: send each unclaimed pending marker, removing it once acknowledged; return how many are left.

        Stops at the first failure: the broker is not answering, and the rest would fail the same way.
        Runs in the calling thread, which must have no running event loop.
        """
        with self._pass_lock:
            for marker in self._spill.pending():
                with self._state_lock:
                    if marker.marker_id in self._claimed:
                        continue
                try:
                    asyncio.run(self._send(marker.event))
                except TransportError as exc:
                    logger.warning(
                        "spilled incomplete marker %s of rollout %r not forwarded yet: %s",
                        marker.marker_id,
                        marker.event.rollout_id,
                        exc,
                    )
                    break
                self._spill.remove(marker)
                MARKERS_FORWARDED.inc()
                logger.info(
                    "forwarded spilled incomplete marker %s of rollout %r",
                    marker.marker_id,
                    marker.event.rollout_id,
                )
            return len(self._spill.pending())

    def _run(self) -> None:
        pause = FIRST_RETRY_S
        while not self._stop.is_set():
            self._wake.clear()
            try:
                left = self.forward_pending()
            except Exception:
                # The thread must not die with markers pending; the next pass tries again.
                logger.exception("forwarding spilled incomplete markers failed")
                left = 1
            if left == 0:
                pause = FIRST_RETRY_S
                self._wake.wait()
                continue
            self._wake.wait(pause)
            pause = min(pause * 2, LAST_RETRY_S)

    def stop(self, timeout_s: float) -> None:
        """Stop the thread after its current pass; idempotent."""
        with self._state_lock:
            self._stop.set()
            self._wake.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
