"""NeMo Gym 0.7.0's token-capture package, fetched from PyPI at test time and loaded without Gym's servers.

Nothing of Gym is in this repository. The public wheel is downloaded once into a cache
(``~/.cache/tokcap/gym``, or ``$TOKCAP_GYM_CACHE``), and only ``nemo_gym/token_id_capture`` and
``nemo_gym/rollout_correlation.py`` are unpacked from it. The two server modules that
``rollout_correlation`` imports for five constants are replaced by stubs carrying those constants,
and the parent packages are registered as bare namespace modules, so nothing beyond pydantic and
orjson is imported.

The fixture ``gym`` gives the loaded modules. ``needs_gym_build_sink`` marks tests that call Gym's
``build_sink`` (it uses ``Protocol.__protocol_attrs__``, Python 3.12+): they run on 3.13 and are
skipped on 3.11 with that reason.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

GYM_VERSION = "0.7.0"
_WHEEL = f"nemo_gym-{GYM_VERSION}-py3-none-any.whl"
_KEPT = ("nemo_gym/token_id_capture/", "nemo_gym/rollout_correlation.py")
# The constants rollout_correlation imports from two server modules (values from Gym 0.7.0).
_STUBS: dict[str, dict[str, str]] = {
    "nemo_gym.config_types": {"ROLLOUT_PATH_PREFIX": "ng-rollout"},
    "nemo_gym.global_config": {
        "TASK_INDEX_KEY_NAME": "_ng_task_index",
        "ROLLOUT_INDEX_KEY_NAME": "_ng_rollout_index",
        "ATTEMPT_INDEX_KEY_NAME": "_ng_attempt_index",
        "ROLLOUT_ID_KEY_NAME": "_ng_rollout_id",
    },
}

needs_gym_build_sink = pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="Gym 0.7.0's build_sink uses Protocol.__protocol_attrs__ (Python 3.12+); "
    "scripts/test runs these on Python 3.13 (.venv313)",
)


def cache_dir() -> Path:
    return Path(os.environ.get("TOKCAP_GYM_CACHE") or Path.home() / ".cache" / "tokcap" / "gym")


def _download_wheel(target: Path) -> Path:
    """Fetch the wheel with pip (it declares Requires-Python >= 3.13.14, hence the explicit version)."""
    wheel = target / _WHEEL
    if wheel.exists():
        return wheel
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.13.14",
            f"nemo-gym=={GYM_VERSION}",
            "-d",
            scratch,
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        fetched = Path(scratch) / _WHEEL
        if result.returncode != 0 or not fetched.exists():
            raise RuntimeError(
                f"could not download nemo-gym {GYM_VERSION} from PyPI (pip exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}; the Gym tests need network access to PyPI once, "
                f"or the wheel placed at {wheel}"
            )
        os.replace(fetched, wheel)
    return wheel


def unpacked_source() -> Path:
    """The directory holding ``nemo_gym/token_id_capture`` (downloaded and unpacked on first use)."""
    root = cache_dir()
    source = root / f"src-{GYM_VERSION}"
    if (source / "nemo_gym" / "token_id_capture" / "records.py").exists():
        return source
    wheel = _download_wheel(root)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="unpack-"))
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith(_KEPT):
                    archive.extract(name, staging)
        try:
            os.replace(staging, source)
        except OSError:
            # Another test run unpacked it first; use theirs if it is complete.
            if not (source / "nemo_gym" / "token_id_capture" / "records.py").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return source


@dataclass(frozen=True)
class GymModules:
    """The Gym modules the tests drive tokcap with."""

    records: types.ModuleType
    store: types.ModuleType
    protocols: types.ModuleType
    lineage: types.ModuleType
    sink: types.ModuleType
    builder: types.ModuleType
    consumer: types.ModuleType
    delivery: types.ModuleType
    config: types.ModuleType
    conformance: types.ModuleType
    terminal: types.ModuleType
    source_dir: Path


def load_gym() -> GymModules:
    """Import Gym's leaf package from the cache, registering namespace parents and the two stubs."""
    source = unpacked_source()
    package_dir = source / "nemo_gym"
    for name, path in (
        ("nemo_gym", package_dir),
        ("nemo_gym.token_id_capture", package_dir / "token_id_capture"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
    for name, constants in _STUBS.items():
        if name not in sys.modules:
            stub = types.ModuleType(name)
            for key, value in constants.items():
                setattr(stub, key, value)
            sys.modules[name] = stub
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))

    def leaf(name: str) -> types.ModuleType:
        return importlib.import_module(f"nemo_gym.token_id_capture.{name}")

    return GymModules(
        records=leaf("records"),
        store=leaf("store"),
        protocols=leaf("protocols"),
        lineage=leaf("lineage"),
        sink=leaf("sink"),
        builder=leaf("builder"),
        consumer=leaf("consumer"),
        delivery=leaf("delivery"),
        config=leaf("config"),
        conformance=leaf("conformance"),
        terminal=leaf("terminal"),
        source_dir=source,
    )


@pytest.fixture(scope="session")
def gym() -> GymModules:
    """Gym 0.7.0's token-capture modules, loaded once per session."""
    return load_gym()
