"""The single-node broker (KRaft, broker and controller in one JVM): its status, start, stop and log.

It runs on 127.0.0.1 with free ports and can be stopped and started again on the same ports and data dir.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import BrokerError
from .jars import fetch
from .layout import (
    BOOTSTRAP_FILE,
    DATA_DIR,
    LOG4J_FILE,
    LOGS_DIR,
    OWNER_FILE,
    PID_FILE,
    PROPERTIES_FILE,
    SERVER_LOG,
    START_TIMEOUT_S,
    STDOUT_LOG,
    STOP_TIMEOUT_S,
    default_state_dir,
)
from .ports import free_port
from .probe import answers, port_open, wait_port
from .processes import CHILDREN, is_our_broker, java_binary, locked, pid_alive, read_pid, terminate
from .properties import log4j2_properties, ports_from_properties, server_properties
from .security import SECURITY_FILE, new_security, read_security
from .storage import storage_format

HEAP_OPTS = ("-Xms128m", "-Xmx512m")
SECURE_HEAP_OPTS = ("-Xms64m", "-Xmx256m")
"""A secured broker runs next to the session's plain one: a smaller heap keeps both within CI's memory."""


@dataclass(frozen=True)
class BrokerStatus:
    """What a state dir says about its broker, checked against the live process and port."""

    state_dir: Path
    pid: int | None
    running: bool
    answering: bool
    bootstrap: str | None

    def describe(self) -> str:
        """One line for humans, used by the ``status`` subcommand."""
        if self.running:
            health = "answering" if self.answering else "NOT answering"
            return f"running pid={self.pid} bootstrap={self.bootstrap} ({health}) state={self.state_dir}"
        return f"stopped state={self.state_dir}"


def status(state_dir: Path | None = None) -> BrokerStatus:
    """Inspect the state dir and the live process; never changes anything."""
    sd = state_dir or default_state_dir()
    pid = read_pid(sd)
    running = pid is not None and is_our_broker(pid, sd)
    bootstrap: str | None = None
    with contextlib.suppress(OSError):
        bootstrap = (sd / BOOTSTRAP_FILE).read_text().strip() or None
    # A secured listener does not answer a plaintext ApiVersions request; an open port must do.
    if read_security(sd) is not None:
        ok = running and bootstrap is not None and port_open(int(bootstrap.rsplit(":", 1)[1]))
    else:
        ok = running and bootstrap is not None and answers(bootstrap)
    return BrokerStatus(sd, pid if running else None, running, ok, bootstrap if running else None)


def start(
    state_dir: Path | None = None,
    *,
    reuse: bool = False,
    cache_dir: Path | None = None,
    timeout: float = START_TIMEOUT_S,
    owner_pid: int | None = None,
    secure: bool = False,
) -> str:
    """Start the broker and return its bootstrap ``127.0.0.1:PORT`` once it accepts connections.

    ``secure=True`` (for a fresh start) makes it the secured broker of the module docstring; a restart
    keeps whatever the state dir was.

    If a broker of this state dir is already running, its bootstrap is returned unchanged.
    ``reuse=True`` keeps the ports and data of the previous run (a restart); otherwise the data
    dir is wiped and new free ports are chosen. ``owner_pid`` marks a private state dir whose
    broker :func:`prune_orphans` may stop once that process is gone (e.g. a killed test run).
    """
    sd = (state_dir or default_state_dir()).resolve()
    with locked(sd):
        current = status(sd)
        if current.running and current.bootstrap:
            if not wait_port(current.bootstrap, current.pid, sd, timeout):
                raise BrokerError(f"broker pid {current.pid} runs but does not answer at {current.bootstrap}")
            return current.bootstrap
        libs = fetch(cache_dir, quiet=True)
        java = java_binary()
        props_path = sd / PROPERTIES_FILE
        if reuse and props_path.is_file() and (sd / DATA_DIR / "meta.properties").is_file():
            broker_port, controller_port = ports_from_properties(props_path)
        else:
            for name in (DATA_DIR, LOGS_DIR):
                shutil.rmtree(sd / name, ignore_errors=True)
            (sd / SECURITY_FILE).unlink(missing_ok=True)
            security = new_security(sd) if secure else None
            broker_port = free_port()
            controller_port = free_port(frozenset({broker_port}))
            props_path.write_text(server_properties(sd, broker_port, controller_port, security))
        (sd / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        (sd / LOG4J_FILE).write_text(log4j2_properties(sd))
        (sd / BOOTSTRAP_FILE).unlink(missing_ok=True)
        if not (sd / DATA_DIR / "meta.properties").is_file():
            storage_format(java, libs, sd)
        bootstrap = f"127.0.0.1:{broker_port}"
        cmd = [
            java,
            *(SECURE_HEAP_OPTS if read_security(sd) is not None else HEAP_OPTS),
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={sd / LOG4J_FILE}",
            f"-Dkafka.logs.dir={sd / LOGS_DIR}",
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(props_path),
        ]
        with open(sd / LOGS_DIR / STDOUT_LOG, "ab") as out:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=sd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise BrokerError(f"cannot run {java}: {exc}") from exc
        CHILDREN[proc.pid] = proc
        (sd / PID_FILE).write_text(f"{proc.pid}\n")
        if owner_pid is not None:
            (sd / OWNER_FILE).write_text(f"{owner_pid}\n")
        t0 = time.monotonic()
        if not wait_port(bootstrap, proc.pid, sd, timeout):
            waited = time.monotonic() - t0
            exit_code = proc.poll()
            terminate(proc.pid, sd, STOP_TIMEOUT_S)
            how = f"exited with {exit_code}" if exit_code is not None else "still running, not answering"
            raise BrokerError(
                f"broker did not become ready at {bootstrap} after {waited:.1f}s ({how})\n{tail_log(sd, 40)}"
            )
        (sd / BOOTSTRAP_FILE).write_text(bootstrap + "\n")
        return bootstrap


def stop(state_dir: Path | None = None, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop the broker of this state dir; returns True if one was running. Data and ports are kept."""
    sd = (state_dir or default_state_dir()).resolve()
    with locked(sd):
        pid = read_pid(sd)
        was_running = pid is not None and is_our_broker(pid, sd)
        if pid is not None:
            terminate(pid, sd, timeout)
        (sd / PID_FILE).unlink(missing_ok=True)
        (sd / BOOTSTRAP_FILE).unlink(missing_ok=True)
        return was_running


