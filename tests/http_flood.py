"""Holds idle and slow (slowloris) connections open against one HTTP port, as a scraper gone wrong would.

Run as a process so that its sockets and its threads take nothing from the test that probes the server::

    python tests/http_flood.py PORT --idle 300 --slow 40 --seconds 60

Each idle connection sends nothing; each slow one sends the start of a request head and then one more header
line every ``--trickle`` seconds, never finishing it. A connection the server closes is opened again at
once, so the pressure lasts until stdin closes or ``--seconds`` pass. It prints ``holding`` once every
connection was opened the first time, and on exit one JSON line of counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import selectors
import socket
import sys
import threading
import time

_HEAD_START = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"


class Flood:
    def __init__(self, port: int, idle: int, slow: int, trickle_s: float) -> None:
        self.address = ("127.0.0.1", port)
        self.idle = idle
        self.slow = slow
        self.trickle_s = trickle_s
        self.selector = selectors.DefaultSelector()
        self.slow_sockets: dict[socket.socket, int] = {}
        self.opened = 0
        self.closed_by_server = 0
        self.refused_connects = 0

    def open(self, slow: bool) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=1.0)
        except OSError:
            self.refused_connects += 1
            return
        self.opened += 1
        sock.setblocking(False)
        if slow:
            with contextlib.suppress(OSError):
                sock.send(_HEAD_START)
            self.slow_sockets[sock] = 0
        self.selector.register(sock, selectors.EVENT_READ, slow)

    def reap(self, timeout_s: float) -> tuple[int, int]:
        """Close what the server closed (or answered); return how many idle and slow ones to open again."""
        idle = slow = 0
        for key, _ in self.selector.select(timeout_s):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                continue  # an answer (a refusal); the close follows
            self.closed_by_server += 1
            self.selector.unregister(sock)
            self.slow_sockets.pop(sock, None)
            sock.close()
            if key.data:
                slow += 1
            else:
                idle += 1
        return idle, slow

    def trickle(self) -> None:
        for sock in list(self.slow_sockets):
            self.slow_sockets[sock] += 1
            with contextlib.suppress(OSError):
                sock.send(b"X-Slow-%d: a\r\n" % self.slow_sockets[sock])

    def run(self, seconds: float, stop: threading.Event) -> dict[str, int]:
        for _ in range(self.idle):
            self.open(slow=False)
        for _ in range(self.slow):
            self.open(slow=True)
        print("holding", flush=True)
        deadline = time.monotonic() + seconds
        next_trickle = time.monotonic() + self.trickle_s
        while time.monotonic() < deadline and not stop.is_set():
            idle, slow = self.reap(0.05)
            for _ in range(idle):
                self.open(slow=False)
            for _ in range(slow):
                self.open(slow=True)
            if time.monotonic() >= next_trickle:
                self.trickle()
                next_trickle = time.monotonic() + self.trickle_s
        held = len(self.selector.get_map())
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        return {
            "opened": self.opened,
            "closed_by_server": self.closed_by_server,
            "refused_connects": self.refused_connects,
            "held_at_end": held,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--slow", type=int, default=40)
    parser.add_argument("--trickle", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.idle + args.slow + 64
    if soft < wanted and (hard == resource.RLIM_INFINITY or hard >= wanted):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    stop = threading.Event()

    def wait_for_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    counts = Flood(args.port, args.idle, args.slow, args.trickle).run(args.seconds, stop)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
