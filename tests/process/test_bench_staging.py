"""``bench.staging`` writes the same bytes in the floor as tokcap stages, and its shapes are the ones it names.

No speed is checked.
"""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest

from bench.__main__ import main
from bench.staging import image_calls, moe_calls, run_floor, run_tokcap, run_tokcap_ledger_process
from tokcap.staging import FileStagingSource


def test_the_moe_shape_is_a_1k_token_delta_with_an_nrlre1_envelope_of_48_layers_top_8() -> None:
    (call,) = moe_calls(1, "t")
    envelope = call.record.extras["routed_experts"] if call.record.extras else ""
    magic, dtype, shape, data = envelope.split(":", 3)
    assert (magic, dtype, shape) == ("nrlre1", "int16", "1024x48x8")
    assert len(base64.b64decode(data)) == 1024 * 48 * 8 * 2 and call.record.delta_len == 1024
    (image,) = image_calls(1, "t")
    assert len(image.attachments["image"]) == 4 << 20


def test_the_floor_writes_the_bytes_tokcap_stages_and_tokcap_reads_them_back(tmp_path: Path) -> None:
    calls = [*moe_calls(2, "t"), *image_calls(1, "t")]
    (tmp_path / "floor").mkdir()
    floor = run_floor(tmp_path / "floor", "s", calls, 2)
    assert floor.size == sum(call.size for call in calls)
    written = sorted(path.read_bytes() for path in (tmp_path / "floor").iterdir())
    assert written == sorted(data for call in calls for data in call.raw)
    staged = run_tokcap(tmp_path / "tokcap", "s", calls, 2, with_ledger=True)
    assert staged.calls == 3 and len(staged.ledger) == 3
    assert len(staged.ledger_floor) == len(staged.ledger_append_floor) == 3
    assert all(
        0 < appended <= total
        for appended, total in zip(staged.ledger_append_floor, staged.ledger_floor, strict=True)
    )
    source = FileStagingSource(tmp_path / "tokcap")
    keys = [f"{call.record.rollout_id}/c0" for call in calls]
    assert [row.model_dump() for row in source.fetch_full(keys)] == [
        call.record.model_dump() for call in calls
    ]


_SMALL = ["--only", "staging", "--staging-calls", "2", "--staging-images", "1", "--staging-threads", "2"]


def test_the_scenario_prints_every_row_and_names_the_missing_kafka_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "latest.json"
    assert main([*_SMALL, "--trials", "1", "--dir", str(tmp_path / "work"), "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert out.count("tokcap FileStagingSink |") == 2 and out.count("+ ledger thread") == 2
    assert out.count("| file floor (write + fsync) |") == 2 and out.count("+ ledger process") == 2
    assert out.count("Ledger floor's append + fsync alone") == 4
    assert "not measured" in out and "64-call chain fetch" in out
    staging = orjson.loads(output.read_bytes())["staging"]
    assert set(staging["figures"]["moe"]) == {
        "floor",
        "tokcap",
        "tokcap_ledger_thread",
        "tokcap_ledger_process",
    }
    assert set(staging["ratios"]["image"]) == {"tokcap_vs_floor"}, "straw-queue and Kafka were not asked for"


def test_the_ledger_process_records_the_staged_calls_it_was_handed_and_does_their_floor(
    tmp_path: Path,
) -> None:
    calls = moe_calls(12, "p")
    measured = run_tokcap_ledger_process(tmp_path, "s", calls, 1)
    assert measured.calls == 12 and measured.name.endswith("+ ledger process")
    # It stops when the stagers do, so it may have recorded fewer than all; each one it timed has its floor.
    assert 0 < len(measured.ledger) == len(measured.ledger_floor) == len(measured.ledger_append_floor)
    recorded = FileStagingSource(tmp_path)
    for call in calls:
        assert recorded.fetch([f"{call.record.rollout_id}/c0"])[0].digest == call.record.digest
    ledger_files = sorted(tmp_path.glob("*.tokens.ledger"))
    assert len(ledger_files) == len(measured.ledger)
    assert len(list((tmp_path / "ledger-floor-process").glob("*.ledger"))) == len(measured.ledger)
