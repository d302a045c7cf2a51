"""Engine-side staging driven by Gym 0.7.0's own code over both tokcap transports, the file store and Kafka.

Gym's config accepts ``external_staging: true`` with tokcap's ledger; Gym's ``install_capture`` wires
tokcap's ``FileStagingSink`` into a worker with Gym's ``VLLMCaptureAdapter``; Gym's middleware resolves
each call's parent through tokcap's ledger (``resolve_parent``), Gym's vLLM worker capture handler
builds the ledger commits, Gym's manifest control route (its FastAPI router) serves tokcap's manifest,
and Gym's ``verify_and_linearize`` checks the rows fetched back through ``FileStagingSource``. The worker
itself is simulated as a framework writes it: it fetches a continuation's prefix through the source,
hands it to the adapter and Gym's capture, and "generates" fixed tokens. Over Kafka the same runs go through
``KafkaStagingSink``, ``KafkaStagingSource`` and ``KafkaLineageResolver`` on a real broker, on a topic made as
``tokcap topic create`` makes it, whose staged payloads lie on a topic of their own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from gym_wheel import GymModules, needs_gym_build_sink
from staged_layout import keys_staged_apart, read_staged_layout
from staging_calls import exact_log_prob

from tokcap.gym_package import gym_module
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource, finalize_rollout, receipt_from_manifest

pytestmark = needs_gym_build_sink


@dataclass
class _Transport:
    """How a test builds the staging sink, source and ledger of one transport; Kafka objects are closed after."""

    name: str
    sink: Callable[[], Any]
    source: Callable[[], Any]
    ledger: Callable[[], Any]
    lineage_store: str
    lineage_store_kwargs: dict[str, Any]
    made: list[Any] = field(default_factory=list)

    def kept(self, factory: Callable[[], Any]) -> Any:
        made = factory()
        self.made.append(made)
        return made

    def close(self) -> None:
        for made in self.made:
            closed = made.close() if hasattr(made, "close") else None
            if asyncio.iscoroutine(closed):
                asyncio.run(closed)


@pytest.fixture(params=["file", "kafka"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Transport]:
    if request.param == "file":
        chosen = _Transport(
            "file",
            lambda: FileStagingSink(tmp_path),
            lambda: FileStagingSource(tmp_path),
            lambda: FileLineageResolver(tmp_path),
            "tokcap.lineage:FileLineageResolver",
            {"root": str(tmp_path)},
        )
    else:
        from transports.kafka.lineage import KafkaLineageResolver
        from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

        factory = request.getfixturevalue("kafka_topic_factory")
        # A topic made as `tokcap topic create` makes it (staged payloads on a topic of their own), with
        # partitions enough that the nine rollouts of the busiest test land on several.
        bootstrap, topic = factory.bootstrap, factory.staged_apart(partitions=3)
        # The block every model server shares: no store_dir, each reader projects into a directory of its own.
        kwargs = {"bootstrap_servers": bootstrap, "topic": topic}
        chosen = _Transport(
            "kafka",
            lambda: chosen.kept(lambda: KafkaStagingSink(**kwargs)),
            lambda: chosen.kept(lambda: KafkaStagingSource(**kwargs)),
            lambda: chosen.kept(lambda: KafkaLineageResolver(**kwargs)),
            "transports.kafka.lineage:KafkaLineageResolver",
            dict(kwargs),
        )
    try:
        yield chosen
    finally:
        chosen.close()


def _staging(gym: GymModules) -> Any:
    return _module("staging")


def _module(name: str) -> Any:
    """Gym's module, found where tokcap finds it (Gym main's package path first)."""
    found = gym_module(name)
    assert found is not None, f"Gym's {name} module does not import"
    return found


def test_gyms_config_accepts_external_staging_with_tokcaps_ledger_and_the_classes_meet_gyms_protocols(
    gym: GymModules, transport: _Transport
) -> None:
    config = gym.config.TokenIdCaptureConfig.model_validate(
        {
            "token_id_capture": {
                "enabled": True,
                "external_staging": True,
                "rebuild_response": False,
                "lineage_store": transport.lineage_store,
                "lineage_store_kwargs": transport.lineage_store_kwargs,
            }
        }
    )
    ledger = transport.kept(config.build_lineage_store)
    assert type(ledger).__name__ == transport.lineage_store.rsplit(":", 1)[1]
    assert isinstance(ledger, gym.protocols.CaptureLedger)
    staging = _staging(gym)
    assert isinstance(transport.sink(), staging.StagingSink)
    assert isinstance(transport.source(), staging.StagingSource)


def _pixels(tokens: list[int]) -> bytes:
    """A stand-in media attachment derived from the generated tokens."""
    return b"".join(token.to_bytes(8, "big") for token in tokens) * 1024


class _Worker:
    """A vLLM worker as a framework writes it around Gym's capture: prefix from the source, stage, answer."""

    def __init__(self, gym: GymModules, transport: _Transport) -> None:
        staging = _staging(gym)
        self.host = staging.CaptureHost()
        self.adapter = _module("adapters.vllm").VLLMCaptureAdapter()
        self.capture = staging.install_capture(
            self.host, sink=transport.sink(), weight_version_fn=lambda: 5, adapter=self.adapter
        )
        self.source = transport.source()
        self.admission_class = staging.CaptureAdmission
        self.prefixes: list[list[int]] = []
        self.attachments: Any = None

    def serve(self, request: dict[str, Any], new_prompt: list[int], generated: list[int]) -> dict[str, Any]:
        admission = self.admission_class.model_validate(request["ng_capture"])
        prefix: list[int] = []
        if admission.mode == "token_in":
            for snapshot in self.source.fetch(list(admission.staging_chain)):
                prefix.extend(snapshot.token_ids_delta)
            self.prefixes.append(prefix)
        call = self.capture.begin_call(
            admission, prefix_token_ids=prefix if admission.mode == "token_in" else None
        )
        self.adapter.enter_prefix(request, prefix)
        response = {
            "id": f"chatcmpl-{admission.model_call_id}",
            "object": "chat.completion",
            "model": "policy",
            "prompt_token_ids": prefix + new_prompt,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {
                        "role": "assistant",
                        "content": f"answer of {admission.model_call_id}",
                        "generation_token_ids": generated,
                        "generation_log_probs": [exact_log_prob(token) for token in generated],
                    },
                }
            ],
        }
        attachments = self.attachments if self.attachments is not None else {"pixels": _pixels(generated)}
        coords = self.capture.complete_call_from_response(call, response, attachments=attachments)
        response["ng_commit_coords"] = coords.model_dump(mode="json")
        return response


