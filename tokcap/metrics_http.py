"""A small HTTP server for ``/metrics`` and ``/healthz``, for processes that have no web app of their own.

``tokcap materialize --metrics-port`` runs one. ``/metrics`` is prometheus-client's own WSGI exposition of
``tokcap.metrics.REGISTRY`` (content negotiation and gzip included); ``/healthz`` answers 200 while the given
check passes and 503 with a short JSON reason while it does not, so an orchestrator's readiness probe can
hold traffic back until the process is useful. It listens on 127.0.0.1 unless told otherwise: metrics name
topics, which a node's neighbours need not see.

A process with its own ASGI app mounts the registry instead (``docs/operations.md``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from tokcap.metrics import REGISTRY

__all__ = ["DEFAULT_METRICS_HOST", "Health", "HealthCheck", "MetricsServer", "logger"]

logger = logging.getLogger(__name__)

DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Health:
    """One answer of a health check: healthy or not, and why, in a sentence an operator can act on."""

    healthy: bool
    reason: str


HealthCheck = Callable[[], Health]

_StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request: a slow scrape must not hold a health probe back."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """Probes arrive every few seconds; one log line each would bury the process's own log."""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` from a daemon thread until ``close``."""

    def __init__(
        self,
        health: HealthCheck,
        *,
        host: str = DEFAULT_METRICS_HOST,
        port: int = 0,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """Bind now (port 0 picks a free port, see ``port``); requests are served once ``start`` is called.

        ``on_close`` runs after the server stopped (the health check's own clean-up).
        """
        self._health = health
        self._on_close = on_close
        self._metrics = make_wsgi_app(REGISTRY)
        self._server = make_server(host, port, self._app, _ThreadingServer, _QuietHandler)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        """The address it listens on."""
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    def start(self) -> MetricsServer:
        """Serve in a daemon thread; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="tokcap-metrics-http", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port; calling it again is a no-op."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._server.shutdown()
            thread.join()
        self._server.server_close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def _app(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return self._healthz(start_response)
        if path == "/metrics":
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"tokcap serves /metrics and /healthz\n"]

    def _healthz(self, start_response: _StartResponse) -> Iterable[bytes]:
        try:
            health = self._health()
        except Exception as exc:
            logger.exception("the health check failed")
            health = Health(False, f"the health check itself failed: {type(exc).__name__}: {exc}")
        body = json.dumps({"healthy": health.healthy, "reason": health.reason}).encode() + b"\n"
        status = "200 OK" if health.healthy else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
