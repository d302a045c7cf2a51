"""Directories a process keeps for itself under one shared root, removed when it is done with them.

A config block that many processes read (every model server reads Gym's ``token_id_capture`` block) cannot
name a directory of each process's own. A reader that needs one (a projection of a run topic) takes it here
instead: ``<root>/<label>-<pid>-<nonce>``, made at its first use in the process and removed when its last user
in the process releases it (or the interpreter exits). Beside each directory is its lock file, which its
process holds (``flock``) from before the directory exists until after it is removed. A process killed before
it could remove its directory leaves both behind; the next process that takes a directory under the root
removes every directory whose pid no longer runs and whose lock it can take. Either sign alone is not
enough: pids are reused, and a lock is not seen across machines sharing a file system.

The root is ``$TOKCAP_PRIVATE_DIR``, else ``$XDG_CACHE_HOME/tokcap/private``, else
``~/.cache/tokcap/private``. Keep it on a local disk: what lives there is rebuilt from the log at every start.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from tokcap.errors import ConfigError

__all__ = ["PrivateDirectories", "private_directories", "private_root"]

_logger = logging.getLogger(__name__)

_LOCK_SUFFIX = ".lock"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def private_root() -> Path:
    """Where private directories are made: ``$TOKCAP_PRIVATE_DIR``, else under the user's cache directory."""
    chosen = os.environ.get("TOKCAP_PRIVATE_DIR")
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tokcap" / "private"


@dataclass
class _Held:
    path: Path
    lock_fd: int
    users: int


class PrivateDirectories:
    """A process-wide registry: ``acquire`` gives this process's directory for a key, ``release`` hands it back."""

    def __init__(self, root: Path | None = None) -> None:
        """``root`` fixes the root; by default it is read from the environment at each first use."""
        self._root = root
        self._lock = threading.Lock()
        self._by_key: dict[Hashable, _Held] = {}
        atexit.register(self._remove_all)

    def acquire(self, label: str, key: Hashable) -> Path:
        """This process's directory for ``key`` (made if need be), named after ``label`` (a topic, say).

        Every ``acquire`` is paired with one ``release``; the last one removes the directory.
        """
        with self._lock:
            held = self._by_key.get(key)
            if held is not None:
                held.users += 1
                return held.path
            root = self._root or private_root()
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot make the private directory root {root}: {exc}; set TOKCAP_PRIVATE_DIR to a writable "
                    "local directory"
                ) from exc
            self._remove_dead(root)
            held = self._make(root, label)
            self._by_key[key] = held
            return held.path

    def release(self, path: Path) -> None:
        """Hand a directory back; the last user removes it, then lets go of its lock."""
        with self._lock:
            for key, held in self._by_key.items():
                if held.path == path:
                    held.users -= 1
                    if held.users > 0:
                        return
                    del self._by_key[key]
                    break
            else:
                return
        _remove(held)

    def held(self) -> list[Path]:
        """The directories this process holds now."""
        with self._lock:
            return [held.path for held in self._by_key.values()]

    def _make(self, root: Path, label: str) -> _Held:
        name = f"{_UNSAFE.sub('_', label)[:100]}-{os.getpid()}-{secrets.token_hex(4)}"
        path = root / name
        lock_path = root / f"{name}{_LOCK_SUFFIX}"
        # The lock is held before its file has its final name, so a lock file anyone can see is always held
        # while its process lives.
        staging = root / f".{name}{_LOCK_SUFFIX}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(staging, lock_path)
            path.mkdir(mode=0o700)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staging)
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
            os.close(fd)
            raise
        return _Held(path, fd, 1)

    def _remove_dead(self, root: Path) -> None:
        """Remove the directories (and lock files) under ``root`` that a process left when it was killed."""
        mine = {held.path.name for held in self._by_key.values()}
        try:
            entries = list(root.iterdir())
        except OSError:
            return
        names = {entry.name.removeprefix(".").removesuffix(_LOCK_SUFFIX) for entry in entries}
        for name in sorted(names - mine):
            pid = _pid_of(name)
            if pid is None or (pid != os.getpid() and _runs(pid)):
                continue
            left = [root / name, root / f"{name}{_LOCK_SUFFIX}", root / f".{name}{_LOCK_SUFFIX}"]
            if _owner_gone(left[1:]):
                _logger.info("removing %s, left by process %d, which no longer runs", root / name, pid)
                shutil.rmtree(left[0], ignore_errors=True)
                for lock_path in left[1:]:
                    with contextlib.suppress(FileNotFoundError):
                        lock_path.unlink()

    def _remove_all(self) -> None:
        """At interpreter exit: remove what is still held (readers not closed)."""
        with self._lock:
            held, self._by_key = list(self._by_key.values()), {}
        for each in held:
            _remove(each)


def _remove(held: _Held) -> None:
    shutil.rmtree(held.path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (held.path.parent / f"{held.path.name}{_LOCK_SUFFIX}").unlink()
    os.close(held.lock_fd)


def _pid_of(name: str) -> int | None:
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_gone(lock_paths: list[Path]) -> bool:
    """Whether no process holds any of these lock files (a missing file is held by nobody)."""
    for lock_path in lock_paths:
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        except OSError:
            return False  # not ours to judge (another user's, say): left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return True


private_directories = PrivateDirectories()
"""The registry every reader of this process that needs a directory of its own uses."""