async def _one_call(
    gym: GymModules,
    worker: _Worker,
    ledger: Any,
    rollout_id: str,
    call_id: str,
    request_items: list[dict[str, Any]],
    new_prompt: list[int],
    generated: list[int],
) -> list[dict[str, Any]]:
    """One call through Gym's middleware and handler; returns the output items the harness echoes next."""
    sink = gym.sink
    handler = _module("external_capture").VLLMWorkerCaptureHandler()
    context = sink.CaptureContext(
        rollout_id=rollout_id,
        model_call_id=call_id,
        token_sink=None,
        lineage_store=ledger,
        external_staging=True,
        admitted_at=1_700_000_000.0,
    )
    token = sink.set_token_sink(context)
    try:
        await sink.resolve_parent(request_items)
        request = handler.prepare_request({"model": "policy", "messages": request_items})
        response = await asyncio.to_thread(worker.serve, request, new_prompt, generated)
        handler.prepare_response(response)
        assert "ng_commit_coords" not in response and "prompt_token_ids" not in response
        await handler.finalize_response(response)
        assert context.committed, "Gym did not mark the call committed: the ledger row was not recorded"
        items, _ = gym.records.strip_token_fields(gym.records.response_to_output_items(response))
        return list(items)
    finally:
        sink.reset_token_sink(token)


async def _rollout(
    gym: GymModules, worker: _Worker, ledger: Any, rollout_id: str, base: int, turns: int
) -> list[int]:
    """A text root and token-in continuations; returns the expected linearized tokens."""
    history: list[dict[str, Any]] = []
    tokens: list[int] = []
    for number in range(turns):
        history = [*history, {"role": "user", "content": f"{rollout_id} turn {number}"}]
        new_prompt = [base + 10 * number + offset for offset in range(3 if number == 0 else 2)]
        generated = [base + 10 * number + 5, base + 10 * number + 6]
        output = await _one_call(
            gym, worker, ledger, rollout_id, f"call-{number}", history, new_prompt, generated
        )
        history = [*history, *output]
        tokens += new_prompt + generated
    return tokens