def prune_orphans(root: Path | None = None) -> list[Path]:
    """Stop and delete private broker dirs under root whose owner process has died.

    Test runs give each session its own broker in ``<root>/<name>/`` with an owner pid, so
    parallel runs never stop or restart each other's broker; this reclaims the ones a killed
    run left behind.
    """
    base = root or default_state_dir()
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    for child in sorted(base.iterdir()):
        owner_file = child / OWNER_FILE
        if not child.is_dir() or not owner_file.is_file():
            continue
        try:
            owner = int(owner_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid_alive(owner):
            continue
        stop(child)
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def restart(state_dir: Path | None = None, timeout: float = START_TIMEOUT_S) -> str:
    """Stop and start again on the same ports and data dir (used to test surviving a broker restart)."""
    sd = state_dir or default_state_dir()
    stop(sd)
    return start(sd, reuse=True, timeout=timeout)


def tail_log(state_dir: Path | None = None, lines: int = 50) -> str:
    """Last lines of the broker log (and the JVM's stdout if the log is empty, e.g. early crashes)."""
    sd = state_dir or default_state_dir()
    chunks: list[str] = []
    for path in (sd / LOGS_DIR / SERVER_LOG, sd / LOGS_DIR / STDOUT_LOG):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if text.strip():
            chunks.append(f"==> {path} <==\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(chunks) if chunks else f"(no broker logs in {sd / LOGS_DIR})"
