"""Restore wire deltas to the exact puts their sink was given, from the parent messages they link.

A wire delta (``codec.WireDelta``) names its parent by partition and offset. The parent's prompt and
generation come from the recent puts this reader decoded (kept by reference, bounded in tokens), or,
when it did not keep them (a materializer resumed past the parent, a long replay that forgot it), from
the log itself through ``read`` (``offset_reader.OffsetReader``). Either way they are the bytes at that
offset, so a clean run, a resumed run and a replay restore the same entry; the parent may itself be a
delta, restored the same way. The restored prompt must match the digest the sink computed over the
original prompt, or the delta is refused (``WireDeltaError``) and dead-lettered: never applied wrong.

A parent must be a whole (not chunked) put message with the child's key and the call id the link names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.log.events import PutEvent
from transports.kafka.errors import WireDeltaError
from transports.kafka.wire.codec import (
    LogMessage,
    ParentLink,
    WireDelta,
    decode_message,
    decode_wire_delta,
    headers_to_dict,
    is_wire_delta,
    read_chunk_header,
)

__all__ = ["DEFAULT_KEPT_PER_ROLLOUT", "DEFAULT_KEPT_TOKENS", "ParentRead", "ParentRestorer"]

DEFAULT_KEPT_TOKENS = 4_000_000
"""Tokens of decoded puts kept as parents over every rollout; a forgotten parent is read from the log."""

DEFAULT_KEPT_PER_ROLLOUT = 2
"""Puts kept per rollout: a sink links the latest, or the one before it."""

ParentRead = Callable[[int, int], LogMessage | None]
"""Reads the message at ``(partition, offset)``; ``None`` when the log does not hold it."""


@dataclass(frozen=True)
class _Kept:
    """A decoded put kept as a possible parent; its lists are the applied event's own, not copies."""

    key: bytes
    model_call_id: str
    prompt: list[int]
    generation: list[int]

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.generation)