async def _asgi_get(app: Any, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    """One GET through the ASGI app, without an HTTP client."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(key.lower().encode(), value.encode()) for key, value in headers.items()],
        "server": ("test", 80),
        "client": ("test", 1),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return status, orjson.loads(body)


def test_a_three_call_rollout_staged_beside_eight_threads_verifies_exactly_through_gyms_code(
    gym: GymModules, transport: _Transport
) -> None:
    worker = _Worker(gym, transport)
    ledger = transport.ledger()
    staging = _staging(gym)
    errors: list[BaseException] = []
    others: dict[str, list[int]] = {}

    def other_rollout(number: int) -> None:
        try:
            rollout_id = f"other-{number}"
            others[rollout_id] = asyncio.run(
                _rollout(gym, worker, transport.ledger(), rollout_id, 10_000 * (number + 1), 3)
            )
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=other_rollout, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    expected = asyncio.run(_rollout(gym, worker, ledger, "main", 100, 3))
    for thread in threads:
        thread.join()
    assert errors == []
    assert worker.prefixes and all(prefix for prefix in worker.prefixes)

    source = transport.source()
    staged_keys: set[str] = set()
    for rollout_id, tokens in [("main", expected), *others.items()]:
        manifest = _module("staging.records").RolloutManifest.model_validate(
            asyncio.run(ledger.manifest(rollout_id))
        )
        assert manifest.failures == []
        selection = staging.select_terminal_call(manifest.records)
        receipt = staging.RolloutReceipt(
            rollout_id=rollout_id,
            manifest=manifest.records,
            terminal_model_call_id=selection.terminal_model_call_id,
            terminal_selection="heuristic",
        )
        snapshots = source.fetch([record.staging_key for record in manifest.records])
        staged_keys.update(record.staging_key for record in manifest.records)
        row = staging.verify_and_linearize(receipt, snapshots)
        assert row.token_ids == tokens
        assert row.model_call_ids == ["call-0", "call-1", "call-2"]
        masks = [0.0] * 3 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2 + [0.0] * 2 + [1.0] * 2
        assert row.token_mask == masks
        assert row.logprobs == [
            exact_log_prob(t) if m == 1.0 else 0.0 for t, m in zip(tokens, masks, strict=True)
        ]
        ours = receipt_from_manifest(asyncio.run(ledger.manifest(rollout_id)))
        assert ours.terminal_model_call_id == receipt.terminal_model_call_id
        last = manifest.records[-1].staging_key
        assert source.fetch_attachments(last) == {"pixels": _pixels(tokens[-2:])}
    if transport.name == "kafka":
        where = transport.lineage_store_kwargs
        assert keys_staged_apart(where["bootstrap_servers"], where["topic"]) == staged_keys
        layout = read_staged_layout(where["bootstrap_servers"], where["topic"])
        assert len({reference.partition for reference in layout.references}) > 1


def test_gyms_manifest_control_route_serves_tokcaps_manifest_behind_its_bearer_token(
    gym: GymModules, transport: _Transport
) -> None:
    fastapi = pytest.importorskip("fastapi", reason="the test extra installs fastapi for Gym's control route")
    worker, ledger = _Worker(gym, transport), transport.ledger()
    asyncio.run(_rollout(gym, worker, ledger, "main", 100, 2))
    asyncio.run(ledger.record_failure("main", "call-lost", "worker_capture_failed"))
    app = fastapi.FastAPI()
    _module("control_routes").install_rollout_control_routes(app, ledger, auth_token="secret")
    route = "/training-token-capture/control/rollouts/main/manifest"
    status, served = asyncio.run(_asgi_get(app, route, {"Authorization": "Bearer secret"}))
    assert status == 200 and served == asyncio.run(ledger.manifest("main"))
    manifest = _module("staging.records").RolloutManifest.model_validate(served)
    assert [record.model_call_id for record in manifest.records] == ["call-0", "call-1"]
    assert [failure.reason for failure in manifest.failures] == ["worker_capture_failed"]
    assert asyncio.run(_asgi_get(app, route, {"Authorization": "Bearer wrong"}))[0] == 401


def test_a_stage_the_sink_refuses_poisons_the_rollout_through_gyms_handler_and_finalize_masks_it(
    gym: GymModules, transport: _Transport
) -> None:
    worker, ledger = _Worker(gym, transport), transport.ledger()
    asyncio.run(_rollout(gym, worker, ledger, "main", 100, 1))
    worker.attachments = {"tensor": [1, 2, 3]}  # not bytes: the sink refuses, Gym answers capture_failed
    history = [{"role": "user", "content": "main turn 0"}]
    with pytest.raises(AssertionError, match="not mark the call committed"):
        asyncio.run(_one_call(gym, worker, ledger, "main", "call-1", history, [7], [8, 9]))
    manifest = asyncio.run(ledger.manifest("main"))
    assert [(f["model_call_id"], f["reason"]) for f in manifest["failures"]] == [
        ("call-1", "worker_capture_failed")
    ]
    done = finalize_rollout(manifest, transport.source())
    assert done.masked and "worker_capture_failed" in (done.masked_reason or "")
