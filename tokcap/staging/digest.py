"""The staging digests, bit for bit as Gym 0.7.0 computes them.

A trainer without Gym verifies staged rows with these, so each must give Gym's hex digest for the same
input (tests compare them on generated inputs and on Gym's golden vector). Every digest is SHA-256 over a
domain tag and length-delimited big-endian fields. Masks and log probs enter as float32 bit patterns,
which is why the store must return the exact float64 values it was given: a float32 copy hashes the same
and trains on different numbers.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from itertools import compress
from operator import not_
from typing import Any

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "carry_is_zero",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "hash_token_ids",
    "masks_are_binary",
]

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

_CALL = b"nemo-gym-staging-call-v2"
_EXTRAS = b"nemo-gym-staging-extras-v1"
_PREFIX = b"nemo-gym-staging-prefix-v2"
_CHAIN = b"nemo-gym-staging-chain-v1"
_U64 = struct.Struct(">Q")
_MAX_U64 = 2**64 - 1
_BINARY = frozenset({0.0, 1.0})


def _only(kind: type, values: Sequence[Any]) -> bool:
    """Whether every value is exactly of ``kind`` (no subclass such as ``bool``), checked in C."""
    return set(map(type, values)) <= {kind}


def masks_are_binary(masks: Sequence[float]) -> bool:
    """Whether every mask is 0.0 or 1.0 (a NaN is neither), checked in C."""
    return set(masks) <= _BINARY


def carry_is_zero(masks: Sequence[float], log_probs: Sequence[float]) -> bool:
    """Whether every log prob under a 0.0 mask is 0.0; the masks must already be binary.

    ``compress`` keeps the log probs whose mask is falsy (0.0), and any of them that is not 0.0 (a NaN
    included) is truthy.
    """
    return not any(compress(log_probs, map(not_, masks)))


def _u64(value: int, what: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _MAX_U64:
        raise ValueError(f"{what} must be an unsigned 64-bit integer, got {value!r}")
    return _U64.pack(value)


def _sized(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _text(value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return _sized(value.encode("utf-8"))


def _check_hex(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        raise ValueError(f"{what} must be a lowercase SHA-256 hex digest")
    return value


def _token_ids(ids: Sequence[int]) -> bytes:
    """Length, then each id as an unsigned 64-bit big-endian number.

    Packed in one call when every id is a plain int in range (a thousand ids cost 15 us instead of 300);
    otherwise id by id, to refuse the first bad one as Gym does.
    """
    if _only(int, ids):
        try:
            return _U64.pack(len(ids)) + struct.pack(f">{len(ids)}Q", *ids)
        except struct.error:
            pass
    out = bytearray(_u64(len(ids), "token count"))
    for token in ids:
        out += _u64(token, "token id")
    return bytes(out)


def _float32s(values: Sequence[float], what: str) -> bytes:
    """Length, then each value's float32 bit pattern; packed in one call when every value is a finite float."""
    if _only(float, values) and all(map(math.isfinite, values)):
        try:
            return _U64.pack(len(values)) + struct.pack(f">{len(values)}f", *values)
        except OverflowError:
            pass
    out = bytearray(_u64(len(values), f"{what} length"))
    for value in values:
        if type(value) is not float or not math.isfinite(value):
            raise ValueError(f"{what} values must be finite Python floats, got {value!r}")
        try:
            packed = struct.pack(">f", value)
        except (OverflowError, struct.error) as exc:
            raise ValueError(f"{what} value cannot be represented as float32: {value!r}") from exc
        if not math.isfinite(struct.unpack(">f", packed)[0]):
            raise ValueError(f"{what} value overflows float32: {value!r}")
        out += packed
    return bytes(out)


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """The hash of one exact cumulative token sequence (a row's ``cumulative_hash``)."""
    return hashlib.sha256(_PREFIX + _token_ids(token_ids)).hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """``H(parent chain hash || delta)``: continuity of a chain without its cumulative tokens."""
    head = (
        b"\x00"
        if parent_chain_hash is None
        else b"\x01" + bytes.fromhex(_check_hex(parent_chain_hash, "parent_chain_hash"))
    )
    return hashlib.sha256(_CHAIN + head + _token_ids(token_ids_delta)).hexdigest()


_LARGE = 1 << 16
"""Strings at least this long are hashed in place instead of copied into the running buffer."""


