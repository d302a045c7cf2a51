"""Whether a broker answers: a TCP connect to its port, and a Kafka ApiVersions round trip.

Only the standard library: the probe runs before any Kafka client is installed.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from .processes import is_our_broker
from .security import read_security


def _api_versions_ok(host: str, port: int, timeout: float = 2.0) -> bool:
    """Send a Kafka ApiVersions v0 request and check the broker answers without error.

    A TCP connect already implies readiness for a fixed port, but a real protocol round trip also
    catches a foreign process that happens to hold the port.
    """
    client_id = b"tokcap-probe"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exact(s, 4)
            (size,) = struct.unpack(">i", header)
            payload = _recv_exact(s, min(size, 65536))
    except OSError:
        return False
    if len(payload) < 6:
        return False
    correlation_id, error_code = struct.unpack(">ih", payload[:6])
    return bool(correlation_id == 7 and error_code == 0)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    """Read exactly n bytes or raise, since recv may return short reads."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf.extend(chunk)
    return bytes(buf)


def answers(bootstrap: str, timeout: float = 2.0) -> bool:
    """True if a Kafka broker at host:port answers an ApiVersions request."""
    host, _, port = bootstrap.rpartition(":")
    try:
        return _api_versions_ok(host or "127.0.0.1", int(port), timeout)
    except ValueError:
        return False


def port_open(port: int) -> bool:
    """A successful TCP connect to the fixed broker port means the broker is unfenced and serving."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_port(bootstrap: str, pid: int | None, state_dir: Path, timeout: float) -> bool:
    """Wait for the listening socket, then confirm with a protocol round trip; fail fast if the JVM died."""
    port = int(bootstrap.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not is_our_broker(pid, state_dir):
            return False
        if port_open(port) and (read_security(state_dir) is not None or answers(bootstrap)):
            return True
        time.sleep(0.1)
    return False
