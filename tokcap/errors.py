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
    │   ├── EventTooLargeError
    │   ├── UnknownBuilderError
    │   └── UndeliverableBuilderError
    ├── ConfigError (ValueError)
    │   ├── SinkConfigError
    │   └── CanonicalEncodingError
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
        └── DeliveryTimeoutError

A transport's own errors live in the transport, under these classes: the Kafka transport's (broker, topic,
materializer and wire-delta errors) in ``transports.kafka.errors``. Kafka client errors are translated into
both trees in one place, ``transports.kafka.client.error_map``; an invalid client setting (``-X``,
``producer_config``) becomes a ``ConfigError`` there.

Errors carry the rollout id and the model call id where one applies, so a
log line names the exact turn that was lost.
"""

from __future__ import annotations

__all__ = [
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
    "NewerSchemaError",
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
    "TrajectoryBuildError",
    "TransportError",
    "UndeliverableBuilderError",
    "UnknownBuilderError",
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


class InjectedFaultError(TokcapError, RuntimeError):
    """A failure ``tokcap demo`` raises on purpose, to show that the capture path survives it."""
