"""The hot paths' sha256 keeps the GIL but gives hashlib's digest for every length."""

from __future__ import annotations

import hashlib
import sys
import threading

from hypothesis import given
from hypothesis import strategies as st

from tokcap.log.hashing import PIECE_BYTES, sha256_hex


@given(st.binary(max_size=3 * PIECE_BYTES + 5))
def test_the_digest_is_hashlibs_for_any_bytes(data: bytes) -> None:
    assert sha256_hex(data) == hashlib.sha256(data).hexdigest()


def test_the_digest_is_hashlibs_at_every_piece_boundary() -> None:
    for size in (0, 1, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1, 2 * PIECE_BYTES, 2 * PIECE_BYTES + 1):
        data = bytes(range(256)) * (size // 256 + 1)
        assert sha256_hex(data[:size]) == hashlib.sha256(data[:size]).hexdigest(), size


def test_no_other_thread_runs_while_a_large_buffer_is_hashed() -> None:
    """Counted, not timed: a spinning thread gets the GIL only if hashing lets go of it.

    The switch interval is raised so the interpreter never forces a hand-over within the test; hashlib's own
    ``sha256(data)`` would hand the GIL to the spinner on every call.
    """
    data = b"x" * 200_000
    ticks = 0
    stop = threading.Event()
    started = threading.Event()

    def spin() -> None:
        nonlocal ticks
        started.set()
        while not stop.is_set():
            ticks += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        started.wait()
        before = ticks
        for _ in range(20):
            sha256_hex(data)
        during = ticks - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        spinner.join()
    assert during == 0
