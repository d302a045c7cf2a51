"""The core's folders are its floors: the pure log, the files shell above it, the faces and the command on top.

``tokcap/log/`` decides and reads nothing; ``tokcap/files/`` carries out what it decides. A module imports only
its own floor and those below it, counting imports under ``TYPE_CHECKING`` and inside functions. The few
imports that run back up happen when a function is called and are listed here with their reason; the list may
only shrink, and an entry whose import became a top-level one fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import tokcap

_TOKCAP = Path(tokcap.__file__).resolve().parent

_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "tokcap.log": ("tokcap.log", "tokcap.errors"),
    "tokcap.files": ("tokcap.log", "tokcap.files", "tokcap.errors", "tokcap.metrics", "tokcap.protocols"),
}
"""What each lower floor may import: itself, the floors below, and the faces it implements or reports to."""

CALL_TIME_UPWARD: dict[tuple[str, str], str] = {
    ("tokcap.log.input_rules", "tokcap.staging.row_rules"): (
        "the columns of a staged call's rows are staging's rules; staging's sinks import the input rules"
    ),
    ("tokcap.files.store", "tokcap.config"): "make_token_store reads Gym's config block when it is called",
}
"""Imports from a lower floor to a higher one, each inside a function."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(_TOKCAP.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = _TOKCAP.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(source: str) -> Iterator[tuple[str, bool]]:
    """(module imported, whether inside a function) for every absolute import of ``tokcap`` in ``source``.

    ``from package import name`` imports ``package.name`` when that is a module, else ``package``.
    """

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                yield from ((alias.name, inside) for alias in child.names if alias.name.startswith("tokcap"))
            elif (
                isinstance(child, ast.ImportFrom)
                and child.level == 0
                and _within(child.module or "", ("tokcap",))
            ):
                for alias in child.names:
                    name = f"{child.module}.{alias.name}"
                    yield (name if _is_module(name) else child.module or ""), inside
            yield from walk(child, inside)

    yield from walk(ast.parse(source), False)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(f"{prefix}.") for prefix in prefixes)


def floor_breaches(module: str, source: str) -> list[str]:
    """The imports of ``module`` that leave what its floor may import, other than the listed call-time ones."""
    floor = next((name for name in _MAY_IMPORT if _within(module, (name,))), None)
    if floor is None:
        return []
    return [
        f"{module} -> {imported}{' (in a function)' if inside else ''}"
        for imported, inside in imports_of(source)
        if not _within(imported, _MAY_IMPORT[floor])
        and not (inside and (module, imported) in CALL_TIME_UPWARD)
    ]


def _core_sources() -> dict[str, str]:
    return {_module_name(path): path.read_text() for path in sorted(_TOKCAP.rglob("*.py"))}


def test_the_pure_log_and_the_files_shell_import_only_their_floor_and_those_below() -> None:
    sources = _core_sources()
    assert {"tokcap.log.rules", "tokcap.files.rollout_files", "tokcap.files.store"} <= set(sources)
    assert [breach for module, source in sources.items() for breach in floor_breaches(module, source)] == []


def test_each_listed_upward_import_still_exists_so_the_list_only_shrinks() -> None:
    sources = _core_sources()
    found = {(module, imported) for module, source in sources.items() for imported, _ in imports_of(source)}
    assert set(CALL_TIME_UPWARD) <= found


def test_no_library_module_imports_the_command_line() -> None:
    sources = _core_sources()
    assert [
        f"{module} -> {imported}"
        for module, source in sources.items()
        if not _within(module, ("tokcap.cli",))
        for imported, _ in imports_of(source)
        if _within(imported, ("tokcap.cli",))
    ] == []


def test_the_floor_check_refuses_an_upward_import_at_top_level_and_one_not_listed_in_a_function() -> None:
    source = (
        "from tokcap.errors import TokcapError\n"
        "from tokcap.log import events\n"
        "from tokcap.files.store import TokenCaptureStore\n"
        "from tokcap import metrics\n"
        "def later():\n"
        "    from tokcap.staging import row_rules\n"
        "    from tokcap.config import token_id_capture_config\n"
    )
    assert floor_breaches("tokcap.log.input_rules", source) == [
        "tokcap.log.input_rules -> tokcap.files.store",
        "tokcap.log.input_rules -> tokcap.metrics",
        "tokcap.log.input_rules -> tokcap.config (in a function)",
    ]
    assert floor_breaches("tokcap.files.store", "from tokcap.config import x\n") == [
        "tokcap.files.store -> tokcap.config"
    ]
    assert floor_breaches("tokcap.sink", "from tokcap.cli import app\n") == []
