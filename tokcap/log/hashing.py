"""sha256 of large buffers without letting go of the GIL: the digests of the hot paths, in one place.

hashlib releases the GIL while it hashes 2,048 bytes or more at once. The hash itself takes microseconds,
but taking the GIL back afterwards waits for whichever thread holds it. In a process whose other threads
keep the interpreter busy (a model server's event loop beside the sink, the load beside a trainer's
materializer), each such hash measured about 1 ms of wall time instead of 20 us, and a put or a freeze
answer makes several. Feeding the hash in pieces just under that size keeps the GIL for the few
microseconds it takes; the digest is the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["PIECE_BYTES", "sha256_hex", "sha256_hex_of"]

PIECE_BYTES = 2047
"""Largest piece hashlib hashes without releasing the GIL (it releases from 2,048 bytes)."""


def sha256_hex(data: bytes) -> str:
    """The sha256 hex digest of ``data``, computed without releasing the GIL."""
    if len(data) <= PIECE_BYTES:
        return hashlib.sha256(data).hexdigest()
    return sha256_hex_of((data,))


def sha256_hex_of(parts: Iterable[bytes]) -> str:
    """The sha256 hex digest of the parts joined, without joining them (a copy) and without releasing the GIL."""
    hashed = hashlib.sha256()
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(view), PIECE_BYTES):
            hashed.update(view[start : start + PIECE_BYTES])
    return hashed.hexdigest()
