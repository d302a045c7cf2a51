"""The marker spill: incomplete markers kept on local disk until the broker has acknowledged them.

``mark_incomplete`` must be more available than ``put`` (Gym 0.7.0's protocol asks for it): a marker that
cannot reach the broker is the only evidence that a rollout lost a call. So the sink writes every marker here
first, sends it, and removes it only once the broker acknowledged it; a marker the broker did not take stays
and is forwarded later, by this sink or by the next sink on the same spill directory after a crash.

Layout, under ``<spill_dir>/<topic>/``:

- ``<session>.lock``: held (``flock``) by the live sink session that writes ``<session>-*`` markers. It is
  created under a temporary name, locked, then renamed into place, so every lock file a reader sees belongs
  to a live session until that session dies; a lock nobody holds belongs to a dead process.
- ``<session>-<n>.marker``: one canonical ``IncompleteEvent`` whose ``marker_id`` is ``<session>-<n>``,
  written whole (temporary file, fsync, rename, directory fsync), so a crash leaves the marker or nothing.
- ``.<session>-<n>.marker.tmp``: a marker being written; one left by a dead session is removed unread
  (its ``mark_incomplete`` never returned, and the call's dangling intent still masks the rollout).

Anything else found under those names (a directory, a symbolic link, a fifo, a file that cannot be read or
decoded) is set aside as ``<name>.corrupt`` with a logged error and never forwarded, so it cannot stop a sink
from starting or hide the readable markers beside it.

A sink adopts the markers of dead sessions when it starts: it takes their lock (so no other sink adopts them
too), forwards them, removes them, then removes the lock. The log may still hold a marker twice when an
acknowledgement was lost (the process died after the broker wrote it and before the file was removed, or the
broker wrote it after the delivery timed out); the apply step applies a marker id once, so the projection is
the same either way.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from tokcap.errors import EventDecodeError, NewerSchemaError, TransportError
from tokcap.log.events import IncompleteEvent, decode_event, encode_event

__all__ = [
    "SPILL_DIR_ENV",
    "MarkerSpill",
    "MarkerSpillError",
    "SpilledMarker",
    "default_spill_dir",
    "logger",
]

logger = logging.getLogger(__name__)

SPILL_DIR_ENV = "TOKCAP_SPILL_DIR"
"""Overrides the default spill directory of every sink that is not given ``spill_dir``."""

_LOCK_SUFFIX = ".lock"
_MARKER_SUFFIX = ".marker"
_TMP_SUFFIX = ".tmp"
_CORRUPT_SUFFIX = ".corrupt"
_MARKER_NAME = re.compile(r"^(?P<session>[A-Za-z0-9]+)-(?P<sequence>\d+)\.marker$")


class MarkerSpillError(TransportError):
    """A marker could not be written to, or read from, the local spill directory."""


def default_spill_dir() -> Path:
    """``$TOKCAP_SPILL_DIR``, else ``$XDG_CACHE_HOME/tokcap/spill``, else ``~/.cache/tokcap/spill``."""
    override = os.environ.get(SPILL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tokcap" / "spill"


@dataclass(frozen=True)
class SpilledMarker:
    """One marker on disk, waiting for the broker's acknowledgement."""

    path: Path
    session: str
    sequence: int
    event: IncompleteEvent

    @property
    def marker_id(self) -> str:
        """The id the event carries, and the file's name without its suffix."""
        return f"{self.session}-{self.sequence}"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling: fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def _read_regular_file(path: Path) -> bytes:
    """The bytes of a regular file; ``OSError`` for anything else, which is never followed or waited on.

    A link is refused (``O_NOFOLLOW``), a fifo is opened without waiting for a writer (``O_NONBLOCK``) and,
    like a directory, refused by its type before anything is read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks: list[bytes] = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _set_aside(path: Path, why: str) -> None:
    """Move a spill entry that is not a readable marker or lock out of the way, with a logged error."""
    aside = path.with_name(path.name + _CORRUPT_SUFFIX)
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    except OSError as exc:
        logger.error(
            "spill entry %s %s, and it cannot be moved aside (%s); it is skipped: remove it by hand",
            path,
            why,
            exc,
        )
        return
    logger.error(
        "spill entry %s %s; moved to %s and not forwarded: if it was a marker, mark its rollout incomplete by "
        "hand if it still matters",
        path,
        why,
        aside,
    )


class MarkerSpill:
    """The spill of one sink session on one topic, and the markers it adopted from dead sessions.

    Thread-safe. Nothing is created on disk until the first marker is written.
    """

    def __init__(self, directory: Path, session: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9]+", session):
            raise ValueError(f"a spill session must be alphanumeric, got {session!r}")
        self._directory = directory
        self._session = session
        self._lock = threading.Lock()
        self._own_lock_fd: int | None = None
        self._adopted: dict[str, int] = {}
        """Dead sessions whose lock this spill holds, by session, with the lock's descriptor."""
        self._closed = False

    @property
    def directory(self) -> Path:
        """Where this spill's files live."""
        return self._directory

    # ------------------------------------------------------------------ writing

    def write(self, event: IncompleteEvent) -> SpilledMarker:
        """Durably keep a marker of this session; raise ``MarkerSpillError`` naming the file when it cannot."""
        session, _, sequence = event.marker_id.rpartition("-")
        if session != self._session or not sequence.isdigit():
            raise ValueError(f"marker id {event.marker_id!r} is not one of session {self._session}")
        path = self._directory / f"{event.marker_id}{_MARKER_SUFFIX}"
        try:
            with self._lock:
                self._hold_own_lock()
                _write_whole(path, encode_event(event))
        except OSError as exc:
            raise MarkerSpillError(
                f"cannot spill the incomplete marker of call {event.model_call_id!r} of rollout "
                f"{event.rollout_id!r} to {path}: {exc}; check that the spill directory is writable and has space"
            ) from exc
        return SpilledMarker(path, session, int(sequence), event)

    def _hold_own_lock(self) -> None:
        """Create and lock this session's lock file, under a temporary name first; caller holds ``_lock``."""
        if self._own_lock_fd is not None:
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        final = self._directory / f"{self._session}{_LOCK_SUFFIX}"
        tmp = self._directory / f".{self._session}{_LOCK_SUFFIX}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, final)
            _fsync_directory(self._directory)
        except BaseException:
            os.close(fd)
            raise
        self._own_lock_fd = fd

    def remove(self, marker: SpilledMarker) -> None:
        """Forget a marker the broker acknowledged; an adopted session is released once it has none left.

        The removal is not synced: a marker that comes back after a crash is forwarded again, and the apply
        step applies its id once.
        """
        marker.path.unlink(missing_ok=True)
        with self._lock:
            fd = self._adopted.get(marker.session)
            if fd is not None and not self._markers_of(marker.session):
                self._release(marker.session, fd)
                del self._adopted[marker.session]

    # ------------------------------------------------------------------ reading

    def pending(self) -> list[SpilledMarker]:
        """Every marker of this session and of the adopted ones still on disk, in writing order per session."""
        with self._lock:
            sessions = [self._session, *sorted(self._adopted)]
            return [marker for session in sessions for marker in self._markers_of(session)]

    def adopt_dead_sessions(self) -> list[SpilledMarker]:
        """Take over the markers of every session whose process died; return them."""
        if not self._directory.is_dir():
            return []
        with self._lock:
            adopted: list[SpilledMarker] = []
            for path in sorted(self._directory.glob(f"*{_LOCK_SUFFIX}")):
                session = path.name[: -len(_LOCK_SUFFIX)]
                if session == self._session or session in self._adopted:
                    continue
                fd = self._lock_if_dead(path)
                if fd is None:
                    continue
                for tmp in self._directory.glob(f".{session}-*{_MARKER_SUFFIX}{_TMP_SUFFIX}"):
                    try:
                        tmp.unlink(missing_ok=True)
                    except OSError as exc:
                        _set_aside(tmp, f"is not a half-written marker that can be removed ({exc})")
                markers = self._markers_of(session)
                if markers:
                    self._adopted[session] = fd
                    adopted.extend(markers)
                    logger.warning(
                        "adopting %d incomplete marker(s) spilled by a sink that stopped (session %s) in %s",
                        len(markers),
                        session,
                        self._directory,
                    )
                else:
                    self._release(session, fd)
            return adopted

    @staticmethod
    def _lock_if_dead(path: Path) -> int | None:
        """The lock's descriptor, locked, when its session is dead; ``None`` while its session lives.

        A lock is a regular file a session created; anything else under a lock's name is set aside. A lock
        that cannot be opened is reported and skipped: its session may be alive, so its markers stay.
        """
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                _set_aside(path, "is not a session's lock file (a directory, a link or a special file)")
                return None
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.error(
                "spill lock %s cannot be opened (%s); the markers of its session are left as they are",
                path,
                exc,
            )
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not path.exists():
            # Its adopter removed it between our open and our lock: nothing is left to adopt.
            os.close(fd)
            return None
        return fd

    def _markers_of(self, session: str) -> list[SpilledMarker]:
        """The readable markers of one session, by sequence; anything else is set aside and reported."""
        markers = []
        for path in self._directory.glob(f"{session}-*{_MARKER_SUFFIX}"):
            match = _MARKER_NAME.match(path.name)
            if match is None or match["session"] != session:
                continue
            try:
                event = decode_event(_read_regular_file(path))
            except FileNotFoundError:
                continue
            except OSError as exc:
                _set_aside(path, f"is unreadable as a marker file ({exc})")
                continue
            except (EventDecodeError, NewerSchemaError) as exc:
                _set_aside(path, f"is unreadable as a marker ({exc})")
                continue
            if not isinstance(event, IncompleteEvent) or event.marker_id != path.name[: -len(_MARKER_SUFFIX)]:
                _set_aside(path, "does not hold its own marker")
                continue
            markers.append(SpilledMarker(path, session, int(match["sequence"]), event))
        return sorted(markers, key=lambda marker: marker.sequence)

    def _release(self, session: str, fd: int) -> None:
        """Remove a session's lock file while holding it, then let go; caller holds ``_lock``."""
        (self._directory / f"{session}{_LOCK_SUFFIX}").unlink(missing_ok=True)
        os.close(fd)

    # ------------------------------------------------------------------ closing

    def close(self) -> int:
        """Let go of every lock; return how many markers stay on disk for a later sink to forward."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            left = 0
            for session, fd in sorted(self._adopted.items()):
                left += len(self._markers_of(session))
                os.close(fd)
            self._adopted.clear()
            if self._own_lock_fd is not None:
                own = len(self._markers_of(self._session))
                left += own
                if own:
                    os.close(self._own_lock_fd)
                else:
                    self._release(self._session, self._own_lock_fd)
                self._own_lock_fd = None
        if left:
            logger.warning(
                "%d incomplete marker(s) are still spilled in %s; the next sink on this topic and spill "
                "directory forwards them",
                left,
                self._directory,
            )
        return left
