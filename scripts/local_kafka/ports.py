"""Free loopback ports for a broker, chosen so a restart can bind the same ones again."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    """True if nothing holds 127.0.0.1:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(exclude: frozenset[int] = frozenset()) -> int:
    """A free loopback port for the broker, chosen in Python so the config holds a fixed port.

    Ports are drawn below the kernel's ephemeral range when possible: a restart rebinds the same
    port, and a port inside the range could meanwhile be taken by the local end of some client's
    outgoing connection (e.g. a producer reconnecting to the stopped broker).
    """
    lo, _ = _ephemeral_range()
    if lo > 12000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(10000, lo)
            if port not in exclude and _bindable(port):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port
