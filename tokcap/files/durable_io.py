"""Small named durability steps the store is built from.

Each helper does one thing the crash-safety argument relies on, so a reader
can check the argument step by step: append and fsync, replace atomically,
make a rename or removal durable with a directory fsync.

No helper follows a symbolic link: a link planted in the store could make it write or truncate a file
outside it. Every failed write leaves the target as it was or with a torn tail the next writer cuts, and
leaves no temporary file behind.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from tokcap.errors import StoreCorruptionError

__all__ = [
    "append_durably",
    "append_to",
    "fsync_directory",
    "open_for_append",
    "open_no_follow",
    "read_no_follow",
    "remove_if_exists",
    "remove_stale_temp_files",
    "rename_over",
    "replace_atomically",
    "temp_path_for",
    "truncate_no_follow",
    "write_temp_sibling",
]

_READ_CHUNK = 1 << 16
"""Bytes asked for per ``read``: a state file usually fits in one."""

_STALE_TEMP = re.compile(r"\.tmp-(\d+)-\d+$")


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symbolic link with a clear error instead of following it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreCorruptionError(
                f"{path} is a symbolic link; tokcap never follows links in its store directory (it could write "
                "outside it). Remove the link and restore the real file"
            ) from exc
        if exc.filename is None:
            exc.filename = str(path)
        raise


def read_no_follow(path: Path) -> bytes | None:
    """A whole file's bytes, ``None`` when it does not exist; a link is refused."""
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # Plain reads on the descriptor: a buffered file object costs more than the read of a small state file.
        chunks: list[bytes] = []
        while chunk := os.read(fd, _READ_CHUNK):
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def open_for_append(path: Path) -> int:
    """A descriptor that appends to ``path`` (created if missing); a link is refused."""
    return open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def append_to(fd: int, path: Path, data: bytes, *, durable: bool = False, measure: bool = True) -> int:
    """Append ``data`` to an ``open_for_append`` descriptor of ``path``; return the file size before the append.

    One ``write`` on an ``O_APPEND`` descriptor keeps concurrent appenders from interleaving. A caller that
    counts the size itself passes ``measure=False`` to skip asking for it (and gets -1).
    """
    start = os.fstat(fd).st_size if measure else -1
    view = memoryview(data)
    try:
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise
    return start


def append_durably(path: Path, data: bytes, *, durable: bool = True) -> int:
    """Append ``data`` in one write and fsync it; return the file size before the append."""
    fd = open_for_append(path)
    try:
        return append_to(fd, path, data, durable=durable)
    finally:
        os.close(fd)


def truncate_no_follow(path: Path, size: int) -> None:
    """Cut a file back to ``size`` bytes and sync it; a link is refused."""
    fd = open_no_follow(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: Path) -> Path:
    """A temporary sibling unique to this process and thread, so concurrent writers never share one."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def replace_atomically(
    path: Path, data: bytes, *, durable: bool, before_rename: Callable[[], None] | None = None
) -> None:
    """Write a whole file through a temporary sibling and rename it over the target.

    Readers see the old or the new content, never a mix. A failed write removes the temporary file.
    With ``durable`` the content is fsynced before the rename; the directory is synced by the caller.
    ``before_rename`` runs between the write and the rename: a caller that makes the content durable with a
    sync of the whole filesystem passes it here, since a power loss may keep a rename whose file's bytes were
    never written (a state file found empty) unless they were synced before it.
    Renaming over a symbolic link replaces the link, never the file it points to.
    """
    tmp = write_temp_sibling(path, data, durable=durable)
    try:
        if before_rename is not None:
            before_rename()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    rename_over(tmp, path)


def write_temp_sibling(path: Path, data: bytes, *, durable: bool) -> Path:
    """Write ``data`` to a new temporary sibling of ``path`` (fsynced with ``durable``) and return it.

    The first half of ``replace_atomically``, for a caller that syncs many files at once before renaming
    them with ``rename_over``. A failed write removes the temporary file.
    """
    tmp = temp_path_for(path)
    fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        exc.filename = exc.filename or str(path)
        raise
    return tmp


def rename_over(tmp: Path, path: Path) -> None:
    """Rename a temporary sibling over ``path``; a failed rename removes the temporary file."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        exc.filename = exc.filename or str(path)
        raise


def fsync_directory(directory: Path) -> None:
    """Make renames, creations and removals in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_if_exists(path: Path) -> bool:
    """Remove a file (a link itself, never its target); return whether it existed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Remove temporary files left by killed processes; a live process's temporary file is kept."""
    removed: list[Path] = []
    for path in directory.iterdir():
        match = _STALE_TEMP.search(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
        except PermissionError:
            continue
    return removed
