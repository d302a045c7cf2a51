"""tokcap: durable capture of the training tokens of RL rollouts.

Model servers record one ``TokenEntry`` per model call through a ``TokenSink``.
Trainers freeze a finished rollout through a ``TokenSource``, build one trajectory,
mask any rollout that lost a call, and retire the exact snapshot after a durable hand-off.
``TokenCaptureStore`` is the local file store, both sink and source.
Transports (``transports.kafka``) provide sinks and sources across nodes.
This package imports no Kafka, FastAPI, Ray, Torch or aiohttp module.
The rollout-record finalizer lives in ``tokcap.delivery`` and is not re-exported here.
"""

from tokcap.builder import BuildOutput, Chain, ChainLink, prefix_merging, run_builder
from tokcap.config import (
    TokenIdCaptureConfig,
    TokenIdCaptureSettings,
    token_id_capture_config,
    token_id_capture_enabled_for_agent,
)
from tokcap.consumer import (
    clear_token_captures_for_rollouts,
    token_id_capture_dirs_from_config,
    trajectories_for_rollout,
    trajectories_from_source,
)
from tokcap.files.store import TokenCaptureStore, make_token_store
from tokcap.log.records import (
    TOKEN_ENTRY_MIN_SCHEMA_VERSION,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    cumulative_tokens,
    extract_token_fields,
    stamp_lineage,
)
from tokcap.log.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.protocols import (
    IntentTokenSink,
    LineageResolver,
    RetiringTokenSource,
    RolloutRemovalPayload,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_lineage_store,
    install_token_sink,
    install_token_source,
    installed_lineage_store,
    installed_token_sink,
    installed_token_source,
)
from tokcap.response_items import (
    assert_prefix_contiguity,
    project_chain_to_output_items,
    project_main_chain_response,
)
from tokcap.sink import (
    CaptureContext,
    capture_tokens,
    commit_entry,
    current_capture_context,
    register_call_intent,
    reset_token_sink,
    set_token_sink,
)

__all__ = [
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "BuildOutput",
    "CaptureContext",
    "Chain",
    "ChainLink",
    "IntentTokenSink",
    "LineageResolver",
    "ParentResolutionStatus",
    "RetiringTokenSource",
    "RolloutRemovalPayload",
    "TokenCaptureSnapshot",
    "TokenCaptureStore",
    "TokenEntry",
    "TokenIdCaptureConfig",
    "TokenIdCaptureSettings",
    "TokenSink",
    "TokenSource",
    "assert_prefix_contiguity",
    "capture_tokens",
    "clear_token_captures_for_rollouts",
    "commit_entry",
    "compute_digest",
    "cumulative_tokens",
    "current_capture_context",
    "extract_token_fields",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
    "make_token_store",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "register_call_intent",
    "reset_token_sink",
    "run_builder",
    "set_token_sink",
    "stamp_lineage",
    "token_id_capture_config",
    "token_id_capture_dirs_from_config",
    "token_id_capture_enabled_for_agent",
    "trajectories_for_rollout",
    "trajectories_from_source",
    "validate_rollout_id",
    "validate_rollout_ids",
]
