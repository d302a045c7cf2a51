"""Every error tokcap raises, under one root.

Each class also subclasses the builtin that code written against the
``nemo_gym.token_id_capture`` contract already catches, so a caller that
catches ``ValueError`` or ``RuntimeError`` keeps working.

Error tree::

    TokcapError
    ├── InvalidInputError (ValueError)
    │   ├── InvalidRolloutIdError
    │   ├── RecordValidationError
    │   │   └── NewerSchemaError
    │   ├── TokenExtractionError
    │   ├── ConflictingEntryError
    │   ├── EventDecodeError
    │   │   └── WireDeltaError
    │   ├── EventTooLargeError
    │   ├── UnknownBuilderError
    │   └── UndeliverableBuilderError
    ├── ConfigError (ValueError)
    │   ├── SinkConfigError
    │   ├── CanonicalEncodingError
    │   ├── PartitionOwnershipConflictError
    │   └── TopicLimitsMismatchError
    ├── RolloutClosedError (RuntimeError)
    │   ├── RolloutFrozenError
    │   └── RolloutRetiredError
    ├── ReceiptVerificationError (ValueError)
    │   └── RebuildError
    ├── StagingKeyNotFoundError (LookupError)
    ├── StoreCorruptionError (RuntimeError)
    ├── StoreFormatError (RuntimeError)
    ├── StoreWriteError (OSError)
    ├── MaskFractionExceededError (RuntimeError)
    ├── InjectedFaultError (RuntimeError)
    ├── TrajectoryBuildError (RuntimeError)
    │   ├── ChainValidationError
    │   └── PrefixContiguityError (also AssertionError)
    ├── LineageLookupError (RuntimeError)
    └── TransportError (RuntimeError)
        ├── DeliveryError
        ├── DeliveryTimeoutError
        ├── TopicMismatchError
        ├── MaterializerFailedError
        │   ├── MaterializerOwnedElsewhereError
        │   ├── TopicIncarnationError
        │   └── OffsetGapError
        ├── PartitionOwnerMissingError
        ├── BrokerUnreachableError
        ├── BrokerAuthenticationError
        │   └── BrokerTlsError
        ├── BrokerAuthorizationError
        └── TopicNotFoundError

Kafka client errors are translated into this tree in one place, ``transports.kafka.client.error_map``;
an invalid client setting (``-X``, ``producer_config``) becomes a ``ConfigError`` there.

Errors carry the rollout id and the model call id where one applies, so a
log line names the exact turn that was lost.
"""

from __future__ import annotations

__all__ = [
    "BrokerAuthenticationError",
    "BrokerAuthorizationError",
    "BrokerTlsError",
    "BrokerUnreachableError",
    "CanonicalEncodingError",
    "ChainValidationError",
    "ConfigError",
    "ConflictingEntryError",
    "DeliveryError",
    "DeliveryTimeoutError",
    "EventDecodeError",
    "EventTooLargeError",
    "InjectedFaultError",
    "InvalidInputError",
    "InvalidRolloutIdError",
    "LineageLookupError",
    "MaskFractionExceededError",
    "MaterializerFailedError",
    "MaterializerOwnedElsewhereError",
    "NewerSchemaError",
    "OffsetGapError",
    "PartitionOwnerMissingError",
    "PartitionOwnershipConflictError",
    "PrefixContiguityError",
    "RebuildError",
    "ReceiptVerificationError",
    "RecordValidationError",
    "RolloutClosedError",
    "RolloutFrozenError",
    "RolloutRetiredError",
    "SinkConfigError",
    "StagingKeyNotFoundError",
    "StoreCorruptionError",
    "StoreFormatError",
    "StoreWriteError",
    "TokcapError",
    "TokenExtractionError",
    "TopicIncarnationError",
    "TopicLimitsMismatchError",
    "TopicMismatchError",
    "TopicNotFoundError",
    "TrajectoryBuildError",
    "TransportError",
    "UndeliverableBuilderError",
    "UnknownBuilderError",
    "WireDeltaError",
]


class TokcapError(Exception):
    """Root of every error tokcap raises on purpose."""

    def __init__(self, message: str, *, rollout_id: str | None = None, model_call_id: str | None = None):
        super().__init__(message)
        self.rollout_id = rollout_id
        self.model_call_id = model_call_id


class InvalidInputError(TokcapError, ValueError):
    """The caller passed something tokcap cannot accept."""


class InvalidRolloutIdError(InvalidInputError):
    """A rollout id could escape the store directory or name a bad file."""


class RecordValidationError(InvalidInputError):
    """A record does not satisfy the TokenEntry shape or its invariants."""


class NewerSchemaError(RecordValidationError):
    """A record or event was written by a newer tokcap than this reader."""


class TokenExtractionError(InvalidInputError):
    """A model response carries token metadata that is ambiguous or partial."""


class ConflictingEntryError(InvalidInputError):
    """A call id was written twice with different payloads; the rollout is now incomplete."""


class ReceiptVerificationError(TokcapError, ValueError):
    """A staging receipt or staged row failed a custody check; ``code`` names the check (Gym's codes)."""

    def __init__(self, code: str, detail: str, *, rollout_id: str | None = None) -> None:
        super().__init__(f"{code}: {detail}", rollout_id=rollout_id)
        self.code = code


