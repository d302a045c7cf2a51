"""Where Gym's capture package is: under Gym main's path, else under Gym 0.7.0's.

Gym's main branch moves the package from ``nemo_gym.token_id_capture`` to ``nemo_gym.models.token_capture``
(the config block and its keys stay the same). Every tokcap module that uses a Gym class asks here, so a Gym
of either layout is found; when both paths import, the newer one is taken.

A path that does not import is not tried again until ``sys.path`` changes, because a staging source asks
on every fetch. A module already in ``sys.modules`` is always seen, so a process that imports Gym (or aliases
it) after tokcap started is served from then on; it is taken through ``importlib.import_module``, which waits
while another thread is still executing it (serving threads ask concurrently).
"""

from __future__ import annotations

import importlib
import sys
import threading
import types

__all__ = ["GYM_PACKAGES", "gym_module", "gym_package"]

GYM_PACKAGES = ("nemo_gym.models.token_capture", "nemo_gym.token_id_capture")
"""Gym's capture package paths, newest first."""

_lock = threading.Lock()
_missing: dict[str, tuple[str, ...]] = {}
"""Module paths that did not import, with the ``sys.path`` they were searched on."""


def gym_module(name: str) -> types.ModuleType | None:
    """Gym's module ``name`` inside its capture package (``"staging.records"``, say), or ``None`` without Gym.

    ``name`` is relative to the package; ``""`` is the package itself.
    """
    for package in GYM_PACKAGES:
        found = _imported(f"{package}.{name}" if name else package)
        if found is not None:
            return found
    return None


def gym_package() -> str | None:
    """The path Gym's capture package is imported from here, or ``None`` when Gym is not importable."""
    for package in GYM_PACKAGES:
        if _imported(package) is not None:
            return package
    return None


def _imported(path: str) -> types.ModuleType | None:
    searched = tuple(sys.path)
    if sys.modules.get(path) is None and _missing.get(path) == searched:
        return None
    # A module in sys.modules may still be executing in another thread: import_module waits until it is whole.
    try:
        return importlib.import_module(path)
    except ImportError:
        with _lock:
            _missing[path] = searched
        return None
