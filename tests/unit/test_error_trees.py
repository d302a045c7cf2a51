"""Each errors module draws the tree of the classes it defines, and the Kafka transport keeps its own.

A reader learns which error to catch from the tree in the module's docstring, so a class the tree leaves out,
or a tree entry with no class, sends them to the wrong place. The Kafka transport's errors live in the
transport, each still beneath a class of tokcap's tree, so catching tokcap's root keeps catching them.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import tokcap.errors
import transports.kafka.errors

_TREE_ENTRY = re.compile(r"(?:├── |└── |^    )(\w+Error)\b", re.MULTILINE)


def _defined_classes(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if inspect.isclass(value) and value.__module__ == module.__name__ and issubclass(value, Exception)
    }


def _tree_entries(module: ModuleType) -> set[str]:
    assert module.__doc__ is not None
    return set(_TREE_ENTRY.findall(module.__doc__))


def test_the_core_error_tree_names_exactly_the_classes_the_core_defines() -> None:
    assert _tree_entries(tokcap.errors) == _defined_classes(tokcap.errors)


def test_the_kafka_error_tree_names_its_classes_and_the_core_classes_they_hang_from() -> None:
    own = _defined_classes(transports.kafka.errors)
    parents = {"TransportError", "ConfigError", "EventDecodeError"}
    assert _tree_entries(transports.kafka.errors) == own | parents


def test_every_kafka_error_is_beneath_tokcaps_root_and_none_is_defined_twice() -> None:
    kafka = _defined_classes(transports.kafka.errors)
    assert kafka.isdisjoint(_defined_classes(tokcap.errors))
    assert all(
        issubclass(getattr(transports.kafka.errors, name), tokcap.errors.TokcapError) for name in kafka
    )


def test_the_tree_reading_finds_root_branch_and_leaf_entries() -> None:
    doc = "Error tree::\n\n    RootError\n    ├── BranchError (ValueError)\n    │   └── LeafError\n"
    assert set(_TREE_ENTRY.findall(doc)) == {"RootError", "BranchError", "LeafError"}
