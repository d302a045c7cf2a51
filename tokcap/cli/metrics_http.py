"""A small HTTP server for ``/metrics`` and ``/healthz``, for processes that have no web app of their own.

``tokcap materialize --metrics-port`` runs one. ``/metrics`` is prometheus-client's own WSGI exposition of
``tokcap.metrics.REGISTRY`` (content negotiation and gzip included); ``/healthz`` answers 200 while the given
check passes and 503 with a short JSON reason while it does not, so an orchestrator's readiness probe can
hold traffic back until the process is useful. It listens on 127.0.0.1 unless told otherwise: metrics name
topics, which a node's neighbours need not see.

It shares its process with the materializer, so no client may take what the materializer needs. Whatever
clients do, it holds at most ``HttpLimits.max_connections`` connections and a fixed set of threads: one
that does all socket work without blocking, a few that build answers, and one that answers ``/healthz`` alone
so that a slow scrape never holds a probe back. At the limit a new connection takes the place of the oldest one
still reading its request (else of the oldest one still being sent its answer), so idle and slow clients cannot
keep a probe out; only when every connection is being answered is the new one refused with a 503 and closed at
once, never left queued. A request head must arrive within
``header_timeout_s`` with no pause longer than ``idle_timeout_s``, an answer must be taken within
``send_timeout_s``, and a connection serves one request. A well-kept server library was weighed first:
waitress, for one, stops accepting at its connection limit (new connections wait in the listen backlog) and
keeps a connection that trickles its head one byte at a time, which are the two things this server must not do.

A process with its own ASGI app mounts the registry instead (``docs/operations.md``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import unquote

from prometheus_client import make_wsgi_app

from tokcap.errors import InvalidInputError
from tokcap.metrics import HTTP_DROPPED, REGISTRY

__all__ = ["DEFAULT_METRICS_HOST", "Health", "HealthCheck", "HttpLimits", "MetricsServer", "logger"]

logger = logging.getLogger(__name__)

DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Health:
    """One answer of a health check: healthy or not, and why, in a sentence an operator can act on."""

    healthy: bool
    reason: str


HealthCheck = Callable[[], Health]

_StartResponse = Callable[..., Any]


@dataclass(frozen=True)
class HttpLimits:
    """The most the server may take from its process, and how long a client may hold any of it."""

    max_connections: int = 32
    """Open connections at once; past it a new one is refused with a 503 and closed."""
    idle_timeout_s: float = 5.0
    """Longest pause in a request head before the connection is closed."""
    header_timeout_s: float = 10.0
    """Time from accepting a connection to having its whole request head."""
    send_timeout_s: float = 10.0
    """Time for the client to take the whole answer."""
    max_head_bytes: int = 8192
    """Largest request head; a larger one is answered 431."""
    metrics_threads: int = 2
    """Threads that build answers other than ``/healthz`` (one more answers ``/healthz`` alone)."""
    queued_requests: int = 4
    """Requests waiting for each set of threads; past it a request is answered 503."""
    backlog: int = 64
    """The listen backlog; the server accepts (or refuses) what arrives as fast as it can."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_head_bytes", "metrics_threads", "queued_requests", "backlog"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"HttpLimits.{name} must be at least 1, not {getattr(self, name)}")
        for name in ("idle_timeout_s", "header_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"HttpLimits.{name} must be a positive number of seconds")


class _Stage(Enum):
    READING = "reading"
    ANSWERING = "answering"
    SENDING = "sending"


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    accepted_at: float
    last_read_at: float
    head: bytearray = field(default_factory=bytearray)
    stage: _Stage = _Stage.READING
    out: memoryview = field(default_factory=lambda: memoryview(b""))
    send_deadline: float = 0.0
    closed: bool = False


_ACCEPT_PAUSE_S = 1.0
"""How long accepting pauses when the process is out of descriptors (the materializer's need comes first)."""
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_LISTENER = "listener"
_WAKER = "waker"


def _plain(status: str, text: str) -> bytes:
    body = text.encode() + b"\n"
    return _response(status, [("Content-Type", "text/plain; charset=utf-8")], body, head_only=False)


def _response(status: str, headers: list[tuple[str, str]], body: bytes, *, head_only: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    lines += [
        f"{name}: {value}" for name, value in headers if name.lower() not in ("content-length", "connection")
    ]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (b"" if head_only else body)


_REFUSED = _plain("503 Service Unavailable", "the metrics server is at its connection limit; try again")
_BUSY = _plain("503 Service Unavailable", "the metrics server is busy answering other requests; try again")


class _Workers:
    """A fixed set of threads taking requests from a bounded queue; a full queue refuses, it does not wait."""

    def __init__(
        self, name: str, threads: int, queued: int, work: Callable[[_Connection, dict[str, Any]], None]
    ) -> None:
        self._jobs: queue.Queue[tuple[_Connection, dict[str, Any]] | None] = queue.Queue(queued)
        self._work = work
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{index}", daemon=True)
            for index in range(threads)
        ]

    def start(self) -> None:
        """Start the threads."""
        for thread in self._threads:
            thread.start()

    def offer(self, conn: _Connection, environ: dict[str, Any]) -> bool:
        try:
            self._jobs.put_nowait((conn, environ))
        except queue.Full:
            return False
        return True

    def stop(self, timeout_s: float) -> None:
        """Ask each thread to stop after the requests it has; a thread stuck in an answer is left behind."""
        started = [thread for thread in self._threads if thread.ident is not None]
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            for _ in started:
                self._jobs.put(None, timeout=max(0.0, deadline - time.monotonic()))
        for thread in started:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._work(*job)


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` from a few daemon threads until ``close``."""

    def __init__(
        self,
        health: HealthCheck,
        *,
        host: str = DEFAULT_METRICS_HOST,
        port: int = 0,
        on_close: Callable[[], None] | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        """Bind now (port 0 picks a free port, see ``port``); requests are served once ``start`` is called.

        ``on_close`` runs after the server stopped (the health check's own clean-up).
        """
        self._health = health
        self._on_close = on_close
        self._limits = limits or HttpLimits()
        self._metrics = make_wsgi_app(REGISTRY)
        family, kind, proto, _, address = socket.getaddrinfo(
            host,
            port,
            socket.AF_INET6 if ":" in host else socket.AF_INET,
            socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(self._limits.backlog)
            self._listener.setblocking(False)
            self._wake_reader, self._wake_writer = socket.socketpair()
        except BaseException:
            self._listener.close()
            raise
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, _WAKER)
        self._connections: dict[_Connection, None] = {}
        """Open connections in the order they were accepted (oldest first)."""
        self._answers: queue.SimpleQueue[tuple[_Connection, bytes]] = queue.SimpleQueue()
        self._accepting_again_at: float | None = None
        self._stopping = threading.Event()
        self._health_workers = _Workers(
            "tokcap-metrics-healthz", 1, self._limits.queued_requests, self._answer
        )
        self._metrics_workers = _Workers(
            "tokcap-metrics-answer", self._limits.metrics_threads, self._limits.queued_requests, self._answer
        )
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def host(self) -> str:
        """The address it listens on."""
        return str(self._listener.getsockname()[0])

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._listener.getsockname()[1])

    @property
    def limits(self) -> HttpLimits:
        """What it may take from its process."""
        return self._limits

    def start(self) -> MetricsServer:
        """Serve from daemon threads; returns at once."""
        if self._thread is None and not self._closed:
            self._health_workers.start()
            self._metrics_workers.start()
            self._thread = threading.Thread(target=self._serve, name="tokcap-metrics-http", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port; calling it again is a no-op."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
            self._health_workers.stop(5.0)
            self._metrics_workers.stop(5.0)
        for conn in list(self._connections):
            self._close(conn, None)
        self._selector.close()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # ------------------------------------------------------------------ the socket thread

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                for key, mask in self._selector.select(max(0.0, self._next_deadline(now) - now)):
                    if key.data == _LISTENER:
                        self._accept_all()
                    elif key.data == _WAKER:
                        self._take_answers()
                    elif mask & selectors.EVENT_READ:
                        self._on_readable(key.data)
                    elif mask & selectors.EVENT_WRITE:
                        self._send(key.data)
                self._expire(time.monotonic())
        except Exception:
            logger.exception("the metrics server stopped: /metrics and /healthz are no longer served")

    def _next_deadline(self, now: float) -> float:
        limits = self._limits
        deadline = now + 1.0
        if self._accepting_again_at is not None:
            deadline = min(deadline, self._accepting_again_at)
        for conn in self._connections:
            if conn.stage is _Stage.READING:
                deadline = min(
                    deadline,
                    conn.accepted_at + limits.header_timeout_s,
                    conn.last_read_at + limits.idle_timeout_s,
                )
            elif conn.stage is _Stage.SENDING:
                deadline = min(deadline, conn.send_deadline)
        return deadline

    def _expire(self, now: float) -> None:
        limits = self._limits
        if self._accepting_again_at is not None and now >= self._accepting_again_at:
            self._accepting_again_at = None
            self._selector.register(self._listener, selectors.EVENT_READ, _LISTENER)
        for conn in list(self._connections):
            if conn.stage is _Stage.READING:
                if now >= conn.accepted_at + limits.header_timeout_s:
                    self._close(conn, "header_timeout")
                elif now >= conn.last_read_at + limits.idle_timeout_s:
                    self._close(conn, "idle_timeout")
            elif conn.stage is _Stage.SENDING and now >= conn.send_deadline:
                self._close(conn, "send_timeout")

    def _accept_all(self) -> None:
        # Bounded per wake-up, so the timeouts are still enforced under a flood of new connections.
        for _ in range(2 * self._limits.max_connections):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    logger.warning(
                        "the metrics server cannot accept a connection (%s); it stops accepting for %.0f s",
                        exc,
                        _ACCEPT_PAUSE_S,
                    )
                    self._selector.unregister(self._listener)
                    self._accepting_again_at = time.monotonic() + _ACCEPT_PAUSE_S
                    return
                if exc.errno == errno.ECONNABORTED:
                    continue
                raise
            sock.setblocking(False)
            now = time.monotonic()
            self._admit(_Connection(sock, now, now))

    def _admit(self, conn: _Connection) -> None:
        """Take a new connection in, making room for it or refusing it; read what it already sent."""
        complete = self._receive(conn)
        if conn.closed:
            return
        if len(self._connections) >= self._limits.max_connections and not self._make_room():
            HTTP_DROPPED.labels("refused").inc()
            with contextlib.suppress(OSError):
                conn.sock.send(_REFUSED)
            conn.closed = True
            conn.sock.close()
            return
        self._connections[conn] = None
        if complete:
            self._dispatch(conn)
        else:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _make_room(self) -> bool:
        """Close the oldest connection still reading its request (else the oldest still sending an answer).

        Each candidate's socket is read first: a request whose head has arrived meanwhile is answered, not
        closed. So under a flood only a client that has not sent its request by the time ``max_connections``
        newer connections arrived is closed; a probe or a scrape sends its request with its connection.
        Whether there is room now.
        """
        for conn in list(self._connections):
            if len(self._connections) < self._limits.max_connections:
                return True
            if conn.stage is _Stage.READING:
                self._on_readable(conn)
                if conn.stage is _Stage.READING and not conn.closed:
                    self._close(conn, "shed")
        for conn in list(self._connections):
            if len(self._connections) < self._limits.max_connections:
                return True
            if conn.stage is _Stage.SENDING:
                self._close(conn, "shed")
        return len(self._connections) < self._limits.max_connections

    def _receive(self, conn: _Connection) -> bool:
        """Read what arrived; whether the request head is complete (a closed or oversized one closes)."""
        while True:
            try:
                data = conn.sock.recv(4096)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            if not data:
                self._close(conn, None)
                return False
            conn.head += data
            conn.last_read_at = time.monotonic()
            end = conn.head.find(b"\r\n\r\n")
            if 0 <= end <= self._limits.max_head_bytes:
                return True
            if len(conn.head) > self._limits.max_head_bytes:
                self._reply_now(conn, _plain("431 Request Header Fields Too Large", "request head too large"))
                return False

    def _on_readable(self, conn: _Connection) -> None:
        if conn.stage is _Stage.READING and self._receive(conn):
            self._selector.unregister(conn.sock)
            self._dispatch(conn)

    def _dispatch(self, conn: _Connection) -> None:
        environ = self._environ(conn)
        if environ is None:
            return
        conn.stage = _Stage.ANSWERING
        workers = self._health_workers if environ["PATH_INFO"] == "/healthz" else self._metrics_workers
        if not workers.offer(conn, environ):
            HTTP_DROPPED.labels("busy").inc()
            self._start_sending(conn, _BUSY)

    def _environ(self, conn: _Connection) -> dict[str, Any] | None:
        """The WSGI environ of the request head, or ``None`` once a malformed one was answered."""
        head = bytes(conn.head).split(b"\r\n\r\n", 1)[0].decode("latin-1")
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._reply_now(conn, _plain("400 Bad Request", "not an HTTP/1 request line"))
            return None
        method, target, version = parts
        if method not in ("GET", "HEAD"):
            self._reply_now(conn, _plain("405 Method Not Allowed", "tokcap serves GET /metrics and /healthz"))
            return None
        path, _, query = target.partition("?")
        host, port = self._listener.getsockname()[:2]
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path),
            "QUERY_STRING": query,
            "SERVER_NAME": str(host),
            "SERVER_PORT": str(port),
            "SERVER_PROTOCOL": version,
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                self._reply_now(conn, _plain("400 Bad Request", "malformed header line"))
                return None
            key = name.strip().upper().replace("-", "_")
            environ[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value.strip()
        return environ

    def _reply_now(self, conn: _Connection, response: bytes) -> None:
        """Answer a request the server refuses itself (no thread needed) and close after sending."""
        HTTP_DROPPED.labels("bad_request").inc()
        if conn in self._connections:
            with contextlib.suppress(KeyError):
                self._selector.unregister(conn.sock)
            self._start_sending(conn, response)
        else:
            with contextlib.suppress(OSError):
                conn.sock.send(response)
            conn.closed = True
            conn.sock.close()

    def _take_answers(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_reader.recv(4096):
                pass
        while True:
            try:
                conn, response = self._answers.get_nowait()
            except queue.Empty:
                return
            if not conn.closed:
                self._start_sending(conn, response)

    def _start_sending(self, conn: _Connection, response: bytes) -> None:
        conn.stage = _Stage.SENDING
        conn.out = memoryview(response)
        conn.send_deadline = time.monotonic() + self._limits.send_timeout_s
        if self._send(conn):
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _send(self, conn: _Connection) -> bool:
        """Send what the socket takes now; whether some is left (then it waits to be writable)."""
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return True
        except OSError:
            self._close(conn, None)
            return False
        conn.out = conn.out[sent:]
        if conn.out:
            return True
        self._close(conn, None)
        return False

    def _close(self, conn: _Connection, dropped: str | None) -> None:
        if conn.closed:
            return
        conn.closed = True
        if dropped is not None:
            HTTP_DROPPED.labels(dropped).inc()
        self._connections.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")

    # ------------------------------------------------------------------ the answering threads

    def _answer(self, conn: _Connection, environ: dict[str, Any]) -> None:
        try:
            response = self._run_app(environ)
        except Exception:
            logger.exception("the metrics server could not answer %s", environ.get("PATH_INFO"))
            response = _plain("500 Internal Server Error", "tokcap could not build this answer; see its log")
        self._answers.put((conn, response))
        self._wake()

    def _run_app(self, environ: dict[str, Any]) -> bytes:
        started: list[tuple[str, list[tuple[str, str]]]] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            started.append((status, headers))

        chunks = self._app(environ, start_response)
        try:
            body = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        status, headers = started[-1]
        return _response(status, headers, body, head_only=environ["REQUEST_METHOD"] == "HEAD")

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
