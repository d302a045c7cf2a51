"""The materializer's tuning, in one value: how far it reads ahead, how it paces the sweep, how long it waits.

Every knob trades one thing for another; none changes what is applied or what any answer is (the store ends
as a clean in-order replay leaves it whatever they are). ``DEFAULT_SETTINGS`` is what a materializer uses
unless it is given others. ``docs/performance.md`` has the measurements behind the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokcap.errors import InvalidInputError
from tokcap.files.log_projection import HOT_ROLLOUTS, HOT_TOKENS

__all__ = ["DEFAULT_SETTINGS", "MaterializerSettings", "check_block_messages"]


def check_block_messages(block_messages: object) -> int:
    """A durable block bound, refused unless it is a positive whole number of messages."""
    if isinstance(block_messages, bool) or not isinstance(block_messages, int) or block_messages < 1:
        raise InvalidInputError(
            f"block_messages must be a positive number of messages, got {block_messages!r}"
        )
    return block_messages


@dataclass(frozen=True)
class MaterializerSettings:
    """What a materializer's loop trades, knob by knob."""

    read_ahead_messages: int = 20_000
    """Most messages read and routed but not yet applied, over all partitions. More sees a command sooner
    behind a backlog (it goes first only once read); fewer holds less memory."""

    read_ahead_bytes: int = 16 * 1024 * 1024
    """Most wire bytes (keys and values) held read ahead: the memory bound of a large backlog. Decoded, an
    entry's token ids take about ten times their wire size."""

    read_step: int = 1_000
    """Messages read and routed per loop turn. Larger reads a burst in fewer turns; smaller carries out
    commands already read sooner."""

    block_messages: int = 1_000
    """Most messages the in-order sweep applies in one durable block (one sync and a checkpoint). Larger writes
    each rollout's state fewer times (its largest cost); smaller applies less again after a crash."""

    sweep_step_messages: int = 25
    """Most messages swept between two reads: how long a freeze read meanwhile can sit behind the sweep."""

    sweep_step_s: float = 0.005
    """Longest a sweep step runs before the loop reads again. Shorter answers a freeze read meanwhile sooner
    when other threads hold the interpreter lock; longer reads less often."""

    settle_step_s: float = 0.005
    """Time given to decoding messages read ahead between two sweep steps. More spreads a burst of freezes'
    decoding over the time before it; less gives that time to the sweep."""

    decode_first_tokens: int = 2_000_000
    """Most tokens decoded ahead and not asked for yet while decoding goes first (a source is answered in
    this process). More decodes a round's puts before its burst of freezes; less bounds the memory held."""

    first_command_block: int = 100
    """Decisions carried out for commands in a first block before their sources are answered. Smaller
    answers the first commands of a burst sooner; larger shares a sync between more of them."""

    most_command_block: int = 3_200
    """The largest block of a burst of commands (each block of a burst doubles up to it)."""

    poll_timeout_s: float = 0.2
    """How long a read waits for a message when nothing is left to apply: longer wakes an idle loop less."""

    unknown_topic_wait_s: float = 5.0
    """How long a materializer starting on a topic its broker does not know yet asks again before failing."""

    metadata_timeout_s: float = 30.0
    """How long a metadata request (and the reads of the topic's id and limits at start) may take."""

    id_read_timeout_s: float = 3.0
    """How long one read of the topic's id may wait; a failed read is tried again with a new admin client."""

    hot_tokens: int = HOT_TOKENS
    """Prompt and generated tokens of entries the projection keeps: more answers more freezes from memory."""

    hot_rollouts: int = HOT_ROLLOUTS
    """Rollout states the projection keeps after a flush: more reads fewer states back from their files."""

    def __post_init__(self) -> None:
        check_block_messages(self.block_messages)


DEFAULT_SETTINGS = MaterializerSettings()
"""The settings a materializer uses unless given others."""
