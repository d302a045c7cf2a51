"""Both writers stand on one effect interpreter: neither imports the other, and only it reads effect types."""

from __future__ import annotations

import ast
from pathlib import Path

import tokcap

_TOKCAP = Path(tokcap.__file__).parent
_FILES = _TOKCAP / "files"
_EFFECTS = {
    "AppendEntry",
    "AppendIntent",
    "AppendIncompleteMark",
    "AppendStagedLine",
    "AppendLedgerLine",
    "WriteState",
    "Barrier",
    "RemoveRecords",
    "RemoveState",
}


def _runtime_imports(path: Path) -> set[str]:
    """Modules a file imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    checking_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _effect_type_checks(path: Path) -> int:
    """How many ``isinstance`` calls of a file name one of the rules' effect classes."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            names = {child.id for child in ast.walk(node.args[1]) if isinstance(child, ast.Name)}
            count += bool(names & _EFFECTS)
    return count


def test_the_shared_store_and_the_single_writer_projection_never_import_each_other() -> None:
    assert "tokcap.files.store" not in _runtime_imports(_FILES / "log_projection.py")
    assert "tokcap.files.log_projection" not in _runtime_imports(_FILES / "store.py")


def test_only_the_rollout_files_module_dispatches_on_effect_types() -> None:
    dispatching = {
        path.name for path in _TOKCAP.rglob("*.py") if path.name != "rules.py" and _effect_type_checks(path)
    }
    assert dispatching == {"rollout_files.py"}
