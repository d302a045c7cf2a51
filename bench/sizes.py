"""Bytes per token on the wire (message values before compression) and what the JSON events would take.

Only put events are counted: they carry the tokens; intents and commands are a few hundred bytes each.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.load import PreparedWorkload
from tokcap.log.events import PutEvent, encode_event
from transports.kafka.wire.codec import encode_event_messages

__all__ = ["WireSizes", "wire_sizes"]


def _never_chunked() -> str:
    return "bench:0"


@dataclass(frozen=True)
class WireSizes:
    """Encoded sizes of every put of a workload."""

    packed_bytes: int
    json_bytes: int
    tokens: int
    generated_tokens: int

    @property
    def packed_per_token(self) -> float:
        """Message value bytes per token carried (prompt and generated), as the sink sends them."""
        return self.packed_bytes / self.tokens

    @property
    def json_per_token(self) -> float:
        """The same events as canonical JSON, per token: what packing saves."""
        return self.json_bytes / self.tokens


def wire_sizes(workload: PreparedWorkload) -> WireSizes:
    """Encode every put as the sink does and as plain JSON, and add up the value bytes."""
    packed = plain = 0
    for slot in workload.slots:
        for rollout_id, entries in slot:
            for entry in entries:
                event = PutEvent(rollout_id=rollout_id, writer="bench-writer", entry=entry)
                packed += sum(
                    len(m.value) for m in encode_event_messages(event, next_chunk_group=_never_chunked)
                )
                plain += len(encode_event(event))
    return WireSizes(packed, plain, workload.tokens, workload.generated_tokens)
