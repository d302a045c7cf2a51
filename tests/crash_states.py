"""Power-loss crash states: record a workload's file operations, then build what a power loss may leave on disk.

The approach of the ALICE and CrashMonkey studies. While a workload runs for real in a directory, the ``os``
calls that change it (opens that create or truncate, writes, ``ftruncate``, ``fsync``/``fdatasync`` of files and
directories, renames, unlinks, ``mkdir``/``rmdir``) and the store's filesystem syncs are logged with their bytes.
A crash after any logged step may leave, by POSIX:

- whatever was made durable: a file's bytes after its ``fsync``; a directory's names after its ``fsync``;
  everything after a ``syncfs`` (or ``sync``);
- of a file's bytes not synced, any prefix of what was appended since (torn at a line end or a 4 KiB page),
  or, when the file was cut or rewritten since, its synced bytes or its new ones;
- of each name change not synced (a create, rename, unlink, ``mkdir``, ``rmdir``), the change or not,
  independently of the others and of the bytes of the file it names (a rename may survive while the renamed
  file's bytes do not).

A page-cache state (everything kept) is the state a SIGKILL leaves; the other states only a power loss does.
``CrashStates`` samples these states with a seeded generator and writes each one into a fresh directory.
Every acknowledgement the workload logs (``Recorder.ack``) marks what had returned ok by that step.

This module is also a pytest plugin (listed in ``tests/conftest.py``): it prints how many crash states the
session checked, so CI logs show the power-loss tests really ran.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["CrashState", "Recorder", "crash_states", "count_checked", "recording"]

PAGE = 4096

_checked: dict[str, int] = {}


def count_checked(workload: str, states: int) -> None:
    """Add ``states`` crash states of ``workload`` to the session's tally."""
    _checked[workload] = _checked.get(workload, 0) + states


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per session: how many crash states the power-loss tests checked."""
    if _checked:
        parts = ", ".join(f"{name} {count}" for name, count in sorted(_checked.items()))
        terminalreporter.write_line(f"power-loss: {sum(_checked.values())} crash states checked ({parts})")


# ------------------------------------------------------------------ the log


@dataclass(frozen=True)
class Create:
    path: str
    inode: int


@dataclass(frozen=True)
class Mkdir:
    path: str
    inode: int


@dataclass(frozen=True)
class Write:
    inode: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class Truncate:
    inode: int
    size: int


@dataclass(frozen=True)
class Rename:
    source: str
    target: str
    inode: int


@dataclass(frozen=True)
class Unlink:
    path: str
    inode: int


@dataclass(frozen=True)
class Rmdir:
    path: str
    inode: int


@dataclass(frozen=True)
class Fsync:
    inode: int


@dataclass(frozen=True)
class SyncAll:
    """``syncfs`` or ``sync``: every byte and name of the filesystem is durable."""


@dataclass(frozen=True)
class Ack:
    """The workload's operation returned ok: what it acknowledged is now owed after any crash."""

    what: Any


Step = Create | Mkdir | Write | Truncate | Rename | Unlink | Rmdir | Fsync | SyncAll | Ack
_NAME_CHANGES = (Create, Mkdir, Rename, Unlink, Rmdir)


def _parent(path: str) -> str:
    return os.path.dirname(path)


# ------------------------------------------------------------------ recording


