"""The broker JVM as a process: the java binary, the state dir's lock and pid file, and stopping it.

A pid file can outlive its process and the pid be reused, so a process counts as a state dir's broker only
when its command line names that state dir's ``server.properties``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import BrokerError
from .layout import ENV_JAVA, LOCK_FILE, PID_FILE, PROPERTIES_FILE


def java_binary() -> str:
    """Pick the java binary: explicit override, then JAVA_HOME, then PATH."""
    override = os.environ.get(ENV_JAVA)
    if override:
        if not os.access(override, os.X_OK):
            raise BrokerError(f"{ENV_JAVA}={override} is not an executable java")
        return override
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise BrokerError("java not found: install a Java 17+ runtime (e.g. apt-get install openjdk-17-jre)")
    return found


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    """Serialize start/stop on one state dir across processes (e.g. two pytest sessions)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Brokers started by this process: reaping them through Popen avoids zombies that look alive.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def read_pid(state_dir: Path) -> int | None:
    """Pid from the pid file, or None if absent or garbled."""
    try:
        return int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def is_our_broker(pid: int, state_dir: Path) -> bool:
    """True if pid is alive and is the broker JVM of this state dir (guards against pid reuse).

    Right after launch the java launcher's /proc/PID/cmdline reads empty for a few milliseconds,
    so a child we started is judged by poll(), and an empty cmdline is read again.
    """
    child = CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    for _ in range(40):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            return False
        if cmdline:
            return "kafka.Kafka" in cmdline and str(state_dir / PROPERTIES_FILE) in cmdline
        time.sleep(0.05)
    return False


def wait_gone(pid: int, state_dir: Path, timeout: float) -> bool:
    """Poll until the broker process has exited (reaping it if it is our child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_our_broker(pid, state_dir):
            return True
        time.sleep(0.1)
    return not is_our_broker(pid, state_dir)


def terminate(pid: int, state_dir: Path, timeout: float) -> None:
    """SIGTERM (runs Kafka's clean shutdown hook), then SIGKILL if it hangs."""
    if not is_our_broker(pid, state_dir):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, state_dir, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pid, state_dir, 10.0)
    child = CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
