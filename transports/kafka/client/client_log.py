"""librdkafka's own log lines, sent through Python logging, scrubbed of secrets and rate-limited.

Left alone, librdkafka prints straight to stderr: against a broker that refuses the credentials that is
about 200 lines in 30 s, some of them echoing configuration values. Every client tokcap builds passes a
``ClientLog`` as confluent-kafka's ``logger`` setting, so the lines reach the logger
``transports.kafka.librdkafka`` instead, at most ``limit`` per ``window_s`` per client, with one line saying
how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transports.kafka.wire.redaction import Redactor

__all__ = ["DEFAULT_LOG_LIMIT", "DEFAULT_LOG_WINDOW_S", "LIBRDKAFKA_LOGGER", "ClientLog"]

LIBRDKAFKA_LOGGER = logging.getLogger("transports.kafka.librdkafka")
"""Where librdkafka's log lines go; they would otherwise be printed straight to stderr."""

DEFAULT_LOG_LIMIT = 10
"""Lines one client may log per window; a reconnect loop repeats the same few lines forever."""

DEFAULT_LOG_WINDOW_S = 30.0


class ClientLog:
    """The object confluent-kafka calls as ``logger.log(level, fmt, *args)`` for each librdkafka line."""

    def __init__(
        self,
        redactor: Redactor,
        *,
        target: logging.Logger = LIBRDKAFKA_LOGGER,
        limit: int = DEFAULT_LOG_LIMIT,
        window_s: float = DEFAULT_LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redactor = redactor
        self._target = target
        self._limit = limit
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._logged = 0
        self._suppressed = 0

    def __repr__(self) -> str:
        """Names the target logger only."""
        return f"ClientLog(target={self._target.name!r})"

    def log(self, level: int, msg: object, *args: object) -> None:
        """Format, scrub and forward one line unless this window's budget is spent."""
        if not self._target.isEnabledFor(level):
            return
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            text = " ".join(str(part) for part in (msg, *args))
        with self._lock:
            now = self._clock()
            if now - self._window_start >= self._window_s:
                suppressed, self._suppressed = self._suppressed, 0
                self._window_start, self._logged = now, 0
                if suppressed:
                    self._target.warning(
                        "librdkafka: %d more log lines in the last %.0f s were not shown",
                        suppressed,
                        self._window_s,
                    )
            if self._logged >= self._limit:
                self._suppressed += 1
                return
            self._logged += 1
        self._target.log(level, "%s", self._redactor.scrub(text))
