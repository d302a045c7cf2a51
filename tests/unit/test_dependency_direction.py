"""Dependencies point from the transports and the command line to the core, never back, and never in a circle.

The core (``tokcap/``) reaches ``transports`` in exactly one place, the CLI's Kafka mount; the library needs
neither Typer nor Rich (the ``cli`` extra) nor filelock (the ``kafka`` extra); and no module of either
package imports itself back through others, counting imports under ``TYPE_CHECKING`` and inside functions,
because a type-only or lazy cycle is still two modules that cannot be understood one before the other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import tokcap

_ROOT = Path(tokcap.__file__).resolve().parent.parent
_PACKAGES = ("tokcap", "transports")

KAFKA_MOUNT = ("tokcap/cli/app.py", "_mount_kafka")
"""The one function of the core that imports ``transports``."""

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


def test_the_core_imports_transports_only_in_the_clis_kafka_mount() -> None:
    hits = _core_imports_of({"transports"})
    assert [(file, function) for file, function, _ in hits] == [KAFKA_MOUNT]


def test_outside_its_command_line_the_core_imports_no_typer_rich_or_click() -> None:
    assert _core_imports_of({"typer", "rich", "click"}, skip="tokcap/cli/") == []


def test_the_core_imports_no_filelock_which_only_the_kafka_materializer_needs() -> None:
    assert _core_imports_of({"filelock"}) == []


def test_no_module_of_tokcap_or_transports_is_on_an_import_cycle_beyond_the_known_ones() -> None:
    graph = _import_graph()
    assert len(graph) > 80
    assert {"transports.kafka.router", "transports.kafka.codec", "tokcap.cli.app"} <= set(graph)
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


def _tokcap(args: list[str], blocked: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the ``tokcap`` command in a fresh interpreter in which the ``blocked`` modules cannot be imported."""
    script = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "from tokcap.cli import run\n"
        f"sys.exit(run({args!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120, cwd=cwd
    )


def test_without_the_kafka_client_inspect_runs_and_a_kafka_command_names_the_extra(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    inspected = _tokcap(["inspect", str(store), "--json"], ["confluent_kafka"], tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert '"kafka_checkpoints": {}' in inspected.stdout
    refused = _tokcap(
        ["topic", "describe", "--bootstrap", "127.0.0.1:1", "--run", "r"], ["confluent_kafka"], tmp_path
    )
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1
    assert "pip install 'tokcap[kafka]'" in refused.stderr


def test_without_the_transports_package_the_core_commands_run_and_demo_over_kafka_names_the_extra(
    tmp_path: Path,
) -> None:
    blocked = ["transports", "confluent_kafka"]
    demo = _tokcap(["demo", "--rollouts", "5", "--turns", "2", "--json"], blocked, tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert '"transport": "file"' in demo.stdout
    over_kafka = _tokcap(["demo", "--bootstrap", "127.0.0.1:1"], blocked, tmp_path)
    assert over_kafka.returncode == 1
    assert over_kafka.stderr.count("\n") == 1
    assert "--bootstrap runs over Kafka" in over_kafka.stderr
    assert "pip install 'tokcap[kafka]'" in over_kafka.stderr


def test_without_typer_the_console_script_names_the_cli_extra_in_one_line(tmp_path: Path) -> None:
    completed = _tokcap(["--help"], ["typer"], tmp_path)
    assert completed.returncode == 1
    assert completed.stderr.count("\n") == 1
    assert completed.stderr.startswith("tokcap: error: the tokcap command needs typer")
    assert "pip install 'tokcap[cli]'" in completed.stderr


_LIBRARY_PROBE = textwrap.dedent(
    """
    import importlib
    import json
    import pkgutil
    import sys

    import tokcap

    for info in pkgutil.walk_packages(tokcap.__path__, prefix="tokcap."):
        if not info.name.startswith("tokcap.cli"):
            importlib.import_module(info.name)
    print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in {"typer", "rich", "click"})))
    """
)


def test_importing_every_library_module_loads_no_typer_rich_or_click() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _LIBRARY_PROBE], capture_output=True, text=True, check=False, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"