class RebuildError(ReceiptVerificationError):
    """A verified manifest cannot form the chain its receipt names as terminal."""


class StagingKeyNotFoundError(TokcapError, LookupError):
    """A staging key names no staged call: never staged, staged and refused, or its rollout was retired."""


class EventDecodeError(InvalidInputError):
    """Bytes on the log are not a valid tokcap event."""


class WireDeltaError(EventDecodeError):
    """A put sent as (parent link, prompt suffix) cannot be restored to the exact entry the sink was given."""


class EventTooLargeError(InvalidInputError):
    """An event is larger than the transport's maximum event size; nothing of it was sent.

    Readers refuse to reassemble a larger one, so sending it would report ok for an event never applied.
    """


class UnknownBuilderError(InvalidInputError):
    """A trajectory builder name is not one tokcap provides."""


class ConfigError(TokcapError, ValueError):
    """The token capture configuration is invalid."""


class SinkConfigError(ConfigError):
    """The configured sink cannot be built; refused at startup rather than losing turns later."""


class CanonicalEncodingError(ConfigError):
    """The installed JSON encoder writes bytes other than tokcap's canonical form; this node may not write lines."""


class PartitionOwnershipConflictError(ConfigError):
    """Two materializer directories, or two workers, claim one partition; one partition has one owner."""


class RolloutClosedError(TokcapError, RuntimeError):
    """A write reached a rollout that no longer accepts writes."""


class RolloutFrozenError(RolloutClosedError):
    """A write reached a rollout after its freeze; it is not part of the snapshot."""


class RolloutRetiredError(RolloutClosedError):
    """A write reached a retired rollout; its fence refuses late writers."""


class StoreCorruptionError(TokcapError, RuntimeError):
    """Durable store files are damaged in a way recovery must not guess about."""


class StoreFormatError(TokcapError, RuntimeError):
    """A store file is in a directory format this version does not read; the message names the upgrade step."""


class StoreWriteError(TokcapError, OSError):
    """Writing or syncing a store file failed (a full disk, an I/O error): the message names the operation,
    the rollout and the file. Nothing of the operation was acknowledged; the files stay readable."""

    def __str__(self) -> str:
        """The whole message, not ``OSError``'s errno and file name alone."""
        return str(self.args[0]) if self.args else super().__str__()


class MaskFractionExceededError(TokcapError, RuntimeError):
    """Too many rollouts were masked; training on the rest would be biased."""


class TransportError(TokcapError, RuntimeError):
    """A transport could not deliver or read events."""


class DeliveryError(TransportError):
    """The broker refused or failed an event."""


class DeliveryTimeoutError(TransportError):
    """An event was not acknowledged, or not applied, within the configured time."""


class TopicMismatchError(TransportError):
    """An existing topic has settings other than the ones requested."""


class TopicLimitsMismatchError(ConfigError):
    """Size limits given to a sink or reader, or asked of an existing topic, differ from the topic's own.

    A topic's limits are decided once, when it is made; every writer and reader uses them.
    """


class UndeliverableBuilderError(InvalidInputError):
    """A builder that yields several chains per rollout was asked for single-response delivery."""


class TrajectoryBuildError(TokcapError, RuntimeError):
    """A frozen snapshot could not be turned into trajectories; the consumer masks the rollout."""


class ChainValidationError(TrajectoryBuildError):
    """A built chain breaks its own invariant: a link's prompt does not extend the previous link."""


class PrefixContiguityError(TrajectoryBuildError, AssertionError):
    """A projected response's token arrays do not concatenate to the chain's full sequence.

    It is also an ``AssertionError``, which is what Gym's ``assert_prefix_contiguity`` raises and its callers catch.
    """


class LineageLookupError(TokcapError, RuntimeError):
    """A proven parent's tokens could not be rebuilt or failed their digest; the request is left unresolved."""


class MaterializerFailedError(TransportError):
    """The materializer stopped on an error it must not skip (a damaged store, a truncated topic)."""


class MaterializerOwnedElsewhereError(MaterializerFailedError):
    """Another materializer already applies a partition into this directory; a source then follows it."""


class TopicIncarnationError(MaterializerFailedError):
    """A store directory was fed by another incarnation of its topic (deleted and created again under its name).

    Offsets of a new incarnation start again at 0: resuming at the old checkpoint would skip events.
    """


class OffsetGapError(MaterializerFailedError):
    """A partition's next fetched offset is not the one after the last read: events would be skipped."""


class PartitionOwnerMissingError(TransportError):
    """No materializer directory owns the partition a rollout hashes to; start one with that partition."""


class InjectedFaultError(TokcapError, RuntimeError):
    """A failure ``tokcap demo`` raises on purpose, to show that the capture path survives it."""


class BrokerUnreachableError(TransportError):
    """No Kafka broker answered at the configured bootstrap address in time."""


class TopicNotFoundError(TransportError):
    """The run topic does not exist on the broker; create it, or check the run id."""


class BrokerAuthenticationError(TransportError):
    """The broker refused the client's login; retrying with the same credentials cannot succeed."""


class BrokerTlsError(BrokerAuthenticationError):
    """The TLS handshake with the broker failed: an untrusted or mismatched certificate."""


class BrokerAuthorizationError(TransportError):
    """The broker's ACLs do not allow the client's principal the operation; grant the role's ACLs."""
