"""Every error only the Kafka transport raises, under tokcap's root.

Each class subclasses a class of ``tokcap.errors`` (``TransportError``, ``ConfigError``, ``EventDecodeError``),
so a caller that catches tokcap's root, or the builtin beneath it, keeps working.

Error tree (the parent of each branch is in ``tokcap.errors``)::

    TransportError (RuntimeError)
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
    ConfigError (ValueError)
    ├── PartitionOwnershipConflictError
    └── TopicLimitsMismatchError
    EventDecodeError (ValueError)
    └── WireDeltaError

Kafka client errors are translated into this tree, and ``tokcap.errors``'s, in one place,
``transports.kafka.client.error_map``.
"""

from __future__ import annotations

from tokcap.errors import ConfigError, EventDecodeError, TransportError

__all__ = [
    "BrokerAuthenticationError",
    "BrokerAuthorizationError",
    "BrokerTlsError",
    "BrokerUnreachableError",
    "MaterializerFailedError",
    "MaterializerOwnedElsewhereError",
    "OffsetGapError",
    "PartitionOwnerMissingError",
    "PartitionOwnershipConflictError",
    "TopicIncarnationError",
    "TopicLimitsMismatchError",
    "TopicMismatchError",
    "TopicNotFoundError",
    "WireDeltaError",
]


class WireDeltaError(EventDecodeError):
    """A put sent as (parent link, prompt suffix) cannot be restored to the exact entry the sink was given."""


class PartitionOwnershipConflictError(ConfigError):
    """Two materializer directories, or two workers, claim one partition; one partition has one owner."""


class TopicMismatchError(TransportError):
    """An existing topic has settings other than the ones requested."""


class TopicLimitsMismatchError(ConfigError):
    """Size limits given to a sink or reader, or asked of an existing topic, differ from the topic's own.

    A topic's limits are decided once, when it is made; every writer and reader uses them.
    """


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
