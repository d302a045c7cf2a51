"""For what tokcap implements, its public names and call signatures are Gym 0.7.0's."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from typing import Any

import pytest
from gym_wheel import GymModules

import tokcap

# Names of Gym's top-level __all__ that tokcap implements under the same name at its top level.
SHARED_TOP_LEVEL = [
    "Chain",
    "TokenIdCaptureConfig",
    "TokenEntry",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "ParentResolutionStatus",
    "extract_token_fields",
    "compute_digest",
    "cumulative_tokens",
    "stamp_lineage",
    "TokenCaptureStore",
    "validate_rollout_id",
    "make_token_store",
    "TokenSink",
    "TokenSource",
    "LineageResolver",
    "install_lineage_store",
    "installed_lineage_store",
    "TokenCaptureSnapshot",
    "install_token_sink",
    "install_token_source",
    "installed_token_sink",
    "installed_token_source",
    "CaptureContext",
    "set_token_sink",
    "register_call_intent",
    "reset_token_sink",
    "capture_tokens",
    "commit_entry",
    "current_capture_context",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "run_builder",
    "assert_prefix_contiguity",
    "trajectories_from_source",
    "trajectories_for_rollout",
    "clear_token_captures_for_rollouts",
    "token_id_capture_dirs_from_config",
]

# (tokcap module, Gym module, function): Gym's parameters must be accepted under the same names and order.
SIGNATURES = [
    ("tokcap.records", "records", "extract_token_fields"),
    ("tokcap.records", "records", "strip_token_fields"),
    ("tokcap.records", "records", "compute_digest"),
    ("tokcap.records", "records", "encode_token_ids"),
    ("tokcap.records", "records", "cumulative_tokens"),
    ("tokcap.records", "records", "stamp_lineage"),
    ("tokcap.builder", "builder", "run_builder"),
    ("tokcap.builder", "builder", "prefix_merging"),
    ("tokcap.response_items", "builder", "project_chain_to_output_items"),
    ("tokcap.response_items", "builder", "project_main_chain_response"),
    ("tokcap.response_items", "builder", "assert_prefix_contiguity"),
    ("tokcap.consumer", "consumer", "trajectories_from_source"),
    ("tokcap.consumer", "consumer", "trajectories_for_rollout"),
    ("tokcap.consumer", "consumer", "clear_token_captures_for_rollouts"),
    ("tokcap.consumer", "consumer", "token_id_capture_dirs_from_config"),
    ("tokcap.delivery", "delivery", "finalize_rollout_token_capture"),
    ("tokcap.delivery", "delivery", "retire_rollout_token_capture"),
    ("tokcap.delivery", "delivery", "capture_build_can_retire"),
    ("tokcap.delivery", "delivery", "rollout_carries_token_ids"),
    ("tokcap.config", "config", "token_id_capture_config"),
    ("tokcap.config", "config", "token_id_capture_enabled_for_agent"),
    ("tokcap.terminal", "terminal", "resolve_terminal"),
]

RECORD_KEYS = ["TOKEN_CAPTURE_KEY", "MASK_SAMPLE_KEY", "TERMINAL_CALL_KEY", "TERMINAL_RESPONSE_ID_KEY"]


def test_every_shared_name_is_exported_by_both(gym: GymModules) -> None:
    # The leaf package is a bare namespace module here (its __init__ imports Gym's server stack), so
    # Gym's __all__ is read from the source.
    source = (gym.source_dir / "nemo_gym" / "token_id_capture" / "__init__.py").read_text()
    gym_all = set(
        ast.literal_eval(source[source.index("__all__ = [") + len("__all__ = ") :].split("]")[0] + "]")
    )
    assert set(SHARED_TOP_LEVEL) <= gym_all
    assert set(SHARED_TOP_LEVEL) <= set(tokcap.__all__)


def _parameters(function: Any) -> list[tuple[str, bool]]:
    return [
        (name, parameter.kind is inspect.Parameter.KEYWORD_ONLY)
        for name, parameter in inspect.signature(function).parameters.items()
    ]


@pytest.mark.parametrize(("ours", "theirs", "name"), SIGNATURES, ids=[s[2] for s in SIGNATURES])
def test_a_shared_function_takes_gyms_parameters_under_gyms_names(
    gym: GymModules, ours: str, theirs: str, name: str
) -> None:
    gym_parameters = _parameters(getattr(getattr(gym, theirs), name))
    tokcap_parameters = dict(_parameters(getattr(importlib.import_module(ours), name)))
    positional = [p for p, keyword_only in gym_parameters if not keyword_only]
    ours_positional = [p for p, keyword_only in tokcap_parameters.items() if not keyword_only]
    assert ours_positional[: len(positional)] == positional
    assert {p for p, _ in gym_parameters} <= set(tokcap_parameters)


@pytest.mark.parametrize("key", RECORD_KEYS)
def test_the_record_keys_are_gyms(gym: GymModules, key: str) -> None:
    from tokcap import delivery

    assert getattr(delivery, key) == getattr(gym.delivery, key)


def test_chain_link_and_build_output_read_under_gyms_field_names(gym: GymModules) -> None:
    from tokcap.builder import BuildOutput, Chain, ChainLink

    for cls, gym_cls in (
        (Chain, gym.builder.Chain),
        (ChainLink, gym.builder.ChainLink),
        (BuildOutput, gym.builder.BuildOutput),
    ):
        gym_fields = set(gym_cls.__dataclass_fields__)
        assert {
            name for name in gym_fields if not hasattr(cls, name) and name not in cls.__dataclass_fields__
        } == set()


# Public names of a Gym module that tokcap's module of the same name does not offer, and why.
NOT_OFFERED = {
    "config": {"NonGeneratingRequest": "Gym's model-server setting for requests that never generate"},
    "lineage": {
        "RolloutLineage": "Gym's own matcher; tokcap's resolvers reproduce its fingerprints instead",
        "InMemoryLineageStore": "Gym's own stores; tokcap offers FileLineageResolver and KafkaLineageResolver",
        "IncrementalLineageStore": "Gym's own stores; tokcap offers FileLineageResolver and KafkaLineageResolver",
        "FileLineageStore": "Gym's own stores; tokcap offers FileLineageResolver and KafkaLineageResolver",
    },
    "records": {"response_to_output_items": "Gym's middleware normalizes served responses"},
    "sink": {
        "capture_health_snapshot": "Gym's middleware metrics",
        "mark_external_staging_committed": "Gym's middleware state for external staging",
    },
}


def _gym_module_names(gym: GymModules) -> dict[str, list[str]]:
    """Each Gym module that tokcap has a module of the same name for, and the public names it defines."""
    found: dict[str, list[str]] = {}
    for path in sorted((gym.source_dir / "nemo_gym" / "token_id_capture").glob("*.py")):
        if path.stem.startswith("_") or importlib.util.find_spec(f"tokcap.{path.stem}") is None:
            continue
        tree = ast.parse(path.read_text())
        found[path.stem] = [
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith("_")
        ]
    return found


def test_every_public_name_of_a_gym_module_is_importable_from_tokcaps_module_of_the_same_name(
    gym: GymModules,
) -> None:
    modules = _gym_module_names(gym)
    assert {"builder", "protocols", "records", "sink", "store", "lineage"} <= set(modules)
    missing = {
        f"tokcap.{module}.{name}"
        for module, names in modules.items()
        for name in names
        if name not in NOT_OFFERED.get(module, {})
        and not hasattr(importlib.import_module(f"tokcap.{module}"), name)
    }
    assert missing == set()
    stale = {
        f"{module}.{name}"
        for module, names in NOT_OFFERED.items()
        for name in names
        if name not in modules.get(module, [])
    }
    assert stale == set(), "a name listed as not offered is no longer in Gym's module"
