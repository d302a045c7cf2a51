"""tokcap's Prometheus metrics: names and labels in Prometheus style, and the calls that move them.

The instrumented objects are the real ones (file store, staging sink, router); values are read back from
``tokcap.metrics.REGISTRY``, and the HTTP server is scraped over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from factories import make_entry
from prometheus_client.parser import text_string_to_metric_families
from staging_calls import staged_call

from tokcap.cli.metrics_http import Health, MetricsServer
from tokcap.errors import ConflictingEntryError
from tokcap.files.store import TokenCaptureStore
from tokcap.metrics import (
    BLOCK_KINDS,
    COMMAND_KINDS,
    DEAD_LETTER_KINDS,
    HTTP_DROP_KINDS,
    MASK_KINDS,
    REGISTRY,
)
from tokcap.staging import FileStagingSink
from transports.kafka.materializer.loop_metrics import dead_letter_kind
from transports.kafka.wire.codec import (
    HEADER_CHUNK_COUNT,
    HEADER_CHUNK_DIGEST,
    HEADER_CHUNK_GROUP,
    HEADER_CHUNK_INDEX,
    HEADER_TYPE,
)
from transports.kafka.wire.router import DeadLetter, InboundRouter, LogMessage

_ALLOWED_LABELS = {"transport", "operation", "kind", "type", "reason", "topic", "partition"}


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_every_family_is_named_and_labelled_in_prometheus_style_with_no_per_rollout_label() -> None:
    families = list(REGISTRY.collect())
    assert families, "the registry holds no family"
    for family in families:
        assert family.name.startswith("tokcap_"), family.name
        if family.type == "counter":
            assert not family.name.endswith("_total"), f"{family.name}: the client adds _total"
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= _ALLOWED_LABELS, (family.name, sample.labels)
    names = {family.name for family in families}
    for expected in (
        "tokcap_sink_operation_seconds",
        "tokcap_sink_failures",
        "tokcap_sink_sent_bytes",
        "tokcap_sink_markers_spilled",
        "tokcap_sink_markers_forwarded",
        "tokcap_source_operation_seconds",
        "tokcap_materializer_events_applied",
        "tokcap_materializer_dead_letters",
        "tokcap_materializer_rollouts_masked",
        "tokcap_materializer_freeze_seconds",
        "tokcap_materializer_command_wait_seconds",
        "tokcap_materializer_command_read_delay_seconds",
        "tokcap_materializer_flush_seconds",
        "tokcap_metrics_http_dropped",
        "tokcap_materializer_lag_messages",
        "tokcap_materializer_lag_seconds",
        "tokcap_materializer_checkpoint_age_seconds",
        "tokcap_materializer_owned_partitions",
        "tokcap_materializer_hot_state",
    ):
        assert expected in names


def test_reason_kinds_are_exported_at_zero_before_anything_happens() -> None:
    for kind in DEAD_LETTER_KINDS:
        assert (
            REGISTRY.get_sample_value("tokcap_materializer_dead_letters_total", {"reason": kind}) is not None
        )
    for kind in MASK_KINDS:
        assert (
            REGISTRY.get_sample_value("tokcap_materializer_rollouts_masked_total", {"reason": kind})
            is not None
        )
    for kind in HTTP_DROP_KINDS:
        assert REGISTRY.get_sample_value("tokcap_metrics_http_dropped_total", {"reason": kind}) is not None
    for kind in COMMAND_KINDS:
        assert (
            REGISTRY.get_sample_value("tokcap_materializer_command_wait_seconds_count", {"type": kind})
            is not None
        )
        assert (
            REGISTRY.get_sample_value("tokcap_materializer_command_read_delay_seconds_count", {"type": kind})
            is not None
        )
    for kind in BLOCK_KINDS:
        assert (
            REGISTRY.get_sample_value("tokcap_materializer_flush_seconds_count", {"kind": kind}) is not None
        )


def test_a_file_store_put_intent_mark_and_freeze_each_observe_their_latency(tmp_path: Path) -> None:
    labels = {"transport": "file"}
    before = {
        op: _value("tokcap_sink_operation_seconds_count", operation=op, **labels)
        for op in ("put", "intent", "mark")
    }
    freezes = _value("tokcap_source_operation_seconds_count", operation="freeze", **labels)

    async def run() -> None:
        store = TokenCaptureStore(tmp_path)
        await store.begin_call("r-metrics", "c1")
        await store.put(make_entry("r-metrics", "c1"))
        await store.mark_incomplete("r-metrics", "c2", "lost")
        await store.freeze("r-metrics")
        await store.close()

    asyncio.run(run())
    for op, count in before.items():
        assert _value("tokcap_sink_operation_seconds_count", operation=op, **labels) == count + 1, op
    assert _value("tokcap_source_operation_seconds_count", operation="freeze", **labels) == freezes + 1
    assert _value("tokcap_sink_operation_seconds_sum", operation="put", **labels) > 0


def test_a_put_that_raises_counts_one_failure_of_its_error_class(tmp_path: Path) -> None:
    failures = {"transport": "file", "operation": "put", "kind": "ConflictingEntryError"}
    before = _value("tokcap_sink_failures_total", **failures)

    async def run() -> None:
        store = TokenCaptureStore(tmp_path)
        await store.put(make_entry("r-conflict", "c1", generation=(4, 5)))
        with pytest.raises(ConflictingEntryError):
            await store.put(make_entry("r-conflict", "c1", generation=(4, 6)))
        await store.close()

    asyncio.run(run())
    assert _value("tokcap_sink_failures_total", **failures) == before + 1


def test_a_stage_observes_its_latency_and_a_refused_stage_counts_a_conflict(tmp_path: Path) -> None:
    labels = {"transport": "file", "operation": "stage"}
    staged = _value("tokcap_sink_operation_seconds_count", **labels)
    conflicts = _value("tokcap_sink_failures_total", kind="conflict", **labels)
    sink = FileStagingSink(tmp_path)
    assert sink.stage(staged_call("r-stage", "c1", [1, 2], [3])).ok
    assert not sink.stage(staged_call("r-stage", "c1", [1, 2], [4])).ok
    assert _value("tokcap_sink_operation_seconds_count", **labels) == staged + 2
    assert _value("tokcap_sink_failures_total", kind="conflict", **labels) == conflicts + 1


def _message(offset: int, headers: tuple[tuple[str, bytes | None], ...]) -> LogMessage:
    return LogMessage(0, offset, None, b"rollout-dl", headers, b"{}")


def test_dead_letters_of_the_router_get_a_kind_from_the_fixed_list() -> None:
    router = InboundRouter()
    undecodable = router.route(_message(0, ((HEADER_TYPE, b"put"),)))
    chunk = ((HEADER_CHUNK_GROUP, b"g"), (HEADER_CHUNK_INDEX, b"1"), (HEADER_CHUNK_COUNT, b"2"))
    orphan = router.route(_message(1, (*chunk, (HEADER_CHUNK_DIGEST, b"0" * 64))))
    kinds = [dead_letter_kind(d) for d in [*undecodable, *orphan] if isinstance(d, DeadLetter)]
    assert kinds == ["undecodable", "orphaned_chunk"]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())


def test_the_server_exposes_the_registry_and_answers_healthz_as_its_check_says() -> None:
    health = [Health(False, "starting")]
    server = MetricsServer(lambda: health[0], port=0).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, body = _get(base + "/metrics")
        assert status == 200
        names = {family.name for family in text_string_to_metric_families(body.decode())}
        assert "tokcap_sink_operation_seconds" in names
        status, body = _get(base + "/healthz")
        assert (status, json.loads(body)) == (503, {"healthy": False, "reason": "starting"})
        health[0] = Health(True, "applying")
        status, body = _get(base + "/healthz")
        assert (status, json.loads(body)["healthy"]) == (200, True)
        assert _get(base + "/other")[0] == 404
    finally:
        server.close()


def test_the_registry_mounted_in_a_fastapi_app_serves_tokcap_families() -> None:
    fastapi = pytest.importorskip("fastapi")
    from prometheus_client import make_asgi_app

    app = fastapi.FastAPI()
    app.mount("/metrics", make_asgi_app(REGISTRY))
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/metrics/",
        "raw_path": b"/metrics/",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 200
    body = b"".join(message.get("body", b"") for message in sent[1:])
    names = {family.name for family in text_string_to_metric_families(body.decode())}
    assert {"tokcap_sink_operation_seconds", "tokcap_materializer_lag_messages"} <= names
