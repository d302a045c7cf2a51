"""Every import path a Gym user or a Gym config names resolves to the library's own object.

Gym's config blocks name classes as ``module:Name`` and Gym's users import its modules by name; tokcap keeps
those names where they stand in Gym's layout, whichever folder defines them. ``tokcap.store`` and
``tokcap.records`` only hand on the public names of ``tokcap.files.store`` and ``tokcap.log.records``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

_CONFIG_PATHS = [
    ("tokcap.store:TokenCaptureStore", "tokcap.files.store"),
    ("tokcap.store:make_token_store", "tokcap.files.store"),
    ("tokcap.lineage:FileLineageResolver", "tokcap.lineage"),
    ("tokcap.staging:FileStagingSink", "tokcap.staging.file_sink"),
    ("tokcap.staging:FileStagingSource", "tokcap.staging.file_source"),
    ("tokcap.records:TokenEntry", "tokcap.log.records"),
    ("tokcap.records:stamp_lineage", "tokcap.log.records"),
    ("tokcap.records:compute_digest", "tokcap.log.records"),
    ("tokcap.sink:register_call_intent", "tokcap.sink"),
    ("tokcap.protocols:TokenSink", "tokcap.protocols"),
    ("tokcap.delivery:finalize_rollout_token_capture", "tokcap.delivery"),
    ("tokcap.consumer:trajectories_from_source", "tokcap.consumer"),
    ("tokcap.builder:run_builder", "tokcap.builder"),
    ("tokcap.terminal:resolve_terminal", "tokcap.terminal"),
    ("tokcap.fingerprint:assistant_fingerprint", "tokcap.fingerprint"),
    ("tokcap.errors:TokcapError", "tokcap.errors"),
    ("tokcap.config:token_id_capture_config", "tokcap.config"),
    ("tokcap.gym_package:gym_module", "tokcap.gym_package"),
    ("tokcap.metrics:REGISTRY", "tokcap.metrics"),
]

_RE_EXPORTS = [("tokcap.store", "tokcap.files.store"), ("tokcap.records", "tokcap.log.records")]


def _resolve(path: str) -> object:
    module_name, name = path.split(":")
    return getattr(importlib.import_module(module_name), name)


@pytest.mark.parametrize(("path", "home"), _CONFIG_PATHS)
def test_a_gym_import_path_names_the_object_its_defining_module_holds(path: str, home: str) -> None:
    assert _resolve(path) is getattr(importlib.import_module(home), path.split(":")[1])


@pytest.mark.parametrize(("gym_path", "home"), _RE_EXPORTS)
def test_a_re_export_hands_on_every_public_name_of_its_module_and_defines_nothing(
    gym_path: str, home: str
) -> None:
    shim: ModuleType = importlib.import_module(gym_path)
    real: ModuleType = importlib.import_module(home)
    assert list(shim.__all__) == list(real.__all__), f"{gym_path}.__all__ must list {home}.__all__"
    assert all(getattr(shim, name) is getattr(real, name) for name in real.__all__)
    own = {name for name, value in vars(shim).items() if getattr(value, "__module__", None) == gym_path}
    assert own == set()
