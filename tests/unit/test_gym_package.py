"""tokcap finds Gym's capture package under Gym main's path first, then under Gym 0.7.0's, and tokcap's own
records without Gym."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokcap import gym_package as finder
from tokcap.gym_package import GYM_PACKAGES, gym_module, gym_package
from tokcap.staging import records as tokcap_records
from tokcap.staging.gym_types import staging_records_module

MAIN, RELEASED = GYM_PACKAGES


def _fake_records(monkeypatch: pytest.MonkeyPatch, package: str) -> types.ModuleType:
    """A distinct stand-in for Gym's staging records module under ``package``."""
    module = types.ModuleType(f"{package}.staging.records")
    module.StagedCallBaseSnapshot = type("StagedCallBaseSnapshot", (), {"package": package})  # type: ignore[attr-defined]
    for name in (package, f"{package}.staging"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _gym_names() -> set[str]:
    return {name for name in sys.modules if name == "nemo_gym" or name.startswith("nemo_gym.")}


@pytest.fixture
def no_gym(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Neither Gym package path imports here, whatever this session loaded; the session's Gym comes back after."""
    loaded = {name: sys.modules[name] for name in _gym_names()}
    for name in loaded:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nemo_gym", None)
    monkeypatch.setattr(finder, "_missing", {})
    yield
    for name in _gym_names() - set(loaded):
        del sys.modules[name]


def test_gym_mains_package_path_comes_first_and_0_7_0s_second() -> None:
    assert GYM_PACKAGES == ("nemo_gym.models.token_capture", "nemo_gym.token_id_capture")


def test_when_both_package_paths_import_the_newer_one_is_taken(
    no_gym: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    released = _fake_records(monkeypatch, RELEASED)
    main = _fake_records(monkeypatch, MAIN)
    assert released is not main
    assert gym_module("staging.records") is main
    assert gym_package() == MAIN
    assert staging_records_module() is main


def test_gym_0_7_0s_path_is_taken_when_mains_does_not_import(
    no_gym: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    released = _fake_records(monkeypatch, RELEASED)
    assert gym_module("staging.records") is released
    assert gym_package() == RELEASED
    assert staging_records_module() is released


def test_without_gym_tokcaps_own_records_are_used(no_gym: None) -> None:
    assert gym_module("staging.records") is None
    assert gym_package() is None
    assert staging_records_module() is tokcap_records


def test_gym_imported_after_a_miss_is_found_at_once(no_gym: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gym_module("staging.records") is None
    main = _fake_records(monkeypatch, MAIN)
    assert gym_module("staging.records") is main


def test_a_missing_path_is_searched_again_once_sys_path_changes(
    no_gym: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delitem(sys.modules, "nemo_gym")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if not (Path(entry) / "nemo_gym").exists()])
    assert gym_module("staging.records") is None
    package = tmp_path / "nemo_gym" / "models" / "token_capture" / "staging"
    package.mkdir(parents=True)
    (package / "records.py").write_text("FOUND_HERE = True\n")
    assert gym_module("staging.records") is None  # same sys.path: not searched again
    monkeypatch.syspath_prepend(str(tmp_path))
    found = gym_module("staging.records")
    assert found is not None and found.__name__ == f"{MAIN}.staging.records" and found.FOUND_HERE


def test_a_module_another_thread_is_still_importing_is_given_out_only_once_it_is_whole(
    no_gym: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Serving threads ask on every fetch; one asking while another imports Gym must not get a half-made module."""
    hook = types.ModuleType("_tokcap_test_gym_import_hook")
    hook.started = threading.Event()  # type: ignore[attr-defined]
    hook.release = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, hook.__name__, hook)
    monkeypatch.delitem(sys.modules, "nemo_gym")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if not (Path(entry) / "nemo_gym").exists()])
    package = tmp_path / "nemo_gym" / "models" / "token_capture" / "staging"
    package.mkdir(parents=True)
    (package / "records.py").write_text(
        "import sys\n"
        "hook = sys.modules['_tokcap_test_gym_import_hook']\n"
        "hook.started.set()\n"
        "hook.release.wait(30)\n"
        "WHOLE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    whole_when_given: dict[str, bool] = {}

    def ask(who: str) -> None:
        whole_when_given[who] = hasattr(gym_module("staging.records"), "WHOLE")

    importing = threading.Thread(target=ask, args=("importing",))
    importing.start()
    assert hook.started.wait(30)
    asking = threading.Thread(target=ask, args=("asking",))
    asking.start()
    asking.join(0.5)  # it waits for the import, or (wrongly) returns the module half made
    hook.release.set()
    importing.join(30)
    asking.join(30)
    assert whole_when_given == {"importing": True, "asking": True}
