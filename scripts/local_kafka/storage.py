"""A broker's KRaft data dir: its cluster id and its formatting, once, before the first start."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

from .errors import BrokerError
from .layout import LOG4J_FILE, PROPERTIES_FILE
from .security import SCRAM_MECHANISM, read_security


def new_cluster_id() -> str:
    """KRaft cluster id: 16 random bytes, base64url without padding; avoids a JVM launch for random-uuid."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).decode("ascii").rstrip("=")
        if not cid.startswith("-"):
            return cid


def storage_format(java: str, libs: Path, state_dir: Path, cluster_id: str | None = None) -> None:
    """Format the KRaft data dir once; a formatted dir is kept across restarts.

    A secured broker's SCRAM users are written into the metadata here, so the broker can log in to itself.
    """
    security = read_security(state_dir)
    scram: list[str] = []
    if security is not None:
        users = security["users"]
        assert isinstance(users, dict)
        for name, password in users.items():
            scram += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
    cmd = [
        java,
        "-Xmx256m",
        f"-Dlog4j2.configurationFile={state_dir / LOG4J_FILE}",
        "-cp",
        f"{libs}/*",
        "kafka.tools.StorageTool",
        "format",
        "--ignore-formatted",
        "-t",
        cluster_id or new_cluster_id(),
        "-c",
        str(state_dir / PROPERTIES_FILE),
        *scram,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BrokerError(f"cannot run {java}: {exc}") from exc
    if proc.returncode != 0:
        raise BrokerError(
            f"kafka StorageTool format failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )
