"""The metrics server's limits: what idle, slow, oversized and excess clients get, and what they cannot take.

Each test opens raw sockets against a server on 127.0.0.1 with small limits and watches what the server does
to them; none measures how fast anything is.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tokcap.cli.metrics_http import Health, HealthCheck, HttpLimits, MetricsServer
from tokcap.errors import InvalidInputError
from tokcap.metrics import REGISTRY


def _healthy() -> Health:
    return Health(True, "applying")


@contextmanager
def _serving(limits: HttpLimits, health: HealthCheck = _healthy) -> Iterator[MetricsServer]:
    server = MetricsServer(health, port=0, limits=limits).start()
    try:
        yield server
    finally:
        server.close()


def _connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _get(server: MetricsServer, path: str) -> tuple[int, bytes]:
    with _connect(server) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        answer = _answer(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _closed_by_server(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the server closed this connection (without answering) before ``within_s`` passed."""
    readable, _, _ = select.select([sock], [], [], within_s)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("tokcap_metrics_http_dropped_total", {"reason": reason}) or 0.0


def _one_answering_one_queued(server: MetricsServer, socks: list[socket.socket]) -> None:
    """Send a probe on each socket; the first is taken by the health thread (which blocks), the second queues."""
    first, second = socks
    first.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
    deadline = time.monotonic() + 10
    while server._health_workers._jobs.qsize() or not any(
        conn.stage.value == "answering" for conn in list(server._connections)
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
    while not server._health_workers._jobs.qsize():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_at_its_connection_limit_a_new_request_takes_the_place_of_the_oldest_idle_connection() -> None:
    with _serving(HttpLimits(max_connections=4, idle_timeout_s=60, header_timeout_s=60)) as server:
        shed_before = _dropped("shed")
        idle = [_connect(server) for _ in range(4)]
        try:
            # The server has taken all four in before the probe arrives.
            deadline = time.monotonic() + 10
            while len(server._connections) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            status, body = _get(server, "/healthz")
            assert (status, json.loads(body)["healthy"]) == (200, True)
            assert _closed_by_server(idle[0])
            assert _dropped("shed") == shed_before + 1
            assert not _closed_by_server(idle[1], within_s=0.2)
        finally:
            for sock in idle:
                sock.close()


def test_an_idle_connection_and_a_head_trickled_past_its_deadline_are_closed() -> None:
    limits = HttpLimits(idle_timeout_s=0.3, header_timeout_s=1.0)
    with _serving(limits) as server:
        idle_before, header_before = _dropped("idle_timeout"), _dropped("header_timeout")
        with _connect(server) as idle, _connect(server) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            closed = False
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:
                # A header line every 0.1 s: never idle for long, but the head never ends.
                try:
                    slow.sendall(b"X-Slow: a\r\n")
                except OSError:
                    closed = True
                    break
                closed = _closed_by_server(slow, within_s=0.1)
            assert closed
            assert _closed_by_server(idle)
        assert _dropped("idle_timeout") >= idle_before + 1
        assert _dropped("header_timeout") == header_before + 1


def test_when_every_connection_is_being_answered_a_new_one_is_refused_at_once_not_queued() -> None:
    release = threading.Event()

    def blocked() -> Health:
        release.wait(30)
        return Health(True, "applying")

    limits = HttpLimits(max_connections=2, queued_requests=1)
    with _serving(limits, blocked) as server:
        refused_before = _dropped("refused")
        held = [_connect(server) for _ in range(2)]
        try:
            _one_answering_one_queued(server, held)
            with _connect(server) as extra:
                answer = _answer(extra)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"connection limit" in answer
            assert _dropped("refused") == refused_before + 1
            release.set()
            for sock in held:
                assert _answer(sock).startswith(b"HTTP/1.1 200 ")
        finally:
            release.set()
            for sock in held:
                sock.close()


def test_a_request_past_the_queue_of_its_threads_is_answered_busy() -> None:
    release = threading.Event()

    def blocked() -> Health:
        release.wait(30)
        return Health(True, "applying")

    with _serving(HttpLimits(queued_requests=1), blocked) as server:
        busy_before = _dropped("busy")
        first, queued = _connect(server), _connect(server)
        try:
            _one_answering_one_queued(server, [first, queued])
            status, body = _get(server, "/healthz")
            assert status == 503 and b"busy" in body
            assert _dropped("busy") == busy_before + 1
            # A scrape has threads of its own: the blocked probes do not hold it back.
            assert _get(server, "/metrics")[0] == 200
            release.set()
            assert _answer(first).startswith(b"HTTP/1.1 200 ")
            assert _answer(queued).startswith(b"HTTP/1.1 200 ")
        finally:
            release.set()
            first.close()
            queued.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", b"431"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"GET /metrics\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
    ],
)
def test_a_request_the_server_does_not_serve_is_answered_with_its_error_and_closed(
    request_bytes: bytes, status: bytes
) -> None:
    with _serving(HttpLimits()) as server, _connect(server) as sock:
        bad_before = _dropped("bad_request")
        sock.sendall(request_bytes)
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:100]
        assert _dropped("bad_request") == bad_before + 1


def test_many_idle_connections_take_no_thread_and_at_most_the_connection_limit_of_descriptors() -> None:
    with _serving(HttpLimits(max_connections=8, idle_timeout_s=60, header_timeout_s=60)) as server:
        threads_before = threading.active_count()
        shed_before = _dropped("shed")
        idle = [_connect(server) for _ in range(40)]
        try:
            deadline = time.monotonic() + 10
            while _dropped("shed") < shed_before + 32:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert len(server._connections) == 8
            assert threading.active_count() == threads_before
            assert _get(server, "/healthz")[0] == 200
        finally:
            for sock in idle:
                sock.close()


def test_a_head_request_gets_the_headers_without_the_body_and_an_unknown_path_a_404() -> None:
    with _serving(HttpLimits()) as server:
        with _connect(server) as sock:
            sock.sendall(b"HEAD /healthz HTTP/1.1\r\n\r\n")
            head, _, body = _answer(sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: " in head and body == b""
        assert _get(server, "/nothing")[0] == 404


@pytest.mark.parametrize("field", ["max_connections", "queued_requests", "idle_timeout_s"])
def test_limits_below_one_are_refused_naming_the_field(field: str) -> None:
    with pytest.raises(InvalidInputError, match=field):
        HttpLimits(**{field: 0})


def test_closing_does_not_wait_for_ever_on_an_answer_stuck_in_the_health_check() -> None:
    release = threading.Event()

    def stuck() -> Health:
        release.wait(60)
        return Health(True, "late")

    server = MetricsServer(stuck, port=0, limits=HttpLimits(queued_requests=1)).start()
    socks = [_connect(server), _connect(server)]
    try:
        _one_answering_one_queued(server, socks)
        closer = threading.Thread(target=server.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
    finally:
        release.set()
        for sock in socks:
            sock.close()
