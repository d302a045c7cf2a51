"""Where the broker tool keeps things: the jar cache, a broker's state dir and the files inside it.

A state dir is per checkout (or per test session), so two checkouts never share a broker by accident; the
jar cache is shared by every checkout, so the download happens once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path

KAFKA_VERSION = "4.1.1"

ENV_STATE_DIR = "TOKCAP_KAFKA_STATE_DIR"
ENV_CACHE_DIR = "TOKCAP_KAFKA_CACHE_DIR"
ENV_JAVA = "TOKCAP_KAFKA_JAVA"

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
"""The checkout this tool belongs to (``scripts/local_kafka/`` is two levels below it)."""
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0

PID_FILE = "broker.pid"
BOOTSTRAP_FILE = "bootstrap"
PROPERTIES_FILE = "server.properties"
LOG4J_FILE = "log4j2.properties"
DATA_DIR = "data"
LOGS_DIR = "logs"
SERVER_LOG = "server.log"
STDOUT_LOG = "stdout.log"
LOCK_FILE = ".lock"
OWNER_FILE = "owner.pid"


def default_cache_dir() -> Path:
    """Jar cache shared by every checkout, so the ~45 MB download happens once per machine."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "tokcap" / f"kafka-{KAFKA_VERSION}"


def default_state_dir() -> Path:
    """Per-checkout state (pid, ports, data, logs) so two checkouts never share a broker by accident."""
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(env).expanduser().resolve()
    return REPO_ROOT / ".kafka-broker"


def libs_dir(cache_dir: Path | None = None) -> Path:
    """Where the runtime jars live inside the cache."""
    return (cache_dir or default_cache_dir()) / "libs"


def log_file(state_dir: Path | None = None) -> Path:
    """The broker's main log file, shown by ``logs`` and by the pytest failure hook."""
    return (state_dir or default_state_dir()) / LOGS_DIR / SERVER_LOG
