"""Dependencies point from the transports and the command line to the core, never back, and never in a circle.

The core (``tokcap/``) never imports ``transports``: a transport adds its commands through the
``tokcap.transports`` entry point, which the CLI discovers in the installed metadata. The library needs
neither Typer nor Rich (the ``cli`` extra) nor filelock (the ``kafka`` extra); and no module of either
package imports itself back through others, counting imports under ``TYPE_CHECKING`` and inside functions,
because a type-only or lazy cycle is still two modules that cannot be understood one before the other.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path

import tokcap

_ROOT = Path(tokcap.__file__).resolve().parent.parent
_PACKAGES = ("tokcap", "transports")

_TRANSPORT_IMPORT = re.compile(
    r"^\s*(from|import)\s+transports\b|import_module\(\s*[\"']transports\b", re.MULTILINE
)
"""An import of ``transports`` as a statement or through ``importlib``, as text, wherever it stands."""

KNOWN_CYCLES: list[frozenset[str]] = []
"""Cycles in modules being rewritten elsewhere; the list may only shrink (a fixed cycle fails until removed)."""


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted module name to (file, is a package) for every module of both packages."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(_ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module of ``known`` that ``source`` imports anywhere: top level, ``TYPE_CHECKING``, functions.

    ``from package import name`` counts as importing ``package.name`` when that is a module, else ``package``.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                if f"{origin}.{alias.name}" in known:
                    found.add(f"{origin}.{alias.name}")
                elif origin in known:
                    found.add(origin)
    found.discard(module)
    return found


def import_cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    known = set(modules)
    return {
        name: imported_modules(path.read_text(), name, is_package, known)
        for name, (path, is_package) in modules.items()
    }


def _imports_by_function(source: str) -> Iterator[tuple[str, str, int]]:
    """(top-level module imported, enclosing function or ``<module>``, line) for every absolute import."""

    def walk(node: ast.AST, function: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(child, child.name)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name.split(".")[0], function, child.lineno
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module.split(".")[0], function, child.lineno
            yield from walk(child, function)

    yield from walk(ast.parse(source), "<module>")


def _core_imports_of(roots: set[str], *, skip: str | None = None) -> list[tuple[str, str, int]]:
    """(file, function, line) of every import of ``roots`` under ``tokcap/``, except under ``skip``."""
    hits = []
    for path in sorted((_ROOT / "tokcap").rglob("*.py")):
        relative = path.relative_to(_ROOT).as_posix()
        if skip is not None and relative.startswith(skip):
            continue
        hits.extend(
            (relative, function, line)
            for root, function, line in _imports_by_function(path.read_text())
            if root in roots
        )
    return hits


def test_the_core_imports_no_module_of_transports() -> None:
    assert _core_imports_of({"transports"}) == []


def test_no_file_of_the_core_names_a_transports_import_even_in_text() -> None:
    hits = [
        f"{path.relative_to(_ROOT).as_posix()}:{source[: match.start()].count(chr(10)) + 1}"
        for path in sorted((_ROOT / "tokcap").rglob("*.py"))
        for source in [path.read_text()]
        for match in _TRANSPORT_IMPORT.finditer(source)
    ]
    assert hits == []


def test_the_grep_for_a_transports_import_finds_each_spelling() -> None:
    found = [
        bool(_TRANSPORT_IMPORT.search(text))
        for text in (
            "from transports.kafka.cli import mount",
            "    import transports.kafka",
            "importlib.import_module('transports.kafka')",
            "``transports.kafka`` is a transport",
            "from tokcap.transports_note import x",
        )
    ]
    assert found == [True, True, True, False, False]


def test_the_kafka_transport_mounts_its_commands_through_the_installed_entry_point() -> None:
    mounts = {entry.name: entry.value for entry in entry_points(group="tokcap.transports")}
    assert mounts == {"kafka": "transports.kafka.cli:mount"}


def test_outside_its_command_line_the_core_imports_no_typer_rich_or_click() -> None:
    assert _core_imports_of({"typer", "rich", "click"}, skip="tokcap/cli/") == []


def test_the_core_imports_no_filelock_which_only_the_kafka_materializer_needs() -> None:
    assert _core_imports_of({"filelock"}) == []


def test_no_module_of_tokcap_or_transports_is_on_an_import_cycle_beyond_the_known_ones() -> None:
    graph = _import_graph()
    assert len(graph) > 80
    assert {"transports.kafka.wire.router", "transports.kafka.wire.codec", "tokcap.cli.app"} <= set(graph)
    assert sorted(map(sorted, import_cycles(graph))) == sorted(map(sorted, KNOWN_CYCLES))


def test_the_cycle_check_counts_type_only_lazy_and_relative_imports() -> None:
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    sources = {
        "pkg.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import Thing\n",
        "pkg.b": "def later():\n    from . import c\n",
        "pkg.c": "import pkg.a\nfrom pkg import d\n",
        "pkg.d": "import os\n",
    }
    graph = {name: imported_modules(source, name, False, known) for name, source in sources.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a", "pkg.d"}, "pkg.d": set()}
    assert import_cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]
    assert import_cycles({**graph, "pkg.c": {"pkg.d"}}) == []


def test_the_mount_check_finds_imports_at_any_depth_with_their_function() -> None:
    source = textwrap.dedent(
        """
        import transports.kafka
        def mount():
            from transports.kafka.cli import mount
        class Command:
            def run(self):
                if True:
                    import transports
        """
    )
    assert [(root, function) for root, function, _ in _imports_by_function(source)] == [
        ("transports", "<module>"),
        ("transports", "mount"),
        ("transports", "run"),
    ]


def _wire_imports() -> list[str]:
    """Every module a file of ``transports/kafka/wire/`` imports, as ``file: module``."""
    found = []
    for path in sorted((_ROOT / "transports" / "kafka" / "wire").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found.extend(f"{path.name}: {name}" for name in names)
    return found


def test_the_wire_floor_imports_no_kafka_client_and_nothing_of_the_transport_above_it() -> None:
    allowed = ("transports.kafka.wire", "transports.kafka.errors")
    above = [
        hit
        for hit in _wire_imports()
        if hit.split(": ")[1].split(".")[0] == "confluent_kafka"
        or (hit.split(": ")[1].startswith("transports") and not hit.split(": ")[1].startswith(allowed))
    ]
    assert above == []
    assert any(hit.endswith(": transports.kafka.wire.topic_limits") for hit in _wire_imports())
