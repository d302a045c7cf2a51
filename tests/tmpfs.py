"""A real tmpfs of a few pages, mounted for one test: the full-disk tests fill it up.

Mounting needs root, as CI runs the suite; elsewhere the test is skipped with that reason.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["fill", "mounted_tmpfs"]


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``96k``, ``2m``) at ``mount_point`` for the block, then unmount it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the suite as root)")
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(path: Path, room: int = 0) -> None:
    """Take every free byte of the disk ``path`` is on, then give ``room`` bytes back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    if room:
        os.truncate(path, max(0, path.stat().st_size - room))
