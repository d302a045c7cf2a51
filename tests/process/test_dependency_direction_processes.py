"""The dependency arrows a fresh interpreter shows: without the Kafka client, the transports or typer, the core
commands still run and each missing part is named; importing the library loads no command-line package.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import tokcap

_ROOT = Path(tokcap.__file__).resolve().parent.parent


def _tokcap(args: list[str], blocked: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the ``tokcap`` command in a fresh interpreter in which the ``blocked`` modules cannot be imported."""
    script = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "from tokcap.cli import run\n"
        f"sys.exit(run({args!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120, cwd=cwd
    )


def test_without_the_kafka_client_inspect_runs_and_a_kafka_command_names_the_extra(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    inspected = _tokcap(["inspect", str(store), "--json"], ["confluent_kafka"], tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert '"kafka_checkpoints": {}' in inspected.stdout
    refused = _tokcap(
        ["topic", "describe", "--bootstrap", "127.0.0.1:1", "--run", "r"], ["confluent_kafka"], tmp_path
    )
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1
    assert "pip install 'tokcap[kafka]'" in refused.stderr


def test_without_the_transports_package_the_core_commands_run_and_demo_over_kafka_names_the_extra(
    tmp_path: Path,
) -> None:
    blocked = ["transports", "confluent_kafka"]
    demo = _tokcap(["demo", "--rollouts", "5", "--turns", "2", "--json"], blocked, tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert '"transport": "file"' in demo.stdout
    over_kafka = _tokcap(["demo", "--bootstrap", "127.0.0.1:1"], blocked, tmp_path)
    assert over_kafka.returncode == 1
    assert over_kafka.stderr.count("\n") == 1
    assert "--bootstrap runs over Kafka" in over_kafka.stderr
    assert "pip install 'tokcap[kafka]'" in over_kafka.stderr


def test_without_typer_the_console_script_names_the_cli_extra_in_one_line(tmp_path: Path) -> None:
    completed = _tokcap(["--help"], ["typer"], tmp_path)
    assert completed.returncode == 1
    assert completed.stderr.count("\n") == 1
    assert completed.stderr.startswith("tokcap: error: the tokcap command needs typer")
    assert "pip install 'tokcap[cli]'" in completed.stderr


_LIBRARY_PROBE = textwrap.dedent(
    """
    import importlib
    import json
    import pkgutil
    import sys

    import tokcap

    for info in pkgutil.walk_packages(tokcap.__path__, prefix="tokcap."):
        if not info.name.startswith("tokcap.cli"):
            importlib.import_module(info.name)
    print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in {"typer", "rich", "click"})))
    """
)


def test_importing_every_library_module_loads_no_typer_rich_or_click() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _LIBRARY_PROBE], capture_output=True, text=True, check=False, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"