class Recorder:
    """Logs the file operations of one directory tree while they run for real.

    The ``os`` functions are replaced process-wide for the recording (``pathlib`` calls them too); calls on
    anything outside the tree, or on descriptors not opened in it, pass through unlogged. One thread at a
    time may change the tree, so the log's order is the order the calls ran in.
    """

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.steps: list[Step] = []
        self._names: dict[str, int] = {"": 0}
        self._dirs: set[int] = {0}
        self._content: dict[int, bytearray] = {}
        self._fds: dict[int, tuple[int, bool]] = {}
        self._next_inode = 1
        self._lock = threading.RLock()

    def ack(self, what: Any) -> None:
        """Log that an operation returned ok; ``what`` says what it acknowledged."""
        self.steps.append(Ack(what))

    def _relative(self, path: Any) -> str | None:
        if isinstance(path, int):
            return None
        full: str = os.path.abspath(os.fspath(path))
        if full == self.root:
            return ""
        if full.startswith(self.root + os.sep):
            return full[len(self.root) + 1 :]
        return None

    def _new_inode(self, directory: bool) -> int:
        inode = self._next_inode
        self._next_inode += 1
        if directory:
            self._dirs.add(inode)
        else:
            self._content[inode] = bytearray()
        return inode

    # Each wrapper runs the real call first: a failed call changed nothing and is not logged.

    def open(self, real: Callable[..., int], path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        with self._lock:
            relative = None if kwargs.get("dir_fd") is not None else self._relative(path)
            existed = relative is not None and relative in self._names
            fd = real(path, flags, *args, **kwargs)
            if relative is None:
                return fd
            if not existed:
                if not flags & os.O_CREAT:
                    return fd  # a file made outside the recording (the test's own)
                inode = self._names[relative] = self._new_inode(directory=False)
                self.steps.append(Create(relative, inode))
            inode = self._names[relative]
            if inode in self._dirs:
                self._fds[fd] = (inode, False)
                return fd
            if flags & os.O_TRUNC and self._content[inode]:
                self._content[inode].clear()
                self.steps.append(Truncate(inode, 0))
            self._fds[fd] = (inode, bool(flags & os.O_APPEND))
            return fd

    def write(self, real: Callable[..., int], fd: int, data: Any) -> int:
        with self._lock:
            tracked = self._fds.get(fd)
            if tracked is None:
                return real(fd, data)
            inode, append = tracked
            content = self._content[inode]
            offset = len(content) if append else os.lseek(fd, 0, os.SEEK_CUR)
            written = real(fd, data)
            chunk = bytes(memoryview(data)[:written])
            content[offset : offset + len(chunk)] = chunk
            self.steps.append(Write(inode, offset, chunk))
            return written

    def ftruncate(self, real: Callable[..., None], fd: int, size: int) -> None:
        with self._lock:
            real(fd, size)
            tracked = self._fds.get(fd)
            if tracked is not None:
                content = self._content[tracked[0]]
                del content[size:]
                content.extend(b"\0" * (size - len(content)))
                self.steps.append(Truncate(tracked[0], size))

    def fsync(self, real: Callable[[int], None], fd: int) -> None:
        with self._lock:
            real(fd)
            tracked = self._fds.get(fd)
            if tracked is not None:
                self.steps.append(Fsync(tracked[0]))

    def close(self, real: Callable[[int], None], fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            real(fd)

    def rename(self, real: Callable[..., None], source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            real(source, target, *args, **kwargs)
            relative_source, relative_target = self._relative(source), self._relative(target)
            if relative_source is None or relative_target is None:
                assert relative_source is None and relative_target is None, (
                    "a rename across the recorded tree"
                )
                return
            assert _parent(relative_source) == _parent(relative_target), "renames stay in their directory"
            inode = self._names.pop(relative_source)
            self._names[relative_target] = inode
            self.steps.append(Rename(relative_source, relative_target, inode))

    def unlink(self, real: Callable[..., None], path: Any, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            real(path, *args, **kwargs)
            relative = self._relative(path)
            if relative is not None and relative in self._names:
                self.steps.append(Unlink(relative, self._names.pop(relative)))

    def mkdir(self, real: Callable[..., None], path: Any, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            real(path, *args, **kwargs)
            relative = self._relative(path)
            if relative is not None:
                inode = self._names[relative] = self._new_inode(directory=True)
                self.steps.append(Mkdir(relative, inode))

    def rmdir(self, real: Callable[..., None], path: Any, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            real(path, *args, **kwargs)
            relative = self._relative(path)
            if relative is not None and relative in self._names:
                self.steps.append(Rmdir(relative, self._names.pop(relative)))

    def sync_all(self, real: Callable[[], None]) -> None:
        with self._lock:
            real()
            self.steps.append(SyncAll())


@contextmanager
def recording(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """Record every change to the tree at ``root`` (which must exist and be empty) for the block.

    The store's ``syncfs`` is wrapped where the store looks it up (``tokcap.files.write_batches.filesystem_sync_for``).
    """
    import tokcap.files.write_batches

    assert root.is_dir() and not any(root.iterdir()), "record into an empty directory"
    recorder = Recorder(root)
    with monkeypatch.context() as patch:
        for name, wrapper in (
            ("open", recorder.open),
            ("write", recorder.write),
            ("ftruncate", recorder.ftruncate),
            ("fsync", recorder.fsync),
            ("fdatasync", recorder.fsync),
            ("close", recorder.close),
            ("replace", recorder.rename),
            ("rename", recorder.rename),
            ("unlink", recorder.unlink),
            ("remove", recorder.unlink),
            ("mkdir", recorder.mkdir),
            ("rmdir", recorder.rmdir),
            ("sync", recorder.sync_all),
        ):
            patch.setattr(os, name, _bound(wrapper, getattr(os, name)))
        real_sync_for: Callable[[Path], Callable[[], None]] = tokcap.files.write_batches.filesystem_sync_for  # type: ignore[attr-defined]

        def recorded_sync_for(directory: Path) -> Callable[[], None]:
            sync = real_sync_for(directory)
            return lambda: recorder.sync_all(sync)

        patch.setattr(tokcap.files.write_batches, "filesystem_sync_for", recorded_sync_for)
        yield recorder


def _bound(wrapper: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(real, *args, **kwargs)

    return call


# ------------------------------------------------------------------ crash states


@dataclass
class CrashState:
    """One on-disk state a power loss after ``step`` may leave, and what had been acknowledged by then."""

    step: int
    acked: list[Any]
    not_acked: list[Any]
    """What the workload acknowledged after the crash, in order: the first of a sequence may have run."""
    files: dict[str, bytes | None] = field(default_factory=dict)
    """Relative path to bytes; ``None`` for a directory."""

    def write_into(self, directory: Path) -> Path:
        """Write the state into ``directory`` (emptied first) and return it."""
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        for relative, data in sorted(self.files.items()):
            path = directory / relative
            if data is None:
                path.mkdir()
            else:
                path.write_bytes(data)
        return directory


def _cut_points(durable: bytes, current: bytes) -> list[int]:
    """Lengths a file with ``durable`` synced and ``current`` in the page cache may be left with."""
    if current == durable:
        return [len(current)]
    if not current.startswith(durable):
        return [len(durable), len(current)] if len(durable) <= len(current) else [len(current)]
    points = {len(durable), len(current)}
    for index in range(len(durable), len(current)):
        if current[index] == ord("\n"):
            points.add(index + 1)
    for page in range((len(durable) // PAGE + 1) * PAGE, len(current), PAGE):
        points.add(page)
    return sorted(points)


class _Replay:
    """The log replayed up to a step: current and durable bytes per file, and which name changes are durable."""

    def __init__(self, steps: list[Step], upto: int) -> None:
        self.current: dict[int, bytearray] = {}
        self.durable: dict[int, bytes] = {}
        self.name_changes: list[tuple[Step, bool]] = []
        self.acked: list[Any] = []
        pending: list[int] = []
        for step in steps[:upto]:
            if isinstance(step, Ack):
                self.acked.append(step.what)
            elif isinstance(step, Create):
                self.current[step.inode] = bytearray()
                self.durable[step.inode] = b""
            elif isinstance(step, Write):
                content = self.current[step.inode]
                content.extend(b"\0" * (step.offset - len(content)))
                content[step.offset : step.offset + len(step.data)] = step.data
            elif isinstance(step, Truncate):
                content = self.current[step.inode]
                del content[step.size :]
                content.extend(b"\0" * (step.size - len(content)))
            elif isinstance(step, Fsync):
                if step.inode in self.current:
                    self.durable[step.inode] = bytes(self.current[step.inode])
                else:  # a directory: every earlier name change in it is durable
                    directory = self._directory_path(step.inode)
                    for index in list(pending):
                        change = self.name_changes[index][0]
                        if directory is not None and _parent(_changed_path(change)) == directory:
                            self.name_changes[index] = (change, True)
                            pending.remove(index)
            elif isinstance(step, SyncAll):
                self.durable = {inode: bytes(content) for inode, content in self.current.items()}
                for index in pending:
                    self.name_changes[index] = (self.name_changes[index][0], True)
                pending.clear()
            if isinstance(step, _NAME_CHANGES):
                pending.append(len(self.name_changes))
                self.name_changes.append((step, False))

    def _directory_path(self, inode: int) -> str | None:
        if inode == 0:
            return ""
        path = None
        for change, _ in self.name_changes:
            if isinstance(change, Mkdir) and change.inode == inode:
                path = change.path
        return path

    def build(
        self, keep_change: Callable[[Step], bool], cut: Callable[[bytes, bytes], int]
    ) -> dict[str, bytes | None]:
        """The files left when the name changes ``keep_change`` says survive, with file bytes cut by ``cut``."""
        names: dict[str, int] = {"": 0}
        directories = {0}
        for change, durable in self.name_changes:
            if not durable and not keep_change(change):
                continue
            if isinstance(change, Create | Mkdir):
                if _parent(change.path) in names and change.path not in names:
                    names[change.path] = change.inode
                    if isinstance(change, Mkdir):
                        directories.add(change.inode)
            elif isinstance(change, Rename):
                if _parent(change.target) in names:
                    names[change.target] = change.inode
                if names.get(change.source) == change.inode:
                    del names[change.source]
            elif isinstance(change, Unlink):
                if names.get(change.path) == change.inode:
                    del names[change.path]
            elif isinstance(change, Rmdir):
                children = [path for path in names if _parent(path) == change.path]
                if names.get(change.path) == change.inode and not children:
                    del names[change.path]
        files: dict[str, bytes | None] = {}
        for path, inode in names.items():
            if path == "":
                continue
            if inode in directories:
                files[path] = None
            else:
                current = bytes(self.current[inode])
                files[path] = current[: cut(self.durable[inode], current)]
        # A name whose directory did not survive is gone with it.
        return {path: data for path, data in files.items() if _survives(path, files)}


def _survives(path: str, files: dict[str, bytes | None]) -> bool:
    parent = _parent(path)
    while parent:
        if parent not in files or files[parent] is not None:
            return False
        parent = _parent(parent)
    return True


def _changed_path(change: Step) -> str:
    if isinstance(change, Rename):
        return change.target
    assert isinstance(change, Create | Mkdir | Unlink | Rmdir)
    return change.path


def _none(change: Step) -> bool:
    return False


def _every(change: Step) -> bool:
    return True


def _synced_only(durable: bytes, current: bytes) -> int:
    return _cut_points(durable, current)[0]


def _page_cache(durable: bytes, current: bytes) -> int:
    return len(current)


def _acks_after(steps: list[Step], upto: int) -> int:
    """The latest crash with the disk as ``upto`` steps left it: after the acknowledgements that follow them."""
    while upto < len(steps) and isinstance(steps[upto], Ack):
        upto += 1
    return upto


def crash_states(steps: list[Step], *, seed: int, per_step: int, cap: int) -> list[CrashState]:
    """Distinct crash states after each step of the log, at most ``per_step`` random ones per step and ``cap`` in all.

    A crash after a step is taken just before the next one, so every acknowledgement between them counts.
    Per step, the two extremes come first: only what was synced (every unsynced byte and name change lost),
    then the page cache (a SIGKILL's state); then states where the name changes survive but the bytes do not
    (the rename-before-data case), then random mixes.
    """
    chooser = random.Random(seed)
    seen: set[tuple[tuple[str, bytes | None], ...]] = set()
    found: list[CrashState] = []
    points = [_acks_after(steps, index) for index, step in enumerate(steps, 1) if not isinstance(step, Ack)]
    for upto in points:
        replay = _Replay(steps, upto)
        not_acked = [step.what for step in steps[upto:] if isinstance(step, Ack)]
        strategies: list[tuple[Callable[[Step], bool], Callable[[bytes, bytes], int]]] = [
            (_none, _synced_only),
            (_every, _page_cache),
            (_every, _synced_only),
        ]
        while len(strategies) < per_step:
            strategies.append(
                (
                    lambda change: chooser.random() < 0.5,
                    lambda durable, current: chooser.choice(_cut_points(durable, current)),
                )
            )
        for keep_change, cut in strategies:
            files = replay.build(keep_change, cut)
            key = tuple(sorted(files.items()))
            if key in seen:
                continue
            seen.add(key)
            found.append(CrashState(upto, list(replay.acked), not_acked, files))
    if len(found) > cap:
        found = chooser.sample(found, cap)
        found.sort(key=lambda state: state.step)
    return found
