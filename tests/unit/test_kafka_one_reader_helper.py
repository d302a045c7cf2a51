"""Every private reader of a run topic is opened by ``clients.open_reader`` and nowhere else.

A private reader is a consumer that reads positions it is given and commits nothing. Its settings (a group of
its own, no commit, no silent offset reset, the login watch) and the step that teaches a new handle the leaders
of what it was assigned are easy to get subtly different in each copy; one helper keeps every reader alike.
The scan reads the source, so a new copy fails here before it can behave differently against a broker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import transports.kafka

KAFKA = Path(transports.kafka.__file__).parent
HELPER = ("client/clients.py", "open_reader")
NOT_CONSUMERS = frozenset({"Producer", "AdminClient"})
"""Clients ``build_client`` also builds that read no topic."""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _consumer_constructions(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each ``Consumer(...)`` and each ``build_client`` of a consumer."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                called = _name(child.func)
                builds_consumer = called == "build_client" and not (
                    child.args and _name(child.args[0]) in NOT_CONSUMERS
                )
                if called == "Consumer" or builds_consumer:
                    found.append((function, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_no_module_of_the_kafka_transport_builds_a_consumer_except_the_reader_helper() -> None:
    elsewhere = [
        f"{path.relative_to(KAFKA)}:{line} (in {function})"
        for path in sorted(KAFKA.rglob("*.py"))
        for function, line in _consumer_constructions(path.read_text())
        if (str(path.relative_to(KAFKA)), function) != HELPER
    ]
    assert elsewhere == [], "open every consumer with clients.open_reader"


def test_the_reader_helper_is_where_the_consumer_is_built() -> None:
    built = _consumer_constructions((KAFKA / HELPER[0]).read_text())
    assert [function for function, _ in built] == [HELPER[1]]


def test_the_scan_finds_a_consumer_built_directly_or_through_build_client() -> None:
    source = (
        "def a():\n    return Consumer({})\n"
        "def b(f):\n    return build_client(f, {}, c, 'consumer')\n"
        "def c():\n    return build_client(Producer, {}, c, 'producer')\n"
    )
    assert _consumer_constructions(source) == [("a", 2), ("b", 4)]
