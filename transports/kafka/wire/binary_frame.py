"""The binary frame of a packed, staged or wire-delta value: magic, a JSON head, then raw bytes.

Layout: four magic bytes naming the value's kind, the head's length as a little-endian u32, the head as
JSON, then the raw bytes the head describes (token arrays, staged blobs). One layout for every binary value,
so a reader checks its bounds in one place.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from tokcap.errors import EventDecodeError

__all__ = ["frame", "read_frame"]


def frame(magic: bytes, head: bytes, tail: list[bytes]) -> bytes:
    """A binary value: four magic bytes, the head's length (little-endian u32), the JSON head, then raw bytes."""
    return b"".join([magic, struct.pack("<I", len(head)), head, *tail])


def read_frame(value: bytes, magic: bytes, what: str) -> tuple[Any, int]:
    """The parsed JSON head of a binary value (``frame``) and where the bytes after it start."""
    if len(value) < 8 or value[:4] != magic:
        raise EventDecodeError(f"{what} does not start with the {magic.decode()} magic")
    (head_length,) = struct.unpack_from("<I", value, 4)
    head_end = 8 + head_length
    if head_end > len(value):
        raise EventDecodeError(f"{what} is shorter than its header claims")
    try:
        return orjson.loads(value[8:head_end]), head_end
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"{what} header is not valid JSON: {exc}") from exc
