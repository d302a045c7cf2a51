"""The wheel pip builds from the project ships ``py.typed`` for both packages and every module of them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tokcap
import transports

_PACKAGE_DIRS = [Path(tokcap.__file__).resolve().parent, Path(transports.__file__).resolve().parent]
_PROJECT_DIR = _PACKAGE_DIRS[0].parent


def test_the_built_wheel_ships_py_typed_for_both_packages(tmp_path: Path) -> None:
    """Built from a copy, so the check leaves no build/ or egg-info in the working tree."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(_PROJECT_DIR / name, source / name)
    for package in _PACKAGE_DIRS:
        shutil.copytree(package, source / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    command += ["--disable-pip-version-check", "--wheel-dir", str(wheels), str(source)]
    subprocess.run(command, check=True, capture_output=True)
    (wheel,) = wheels.glob("tokcap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"tokcap/py.typed", "transports/py.typed"} <= names
    assert "transports/kafka/source.py" in names
    assert {"transports/kafka/wire/codec.py", "transports/kafka/materializer/__main__.py"} <= names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    declared = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[tokcap.transports]\nkafka = transports.kafka.cli:mount" in declared
