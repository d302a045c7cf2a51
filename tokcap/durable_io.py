"""Small named durability steps the store is built from.

Each helper does one thing the crash-safety argument relies on, so a reader
can check the argument step by step: append and fsync, replace atomically,
make a rename or removal durable with a directory fsync.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "append_durably",
    "fsync_directory",
    "remove_if_exists",
    "replace_atomically",
    "temp_path_for",
]


def append_durably(path: Path, data: bytes, *, durable: bool = True) -> int:
    """Append ``data`` in one write and fsync it; return the file size before the append.

    One ``write`` on an ``O_APPEND`` descriptor keeps concurrent appenders from interleaving.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
        return start
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """A temporary sibling unique to this process and thread, so concurrent writers never share one."""
    import threading

    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def replace_atomically(path: Path, data: bytes, *, durable: bool) -> None:
    """Write a whole file through a temporary sibling and rename it over the target.

    Readers see the old or the new content, never a mix.
    With ``durable`` the content is fsynced before the rename; the directory is synced by the caller.
    """
    tmp = temp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_directory(directory: Path) -> None:
    """Make renames, creations and removals in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_if_exists(path: Path) -> bool:
    """Remove a file; return whether it existed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
