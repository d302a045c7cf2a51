"""The README's sink-and-source example runs as written against a real broker and prints what it says."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import uuid
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    """The README's first Python block, without its last line (which runs it against localhost:9092)."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README.md has no python example"
    lines = block.group(1).rstrip().splitlines()
    assert lines[-1].startswith("asyncio.run(main("), lines[-1]
    return "\n".join(lines[:-1])


def test_the_readme_example_delivers_its_call_unmasked_over_kafka(kafka_bootstrap: str) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(_example(), str(README), "exec"), namespace)
    run = f"readme-{uuid.uuid4().hex[:8]}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        asyncio.run(namespace["main"](kafka_bootstrap, run))
    assert printed.getvalue().strip() == "False [4, 5]"
