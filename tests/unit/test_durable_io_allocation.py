"""Whole-file replacement allocates the new file's blocks first, and no filesystem answer is lost on the way.

Allocating up front keeps ext4's rename from forcing the allocation itself; a filesystem that cannot
allocate is written as before, and one that is full says so before anything is renamed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tokcap import durable_io
from tokcap.durable_io import replace_atomically


def _refuse_with(code: int) -> Callable[[int, int, int], None]:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    return refuse


def test_a_replaced_file_holds_exactly_the_new_bytes_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    target = tmp_path / "r.tokens.state.json"
    target.write_bytes(b'{"version":1}\n' * 50)
    replace_atomically(target, b'{"version":2}\n', durable=False)
    assert target.read_bytes() == b'{"version":2}\n'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.tokens.state.json"]


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS])
def test_a_filesystem_that_cannot_allocate_up_front_still_gets_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    monkeypatch.setattr(durable_io.os, "posix_fallocate", _refuse_with(code))
    target = tmp_path / "r.tokens.state.json"
    replace_atomically(target, b"x" * 10_000, durable=True)
    assert target.read_bytes() == b"x" * 10_000


def test_a_full_disk_met_while_allocating_is_raised_and_the_old_file_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "r.tokens.state.json"
    target.write_bytes(b"old\n")
    monkeypatch.setattr(durable_io.os, "posix_fallocate", _refuse_with(errno.ENOSPC))
    with pytest.raises(OSError) as raised:
        replace_atomically(target, b"new\n", durable=False)
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(target)
    assert target.read_bytes() == b"old\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.tokens.state.json"]


def test_the_new_file_is_allocated_at_its_full_size_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[int, int, int]] = []
    allocate = os.posix_fallocate

    def recording(fd: int, offset: int, length: int) -> None:
        asked.append((os.fstat(fd).st_size, offset, length))
        allocate(fd, offset, length)

    monkeypatch.setattr(durable_io.os, "posix_fallocate", recording)
    replace_atomically(tmp_path / "r.tokens.state.json", b"y" * 777, durable=False)
    assert asked == [(0, 0, 777)]
