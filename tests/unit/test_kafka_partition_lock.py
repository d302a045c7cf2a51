"""A partition's ownership of a directory is the same ``flock`` as a rollout's lock: one lock implementation.

A second holder of a partition's lock file is refused at once, the lock is free again once released, and no
module of the library or its transports takes a lock another way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from transports.kafka.errors import MaterializerOwnedElsewhereError
from transports.kafka.materializer.ownership import hold_partition

ROOT = Path(__file__).resolve().parents[2]


def test_a_partition_held_in_a_directory_is_refused_to_a_second_holder_until_released(tmp_path: Path) -> None:
    first = hold_partition(tmp_path, "topic", 3)
    with pytest.raises(MaterializerOwnedElsewhereError, match="partition 3 of 'topic' is already being"):
        hold_partition(tmp_path, "topic", 3)
    hold_partition(tmp_path, "topic", 4).release()
    first.release()
    with hold_partition(tmp_path, "topic", 3):
        pass


def test_no_module_of_the_library_or_its_transports_imports_filelock() -> None:
    importers = []
    for package in ("tokcap", "transports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(name.split(".")[0] == "filelock" for name in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert importers == []
