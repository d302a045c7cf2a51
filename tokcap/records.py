"""Gym's import path of the training-token record (``from tokcap.records import TokenEntry``).

The record is ``tokcap.log.records``; this module only hands its public names on, so code written
against Gym's ``token_id_capture.records`` keeps working.
"""

from tokcap.log.records import (
    DIGEST_VERSION,
    REQUIRED_TOKEN_FIELDS,
    TOKEN_ENTRY_MIN_SCHEMA_VERSION,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    ExtractedTokenFields,
    ParentResolutionStatus,
    TokenEntry,
    as_token_entry,
    compute_digest,
    cumulative_tokens,
    digest_of_packed,
    encode_token_ids,
    entry_digest,
    extract_token_fields,
    find_token_fields,
    pack_token_ids,
    response_items,
    stamp_lineage,
    strip_token_arrays,
    strip_token_fields,
    token_count,
)

__all__ = [
    "DIGEST_VERSION",
    "REQUIRED_TOKEN_FIELDS",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "ExtractedTokenFields",
    "ParentResolutionStatus",
    "TokenEntry",
    "as_token_entry",
    "compute_digest",
    "cumulative_tokens",
    "digest_of_packed",
    "encode_token_ids",
    "entry_digest",
    "extract_token_fields",
    "find_token_fields",
    "pack_token_ids",
    "response_items",
    "stamp_lineage",
    "strip_token_arrays",
    "strip_token_fields",
    "token_count",
]
