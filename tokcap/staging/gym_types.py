"""Which classes a staging source builds: Gym's own when ``nemo_gym`` imports, tokcap's otherwise.

Gym's ``verify_and_linearize`` refuses anything that is not its own ``StagedCallBaseSnapshot``, so a
source must hand a Gym trainer Gym's classes; a trainer without Gym gets tokcap's equivalents
(``tokcap.staging.records``), which carry the same fields and validation.
"""

from __future__ import annotations

import types
from typing import Any

from tokcap.gym_package import gym_module
from tokcap.staging import records as tokcap_records

__all__ = ["build", "staging_records_module"]


def staging_records_module() -> types.ModuleType:
    """Gym's staging records module when it can be imported (either package path), else tokcap's.

    Asked on every fetch, not once: a process may import Gym after building its source.
    """
    return gym_module("staging.records") or tokcap_records


def build(class_name: str, data: dict[str, Any]) -> Any:
    """Validate ``data`` into the named staging class of whichever module ``staging_records_module`` picks."""
    cls = getattr(staging_records_module(), class_name)
    return cls.model_validate(data)
