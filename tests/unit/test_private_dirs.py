"""A process's private directories: shared per key in the process, removed at the last release, and removed by
the next start once their owner is gone (its pid does not run and its lock is free)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tokcap.errors import ConfigError
from tokcap.files.private_dirs import PrivateDirectories, private_root


def _entries(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


def test_one_key_gets_one_directory_removed_with_its_lock_at_the_last_release(tmp_path: Path) -> None:
    directories = PrivateDirectories(tmp_path)
    first = directories.acquire("ledger-run-1", ("ledger", "run-1"))
    assert directories.acquire("ledger-run-1", ("ledger", "run-1")) == first
    other = directories.acquire("ledger-run-1", ("ledger", "elsewhere"))
    assert other != first and first.is_dir() and other.is_dir()
    assert first.name.startswith(f"ledger-run-1-{os.getpid()}-")
    assert (tmp_path / f"{first.name}.lock").exists()
    directories.release(first)
    assert first.is_dir()
    directories.release(first)
    assert not first.exists() and not (tmp_path / f"{first.name}.lock").exists()
    directories.release(other)
    assert _entries(tmp_path) == []


def test_a_reused_pid_does_not_keep_a_dead_owners_directory(tmp_path: Path) -> None:
    """A name with this process's pid that this process does not hold is a previous process's (pid reused)."""
    stale = tmp_path / f"ledger-run-{os.getpid()}-0badcafe"
    stale.mkdir()
    (tmp_path / f"{stale.name}.lock").write_bytes(b"")
    directories = PrivateDirectories(tmp_path)
    mine = directories.acquire("ledger-run", "key")
    assert not stale.exists() and not (tmp_path / f"{stale.name}.lock").exists()
    directories.release(mine)


def test_a_held_lock_keeps_a_directory_whose_pid_looks_gone(tmp_path: Path) -> None:
    """Another pid namespace (a container) sharing the root: its pid is not seen here, its lock is."""
    holder = PrivateDirectories(tmp_path)
    held = holder.acquire("ledger-run", "key")
    unseen_pid = 2**22 + 17
    renamed = tmp_path / held.name.replace(f"-{os.getpid()}-", f"-{unseen_pid}-")
    held.rename(renamed)
    (tmp_path / f"{held.name}.lock").rename(tmp_path / f"{renamed.name}.lock")
    other = PrivateDirectories(tmp_path)
    mine = other.acquire("ledger-run", "key")
    assert renamed.is_dir()
    other.release(mine)


def test_an_unwritable_root_is_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="TOKCAP_PRIVATE_DIR"):
        PrivateDirectories(blocker / "root").acquire("ledger-run", "key")


def test_the_root_is_the_environment_setting_else_the_users_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKCAP_PRIVATE_DIR", "/srv/tokcap-private")
    assert private_root() == Path("/srv/tokcap-private")
    monkeypatch.delenv("TOKCAP_PRIVATE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/me")
    assert private_root() == Path("/var/cache/me/tokcap/private")


def test_a_lock_this_process_cannot_open_keeps_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's directory under a shared root: its lock cannot be opened here, so it is left alone."""
    stale = tmp_path / "ledger-run-999999999-0badcafe"
    stale.mkdir()
    lock = tmp_path / f"{stale.name}.lock"
    lock.write_bytes(b"")
    opened = os.open

    def refusing(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **where: Any) -> int:
        if Path(path) == lock:
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, flags, mode, **where)

    monkeypatch.setattr("tokcap.files.private_dirs.os.open", refusing)
    directories = PrivateDirectories(tmp_path)
    mine = directories.acquire("ledger-run", "key")
    assert stale.is_dir() and lock.exists()
    directories.release(mine)
