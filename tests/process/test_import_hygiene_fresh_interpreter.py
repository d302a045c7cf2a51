"""Importing tokcap and every submodule in a fresh interpreter loads no server, transport or ML stack.

Model servers and trainers import tokcap; pulling in Kafka, FastAPI, Ray, Torch or aiohttp would make every
consumer pay for (and break on) stacks it does not use. Only a fresh interpreter shows what an import loads:
the test session has loaded them all already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from core_imports import FORBIDDEN_ROOTS

_PROBE = textwrap.dedent(
    """
    import importlib
    import json
    import pkgutil
    import sys

    import tokcap

    imported = ["tokcap"]
    for info in pkgutil.walk_packages(tokcap.__path__, prefix="tokcap."):
        importlib.import_module(info.name)
        imported.append(info.name)
    forbidden = set(json.loads(sys.argv[1]))
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in forbidden)
    print(json.dumps({"imported": imported, "forbidden_loaded": loaded}))
    """
)


def test_importing_tokcap_and_every_submodule_loads_no_forbidden_module() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(sorted(FORBIDDEN_ROOTS))],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert {"tokcap.config", "tokcap.protocols", "tokcap.log.records", "tokcap.files.store"} <= set(
        report["imported"]
    )
    assert report["forbidden_loaded"] == []
