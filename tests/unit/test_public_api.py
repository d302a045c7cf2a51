"""Every tokcap module declares its public surface completely in ``__all__``.

A public name is one a module binds at top level (def, class or assignment) without a leading underscore.
Type variables are exempt: they are typing plumbing, not API a caller imports.
Names a module imports from elsewhere are not its own; listing them in ``__all__`` is a re-export and allowed.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import tokcap

_PACKAGE_DIR = Path(tokcap.__file__).resolve().parent


def _module_name(path: Path) -> str:
    relative = path.relative_to(_PACKAGE_DIR.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_MODULE_PATHS = sorted(_PACKAGE_DIR.rglob("*.py"))
_MODULES = {_module_name(path): path for path in _MODULE_PATHS}


_TYPE_VARIABLE_FACTORIES = frozenset({"TypeVar", "ParamSpec", "TypeVarTuple"})


def _is_type_variable(value: ast.expr) -> bool:
    """Type variables are typing plumbing, not API a caller imports."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name in _TYPE_VARIABLE_FACTORIES


def defined_public_names(source: str) -> set[str]:
    """Names bound at a module's top level by def, class or assignment, without a leading underscore."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and not _is_type_variable(node.value):
            for target in node.targets:
                names.update(element.id for element in ast.walk(target) if isinstance(element, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def test_the_scan_sees_the_core_modules() -> None:
    assert {"tokcap", "tokcap.config", "tokcap.records", "tokcap.protocols", "tokcap.store"} <= set(_MODULES)


def test_the_public_name_scan_finds_defs_classes_and_assignments_but_not_imports_or_private_names() -> None:
    source = (
        "import os\nfrom json import loads\nCONSTANT = 1\n_PRIVATE = 2\nlogger: object = None\n"
        "def function(): ...\nasync def coroutine(): ...\nclass Thing: ...\ndef _helper(): ...\n"
        "T = TypeVar('T')\nP = typing.ParamSpec('P')\n"
    )
    assert defined_public_names(source) == {"CONSTANT", "logger", "function", "coroutine", "Thing"}


@pytest.mark.parametrize("module_name", sorted(_MODULES))
def test_every_module_declares_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert isinstance(getattr(module, "__all__", None), list | tuple), f"{module_name} has no __all__"


@pytest.mark.parametrize("module_name", sorted(_MODULES))
def test_every_public_name_a_module_defines_is_in_its_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    declared = set(getattr(module, "__all__", ()))
    missing = defined_public_names(_MODULES[module_name].read_text()) - declared
    assert not missing, f"{module_name} defines public names missing from __all__: {sorted(missing)}"


@pytest.mark.parametrize("module_name", sorted(_MODULES))
def test_every_name_in_a_modules_all_exists(module_name: str) -> None:
    module = importlib.import_module(module_name)
    absent = [name for name in getattr(module, "__all__", ()) if not hasattr(module, name)]
    assert not absent, f"{module_name}.__all__ lists names it does not have: {absent}"


@pytest.mark.parametrize("module_name", sorted(_MODULES))
def test_no_module_lists_a_name_twice_in_its_all(module_name: str) -> None:
    names = list(getattr(importlib.import_module(module_name), "__all__", ()))
    assert len(names) == len(set(names)), f"{module_name}.__all__ has duplicates"


def test_every_name_the_package_exports_resolves_by_from_import() -> None:
    namespace: dict[str, object] = {}
    exec("from tokcap import *", namespace)
    assert set(tokcap.__all__) <= set(namespace)
    for name in tokcap.__all__:
        assert namespace[name] is getattr(tokcap, name)


def test_the_package_exports_the_config_surface() -> None:
    assert {
        "TokenIdCaptureConfig",
        "TokenIdCaptureSettings",
        "token_id_capture_config",
        "token_id_capture_enabled_for_agent",
    } <= set(tokcap.__all__)
    assert tokcap.token_id_capture_config is importlib.import_module("tokcap.config").token_id_capture_config
