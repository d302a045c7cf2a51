"""Which classes a staging source builds: Gym's own when ``nemo_gym`` imports, tokcap's otherwise.

Gym's ``verify_and_linearize`` refuses anything that is not its own ``StagedCallBaseSnapshot``, so a
source must hand a Gym trainer Gym's classes; a trainer without Gym gets tokcap's equivalents
(``tokcap.staging.records``), which carry the same fields and validation.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from tokcap.staging import records as tokcap_records

__all__ = ["build", "staging_records_module"]

_GYM_RECORDS = "nemo_gym.token_id_capture.staging.records"


def staging_records_module() -> types.ModuleType:
    """Gym's staging records module when it can be imported, else tokcap's.

    Asked on every fetch, not once: a process may import Gym after building its source.
    """
    found = sys.modules.get(_GYM_RECORDS)
    if found is not None:
        return found
    try:
        if "nemo_gym" not in sys.modules and not _gym_findable():
            return tokcap_records
        return importlib.import_module(_GYM_RECORDS)
    except ImportError:
        return tokcap_records


_searched: list[tuple[tuple[str, ...], bool]] = []
"""The last import path searched for ``nemo_gym`` and whether it was found there."""


def _gym_findable() -> bool:
    """Whether ``nemo_gym`` can be imported; searched again only when the import path changed."""
    path = tuple(sys.path)
    if _searched and _searched[0][0] == path:
        return _searched[0][1]
    found = importlib.util.find_spec("nemo_gym") is not None
    _searched[:] = [(path, found)]
    return found


def build(class_name: str, data: dict[str, Any]) -> Any:
    """Validate ``data`` into the named staging class of whichever module ``staging_records_module`` picks."""
    cls = getattr(staging_records_module(), class_name)
    return cls.model_validate(data)
