"""A local Kafka broker for a benchmark run, started and stopped through ``scripts/kafka-broker``.

The broker gets its own state directory, so a benchmark never stops a broker that tests are using.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BrokerStartError", "local_broker"]

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kafka-broker"


class BrokerStartError(RuntimeError):
    """The local broker did not start; pass ``--bootstrap`` to use a running one instead."""


@contextmanager
def local_broker(state_dir: Path) -> Iterator[str]:
    """Start a fresh broker in ``state_dir``, yield its bootstrap address, and stop it afterwards."""
    command = [str(_SCRIPT), "--state-dir", str(state_dir)]
    started = subprocess.run([*command, "start"], capture_output=True, text=True, check=False)
    if started.returncode != 0 or not started.stdout.strip():
        raise BrokerStartError(
            f"scripts/kafka-broker start failed (exit {started.returncode}): {started.stderr.strip()[-2000:]}; "
            "pass --bootstrap HOST:PORT to benchmark against a running broker"
        )
    try:
        yield started.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([*command, "stop"], capture_output=True, text=True, check=False)
