"""The file-store A/B command refuses what it cannot run before it starts a trial.

Its trials run each tree in a process of its own, so the test that runs them is in ``tests/process/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.file_store_ab import main


def test_a_baseline_that_is_not_a_checkout_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--baseline", str(tmp_path), "--trials", "1"]) == 2
    assert "holds no tokcap/" in capsys.readouterr().out
