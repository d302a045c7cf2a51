"""The core package stays importable without a server, transport or ML stack.

Model servers and trainers import tokcap; pulling in Kafka, FastAPI, Ray, Torch or aiohttp
would make every consumer pay for (and break on) stacks it does not use. These checks read the source;
importing every submodule in a fresh interpreter is ``tests/process/test_import_hygiene_fresh_interpreter.py``.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from core_imports import FORBIDDEN_ROOTS

import tokcap

_PACKAGE_DIR = Path(tokcap.__file__).resolve().parent


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
