"""Every module of ``tokcap`` and ``transports`` is named in the module map of ``docs/architecture.md``.

The map is where a reader looks for what owns a concept; a module missing from it is found only by grepping.
A row's first cell names paths: the first one whole (``transports/kafka/wire/codec.py``), the rest relative
to its folder (``router.py``), and a folder (``tokcap/staging/``) covers every module beneath it.
"""

from __future__ import annotations

import re
from pathlib import Path

import tokcap

_ROOT = Path(tokcap.__file__).resolve().parent.parent
_MAP_HEADING = "## Where the code is"
_CELL_PATH = re.compile(r"`([\w./]+)`")


def covered_paths(document: str) -> tuple[set[str], set[str]]:
    """(files, folders) the map's rows name, each a path from the repository root."""
    section = document.split(_MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    files: set[str] = set()
    folders: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        names = _CELL_PATH.findall(line.split(" | ", 1)[0])
        base = ""
        for name in names:
            if name.startswith(("tokcap/", "transports/")):
                base = name if name.endswith("/") else name.rsplit("/", 1)[0] + "/"
                path = name
            else:
                path = f"{base}{name}"
            (folders if path.endswith("/") else files).add(path)
    return files, folders


def unmapped_modules(document: str, modules: list[str]) -> list[str]:
    files, folders = covered_paths(document)
    return [
        module
        for module in modules
        if module not in files and not any(module.startswith(folder) for folder in folders)
    ]


def _modules() -> list[str]:
    return sorted(
        path.relative_to(_ROOT).as_posix()
        for package in ("tokcap", "transports")
        for path in (_ROOT / package).rglob("*.py")
        if path.name not in {"__init__.py", "__main__.py"}
    )


def test_every_module_is_named_in_the_architecture_module_map() -> None:
    document = (_ROOT / "docs" / "architecture.md").read_text()
    assert unmapped_modules(document, _modules()) == []


def test_the_map_reading_takes_whole_paths_siblings_and_folders() -> None:
    document = (
        "## Where the code is\n\n| module | role |\n| --- | --- |\n"
        "| `tokcap/a/one.py`, `two.py` | x |\n| `tokcap/b/` | y |\n\n## Next\n\n| `tokcap/c/late.py` | z |\n"
    )
    modules = [
        "tokcap/a/one.py",
        "tokcap/a/two.py",
        "tokcap/a/three.py",
        "tokcap/b/deep/four.py",
        "tokcap/c/late.py",
    ]
    assert covered_paths(document) == ({"tokcap/a/one.py", "tokcap/a/two.py"}, {"tokcap/b/"})
    assert unmapped_modules(document, modules) == ["tokcap/a/three.py", "tokcap/c/late.py"]