class ParentRestorer:
    """Keeps recent puts by position and rebuilds the wire deltas that link them."""

    def __init__(
        self,
        read: ParentRead | None = None,
        *,
        max_tokens: int = DEFAULT_KEPT_TOKENS,
        per_rollout: int = DEFAULT_KEPT_PER_ROLLOUT,
    ) -> None:
        self._read = read
        self._max_tokens = max_tokens
        self._per_rollout = per_rollout
        self._kept: OrderedDict[tuple[int, int], _Kept] = OrderedDict()
        self._by_key: dict[bytes, list[tuple[int, int]]] = {}
        self._tokens = 0
        self.reads = 0
        """Parents read from the log because they were not kept (a counter for benchmarks and tests)."""

    # ------------------------------------------------------------------ keeping

    def remember(self, key: bytes, partition: int, offset: int, event: PutEvent) -> None:
        """Keep a put decoded from the whole message at this position, as the parent of later deltas."""
        entry = event.entry
        kept = _Kept(key, entry.model_call_id, entry.prompt_token_ids, entry.generation_token_ids)
        if kept.tokens > self._max_tokens:
            return
        position = (partition, offset)
        if position in self._kept:
            return
        self._kept[position] = kept
        self._tokens += kept.tokens
        positions = self._by_key.setdefault(key, [])
        positions.append(position)
        while len(positions) > self._per_rollout:
            self._drop(positions.pop(0))
        while self._tokens > self._max_tokens and self._kept:
            oldest = next(iter(self._kept))
            self._by_key[self._kept[oldest].key].remove(oldest)
            self._drop(oldest)

    def forget(self, key: bytes) -> None:
        """Forget a rollout's kept puts (it was retired or deleted); a later delta reads its parent again."""
        for position in self._by_key.pop(key, []):
            self._drop(position)

    def _drop(self, position: tuple[int, int]) -> None:
        kept = self._kept.pop(position, None)
        if kept is not None:
            self._tokens -= kept.tokens
            if not self._by_key.get(kept.key, True):
                self._by_key.pop(kept.key, None)

    @property
    def kept_tokens(self) -> int:
        """Tokens currently kept."""
        return self._tokens

    # ---------------------------------------------------------------- restoring

    def restore(
        self,
        key: bytes,
        partition: int,
        offset: int,
        delta: WireDelta,
        *,
        keep: bool = True,
        read: ParentRead | None = None,
    ) -> PutEvent:
        """The exact put a wire delta at this position carries; ``WireDeltaError`` when it cannot be proven.

        ``keep`` is false for a delta reassembled from chunks: only whole messages are parents. ``read``
        replaces the restorer's own way to read a parent it did not keep, for this call.
        """
        chain: list[tuple[int, WireDelta]] = [(offset, delta)]
        link = self._check_link(partition, offset, delta.link)
        while True:
            kept = self._kept.get((partition, link.offset))
            if kept is not None:
                self._kept.move_to_end((partition, link.offset))
                self._check_parent(link, kept.key == key, kept.model_call_id)
                prefix = kept.prompt + kept.generation
                break
            found = self._parent_message(key, partition, link, read or self._read)
            if isinstance(found, PutEvent):
                prefix = found.entry.prompt_token_ids + found.entry.generation_token_ids
                break
            chain.append((link.offset, found))
            link = self._check_link(partition, link.offset, found.link)
        event: PutEvent | None = None
        for position, step in reversed(chain):
            if event is not None:  # the link restored last is the parent of this one
                prefix = event.entry.prompt_token_ids + event.entry.generation_token_ids
            event = step.restore(prefix)
            if keep or position != offset:
                self.remember(key, partition, position, event)
        assert event is not None
        return event

    @staticmethod
    def _check_link(partition: int, offset: int, link: ParentLink) -> ParentLink:
        if link.partition != partition:
            raise WireDeltaError(
                f"the wire delta at offset {offset} links partition {link.partition}, not its own {partition}"
            )
        if link.offset >= offset:
            raise WireDeltaError(
                f"the wire delta at offset {offset} links offset {link.offset}, not an earlier one"
            )
        return link

    @staticmethod
    def _check_parent(link: ParentLink, same_key: bool, call_id: str) -> None:
        if not same_key:
            raise WireDeltaError(f"the parent at offset {link.offset} is another rollout's message")
        if call_id != link.model_call_id:
            raise WireDeltaError(
                f"the parent at offset {link.offset} is call {call_id!r}, the link names {link.model_call_id!r}"
            )

    def _parent_message(
        self, key: bytes, partition: int, link: ParentLink, read: ParentRead | None
    ) -> PutEvent | WireDelta:
        """The parent read from the log: a whole put (kept), or a wire delta still to restore."""
        where = f"parent {link.model_call_id!r} at partition {partition} offset {link.offset}"
        if read is None:
            raise WireDeltaError(f"{where} was not kept by this reader, and it has no way to read the log")
        message = read(partition, link.offset)
        self.reads += 1
        if message is None:
            raise WireDeltaError(f"{where} is no longer in the log (retention?)")
        try:
            headers = headers_to_dict(message.headers)
            if read_chunk_header(headers) is not None:
                raise WireDeltaError(f"{where} is a chunk, not a whole put")
            if is_wire_delta(headers):
                delta = decode_wire_delta(message.key, message.value, headers)
                self._check_parent(link, message.key == key, str(delta.model_call_id))
                return delta
            event = decode_message(message.key, message.value, headers)
        except (EventDecodeError, NewerSchemaError) as exc:
            if isinstance(exc, WireDeltaError):
                raise
            raise WireDeltaError(f"{where} cannot be decoded: {exc}") from exc
        if not isinstance(event, PutEvent):
            raise WireDeltaError(f"{where} is a {event.type.value} event, not a put")
        self._check_parent(link, message.key == key, event.entry.model_call_id)
        self.remember(key, partition, link.offset, event)
        return event