class _ExtrasEncoder:
    """Feeds the extras encoding into a hash as it goes: a MiB-long routed-experts string is never copied."""

    def __init__(self, hasher: Any) -> None:
        self._hasher = hasher
        self._buffer = bytearray()

    def feed(self, value: Any) -> None:
        out = self._buffer
        kind = type(value)
        if value is None:
            out += b"N"
        elif kind is bool:
            out += b"B\x01" if value else b"B\x00"
        elif kind is int:
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"extras integer is outside signed 64-bit range: {value}")
            out += b"I" + struct.pack(">q", value)
        elif kind is float:
            if not math.isfinite(value):
                raise ValueError(f"extras floats must be finite, got {value!r}")
            out += b"F" + struct.pack(">d", value)
        elif kind is str:
            out += b"S"
            self._text(value)
        elif kind is list:
            out += b"L" + _u64(len(value), "extras list length")
            for item in value:
                self.feed(item)
        elif kind is dict:
            if any(type(key) is not str for key in value):
                raise TypeError("extras mappings must have string keys")
            keys = sorted(value, key=lambda key: key.encode("utf-8"))
            out += b"D" + _u64(len(keys), "extras mapping length")
            for key in keys:
                self._text(key)
                self.feed(value[key])
        else:
            raise TypeError(f"extras contain unsupported value type {kind.__name__}")

    def _text(self, value: str) -> None:
        data = value.encode("utf-8")
        self._buffer += _U64.pack(len(data))
        if len(data) < _LARGE:
            self._buffer += data
            return
        self._hasher.update(self._buffer)
        self._buffer.clear()
        self._hasher.update(data)

    def hexdigest(self) -> str:
        self._hasher.update(self._buffer)
        self._buffer.clear()
        return str(self._hasher.hexdigest())


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """The digest of an extras envelope; exact about JSON types (1 and 1.0 differ, tuples are refused)."""
    if extras is not None and not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    encoder = _ExtrasEncoder(hashlib.sha256(_EXTRAS + bytes([EXTRAS_DIGEST_VERSION])))
    encoder.feed(None if extras is None else dict(extras))
    return encoder.hexdigest()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """The digest of one staged call; raises ``ValueError`` for any row Gym's digest refuses."""
    versions = (schema_version, digest_version, extras_digest_version)
    expected = (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
    for name, value, wanted in zip(("schema", "digest", "extras digest"), versions, expected, strict=True):
        if type(value) is not int or value != wanted:
            raise ValueError(f"unsupported staging {name} version {value}")
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in ("text", "token_in"):
        raise ValueError(f"unsupported capture mode {mode!r}")
    if parent_call_id is None and (prev_len != 0 or mode != "text"):
        raise ValueError("a parentless call must be a text-mode root with prev_len == 0")
    if parent_call_id is not None and (prev_len == 0 or mode != "token_in"):
        raise ValueError("a child call must use token_in mode with prev_len > 0")
    if delta_len == 0:
        raise ValueError("a staged call delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError(f"delta_len {delta_len} does not match {len(token_ids_delta)} token ids")
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise ValueError("token ids, masks and log probabilities must have equal lengths")
    if not masks_are_binary(token_mask_delta):
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if not carry_is_zero(token_mask_delta, generation_log_probs_delta):
        raise ValueError("prompt-carry log probabilities must be 0.0")
    if cum_len != prev_len + delta_len:
        raise ValueError(f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})")
    _check_hex(extras_digest, "extras_digest")
    body = bytearray(struct.pack(">BBB", *versions))
    body += _text(rollout_id) + _text(model_call_id)
    body += b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id)
    body += _text(mode)
    for name, number in (("prev_len", prev_len), ("delta_len", delta_len), ("cum_len", cum_len)):
        body += _u64(number, name)
    body += _u64(weight_version, "weight_version")
    body += _sized(_token_ids(token_ids_delta))
    body += _sized(_float32s(token_mask_delta, "token_mask_delta"))
    body += _sized(_float32s(generation_log_probs_delta, "generation_log_probs_delta"))
    body += bytes.fromhex(extras_digest)
    for digest_name, digest in (("chain_hash", chain_hash), ("cumulative_hash", cumulative_hash)):
        if not isinstance(digest, str):
            raise TypeError(f"{digest_name} must be a digest string")
        body += b"\x01" + bytes.fromhex(_check_hex(digest, digest_name))
    return hashlib.sha256(_CALL + bytes(body)).hexdigest()
