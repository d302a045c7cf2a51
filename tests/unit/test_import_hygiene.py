"""The core package stays importable without a server, transport or ML stack.

Model servers and trainers import tokcap; pulling in Kafka, FastAPI, Ray, Torch or aiohttp
would make every consumer pay for (and break on) stacks it does not use.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import tokcap

FORBIDDEN_ROOTS = frozenset({"confluent_kafka", "fastapi", "ray", "torch", "aiohttp"})

_PACKAGE_DIR = Path(tokcap.__file__).resolve().parent

_PROBE = textwrap.dedent(
    """
    import importlib
    import json
    import pkgutil
    import sys

    import tokcap

    imported = ["tokcap"]
    for info in pkgutil.walk_packages(tokcap.__path__, prefix="tokcap."):
        importlib.import_module(info.name)
        imported.append(info.name)
    forbidden = set(json.loads(sys.argv[1]))
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in forbidden)
    print(json.dumps({"imported": imported, "forbidden_loaded": loaded}))
    """
)


def forbidden_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import statement in the source, at any depth, whose top-level module is forbidden."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = [node.module.split(".")[0]]
        else:
            continue
        found.extend(f"{filename}:{node.lineno}: {root}" for root in roots if root in FORBIDDEN_ROOTS)
    return found


def test_importing_tokcap_and_every_submodule_loads_no_forbidden_module() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(sorted(FORBIDDEN_ROOTS))],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert {"tokcap.config", "tokcap.protocols", "tokcap.records", "tokcap.store"} <= set(report["imported"])
    assert report["forbidden_loaded"] == []


def test_no_file_in_the_package_imports_a_forbidden_module() -> None:
    paths = sorted(_PACKAGE_DIR.rglob("*.py"))
    assert len(paths) >= 5
    offenders = [
        hit
        for path in paths
        for hit in forbidden_imports(path.read_text(), str(path.relative_to(_PACKAGE_DIR.parent)))
    ]
    assert offenders == []


def test_the_static_check_catches_top_level_nested_and_from_imports() -> None:
    source = textwrap.dedent(
        """
        import os
        import torch.nn
        from confluent_kafka import Producer
        from . import ray
        def lazy():
            import fastapi
            from aiohttp.web import Application
        """
    )
    hits = forbidden_imports(source)
    assert [hit.rsplit(": ", 1)[1] for hit in hits] == ["torch", "confluent_kafka", "fastapi", "aiohttp"]
