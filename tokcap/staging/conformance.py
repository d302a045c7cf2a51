"""A behavioural conformance kit for engine-side staging: ``StagingSink``, ``StagingSource``, ``CaptureLedger``.

Gym 0.7.0 ships one golden digest vector for staging and no behavioural checks; this kit is what a
framework runs against its own implementation (or tokcap's) before trusting it with a training run::

    passed = asyncio.run(run_staging_conformance(
        lambda: MySink(...), lambda: MySource(...), lambda: MyLedger(...)))

Each check builds fresh objects from the factories (a key must be fetchable by a source that did not
exist when it was staged), uses rollout ids of its own, and raises ``StagingConformanceError`` naming the
check and what was wrong. The records handed to the sink and ledger are Gym's classes when ``nemo_gym``
imports, tokcap's otherwise. Objects with a ``close`` method are closed at the end.
"""

from __future__ import annotations

import inspect
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from tokcap.log.records import ParentResolutionStatus
from tokcap.staging.example_calls import ExampleCall, commit_of, staged_record
from tokcap.staging.finalize import receipt_from_manifest
from tokcap.staging.gym_types import build
from tokcap.staging.records import RolloutManifest, staging_key
from tokcap.staging.verify import verify_and_linearize

__all__ = ["StagingConformanceError", "run_staging_conformance"]


class StagingConformanceError(AssertionError):
    """A staging implementation broke the contract; the message names the check."""


def _rollout(rollout_id: str, turns: int, *, extras: bool = False) -> list[ExampleCall]:
    calls: list[ExampleCall] = []
    history: list[dict[str, Any]] = []
    for number in range(turns):
        history = [*history, {"role": "user", "content": f"{rollout_id} asks {number}"}]
        parent = calls[-1] if calls else None
        prompt = [1000 + number * 10 + offset for offset in range(3 if parent is None else 2)]
        generated = [1005 + number * 10, 2**63 + number]
        payload = {"routed_experts": [[number, 2], [3.0, 4]], "count": number, "ok": True} if extras else None
        record, tokens = staged_record(rollout_id, f"call-{number}", prompt, generated, parent, payload)
        call = ExampleCall(record, tokens, list(history), f"{rollout_id} answer {number}")
        calls.append(call)
        history = [*history, *call.response]
    return calls


def _check(condition: bool, check: str, what: str) -> None:
    if not condition:
        raise StagingConformanceError(f"{check}: {what}")


def _stage_ok(sink: Any, call: ExampleCall, check: str, attachments: dict[str, bytes] | None = None) -> None:
    result = (
        sink.stage(call.record) if attachments is None else sink.stage(call.record, attachments=attachments)
    )
    _check(
        getattr(result, "ok", False) is True and getattr(result, "staging_key", None) == call.key,
        check,
        f"stage({call.key}) answered {result!r}, expected ok with staging_key {call.key!r}",
    )


async def run_staging_conformance(
    sink_factory: Callable[[], Any],
    source_factory: Callable[[], Any],
    ledger_factory: Callable[[], Any],
    *,
    rollout_prefix: str = "staging-conformance",
) -> list[str]:
    """Run every check in order; return the names that passed, or raise on the first failure."""
    made: list[Any] = []

    def fresh(factory: Callable[[], Any]) -> Any:
        instance = factory()
        made.append(instance)
        return instance

    run = f"{rollout_prefix}-{uuid.uuid4().hex[:8]}"
    checks: list[tuple[str, Callable[[str], Awaitable[None]]]] = [
        (
            "stage_then_fetch_by_a_fresh_source",
            lambda r: _fetch_exact(r, fresh, sink_factory, source_factory),
        ),
        (
            "extras_and_attachments_come_back_exactly",
            lambda r: _blobs(r, fresh, sink_factory, source_factory),
        ),
        ("repeat_is_ok_and_conflict_is_refused", lambda r: _repeat(r, fresh, sink_factory, source_factory)),
        (
            "fetch_keeps_order_and_missing_keys_raise",
            lambda r: _order(r, fresh, sink_factory, source_factory),
        ),
        ("concurrent_stages_lose_nothing", lambda r: _threads(r, fresh, sink_factory, source_factory)),
        ("ledger_records_once_and_refuses_changes", lambda r: _ledger_once(r, fresh, ledger_factory)),
        ("ledger_failures_poison_the_manifest", lambda r: _failures(r, fresh, ledger_factory)),
        ("ledger_resolves_parents_by_fingerprint", lambda r: _resolve(r, fresh, ledger_factory)),
        (
            "a_staged_rollout_verifies_end_to_end",
            lambda r: _end_to_end(r, fresh, sink_factory, source_factory, ledger_factory),
        ),
    ]
    passed: list[str] = []
    try:
        for name, check in checks:
            try:
                await check(f"{run}-{len(passed)}")
            except StagingConformanceError:
                raise
            except Exception as exc:
                raise StagingConformanceError(f"{name}: raised {type(exc).__name__}: {exc}") from exc
            passed.append(name)
    finally:
        for instance in made:
            close = getattr(instance, "close", None)
            if callable(close):
                result = close()
                if inspect.isawaitable(result):
                    await result
    return passed


_Fresh = Callable[[Callable[[], Any]], Any]


async def _fetch_exact(
    rollout: str, fresh: _Fresh, sinks: Callable[[], Any], sources: Callable[[], Any]
) -> None:
    check = "stage_then_fetch_by_a_fresh_source"
    [call] = _rollout(rollout, 1)
    _stage_ok(fresh(sinks), call, check)
    [snapshot] = fresh(sources).fetch([call.key])
    _check(
        type(snapshot).__name__ == "StagedCallBaseSnapshot", check, f"fetch gave a {type(snapshot).__name__}"
    )
    _check(not hasattr(snapshot, "extras"), check, "fetch returned extras; base snapshots carry none")
    expected = call.record.model_dump(exclude={"extras"})
    _check(snapshot.model_dump() == expected, check, "the fetched row differs from the staged record")
    exact = [value.hex() for value in snapshot.generation_log_probs_delta] == [
        value.hex() for value in call.record.generation_log_probs_delta
    ]
    _check(exact, check, "log probs did not come back as the exact float64 values staged")


async def _blobs(rollout: str, fresh: _Fresh, sinks: Callable[[], Any], sources: Callable[[], Any]) -> None:
    check = "extras_and_attachments_come_back_exactly"
    plain, rich = _rollout(rollout, 1)[0], _rollout(rollout + "-x", 1, extras=True)[0]
    big = os.urandom(3 * 1024 * 1024)
    sink = fresh(sinks)
    _stage_ok(sink, plain, check)
    _stage_ok(sink, rich, check, {"empty": b"", "image": big})
    source = fresh(sources)
    [full] = source.fetch_full([rich.key])
    _check(type(full).__name__ == "StagedCallSnapshot", check, f"fetch_full gave a {type(full).__name__}")
    same = orjson.dumps(full.extras) == orjson.dumps(rich.record.extras) and full.extras == rich.record.extras
    _check(same, check, f"extras came back as {full.extras!r}, staged {rich.record.extras!r}")
    _check(source.fetch_attachments(rich.key) == {"empty": b"", "image": big}, check, "attachments differ")
    _check(source.fetch_attachments(plain.key) == {}, check, "a call staged without attachments must give {}")


async def _repeat(rollout: str, fresh: _Fresh, sinks: Callable[[], Any], sources: Callable[[], Any]) -> None:
    check = "repeat_is_ok_and_conflict_is_refused"
    [call] = _rollout(rollout, 1)
    [other] = _rollout(rollout, 1, extras=True)
    _stage_ok(fresh(sinks), call, check)
    _stage_ok(fresh(sinks), call, check)
    try:
        refused = not fresh(sinks).stage(other.record).ok
    except Exception:
        refused = True
    _check(refused, check, "a different payload under a staged key was acknowledged")
    _check(
        fresh(sources).fetch([call.key])[0].digest == call.record.digest, check, "the first row must stand"
    )


async def _order(rollout: str, fresh: _Fresh, sinks: Callable[[], Any], sources: Callable[[], Any]) -> None:
    check = "fetch_keeps_order_and_missing_keys_raise"
    calls = _rollout(rollout, 3) + _rollout(rollout + "-b", 2)
    sink = fresh(sinks)
    for call in calls:
        _stage_ok(sink, call, check)
    keys = [calls[4].key, calls[0].key, calls[2].key, calls[4].key]
    got = [staging_key(s.rollout_id, s.model_call_id) for s in fresh(sources).fetch(keys)]
    _check(got == keys, check, f"fetch({keys}) answered keys {got}")
    try:
        fresh(sources).fetch([calls[0].key, f"{rollout}/never-staged"])
    except Exception:
        return
    raise StagingConformanceError(f"{check}: fetching a key never staged did not raise")


async def _threads(rollout: str, fresh: _Fresh, sinks: Callable[[], Any], sources: Callable[[], Any]) -> None:
    check = "concurrent_stages_lose_nothing"
    sink = fresh(sinks)
    rollouts = [_rollout(f"{rollout}-t{n}", 4, extras=bool(n % 2)) for n in range(8)]
    failures: list[str] = []

    def stage_all(calls: list[ExampleCall]) -> None:
        for call in calls:
            try:
                _stage_ok(sink, call, check, {"a": call.record.digest.encode()})
            except Exception as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=stage_all, args=(calls,)) for calls in rollouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _check(not failures, check, "; ".join(failures[:3]))
    source = fresh(sources)
    for calls in rollouts:
        fetched = source.fetch_full([call.key for call in calls])
        staged = [call.record.model_dump() for call in calls]
        _check(
            [s.model_dump() for s in fetched] == staged,
            check,
            "a row staged from a thread came back different",
        )


async def _ledger_once(rollout: str, fresh: _Fresh, ledgers: Callable[[], Any]) -> None:
    check = "ledger_records_once_and_refuses_changes"
    [call] = _rollout(rollout, 1)
    commit = commit_of(call, [])
    await fresh(ledgers).record(commit)
    await fresh(ledgers).record(commit)
    changed = commit_of(call, [])
    changed.request_items.append({"role": "user", "content": "an item the first commit did not have"})
    try:
        await fresh(ledgers).record(changed)
    except Exception:
        pass
    else:
        raise StagingConformanceError(f"{check}: a commit with different request_items was accepted")
    manifest = RolloutManifest.model_validate(await fresh(ledgers).manifest(rollout))
    _check([r.model_call_id for r in manifest.records] == ["call-0"], check, "the manifest must hold one row")


async def _failures(rollout: str, fresh: _Fresh, ledgers: Callable[[], Any]) -> None:
    check = "ledger_failures_poison_the_manifest"
    ledger = fresh(ledgers)
    _check(await ledger.has_rows(rollout) is False, check, "has_rows is true for a rollout without rows")
    await ledger.record_failure(rollout, "call-9", "worker_capture_failed")
    await fresh(ledgers).record_failure(rollout, "call-9", "worker_capture_failed")
    _check(await fresh(ledgers).has_rows(rollout) is True, check, "has_rows must count failure rows")
    raw = await fresh(ledgers).manifest(rollout)
    _check(orjson.loads(orjson.dumps(raw)) == raw, check, "the manifest is not plain JSON")
    manifest = RolloutManifest.model_validate(raw)
    reasons = [(f.model_call_id, f.reason) for f in manifest.failures]
    _check(reasons == [("call-9", "worker_capture_failed")], check, f"failures are {reasons}")
    _check(receipt_from_manifest(raw).capture_poisoned, check, "a failure row must poison the receipt")
    shared = getattr(ledger, "is_process_shared", None)
    _check(shared is None or shared() is True, check, "a staging ledger must be process-shared")


async def _resolve(rollout: str, fresh: _Fresh, ledgers: Callable[[], Any]) -> None:
    check = "ledger_resolves_parents_by_fingerprint"
    calls = _rollout(rollout, 2)
    ledger = fresh(ledgers)
    await ledger.record(commit_of(calls[0], []))
    await ledger.record(commit_of(calls[1], [calls[0].key]))
    await ledger.record_failure(rollout, "call-failed", "worker_capture_failed")
    parent = calls[1]
    request = [*parent.request, *parent.response, {"role": "user", "content": "go on"}]
    resolution = await fresh(ledgers).resolve(rollout, request)
    match = resolution.match
    _check(
        resolution.status == ParentResolutionStatus.RESOLVED and match is not None,
        check,
        f"a request continuing {parent.key} resolved {resolution.status}",
    )
    _check(match.model_call_id == "call-1", check, f"resolved {match.model_call_id}, expected call-1")
    _check(
        tuple(match.staging_chain) == (calls[0].key, parent.key),
        check,
        f"staging_chain {match.staging_chain}",
    )
    _check(match.prev_len == parent.record.cum_len, check, f"prev_len {match.prev_len}")
    _check(match.chain_hash == parent.record.chain_hash, check, "chain_hash differs from the parent's")


async def _end_to_end(
    rollout: str,
    fresh: _Fresh,
    sinks: Callable[[], Any],
    sources: Callable[[], Any],
    ledgers: Callable[[], Any],
) -> None:
    check = "a_staged_rollout_verifies_end_to_end"
    calls = _rollout(rollout, 3, extras=True)
    sink, ledger = fresh(sinks), fresh(ledgers)
    chain: list[str] = []
    for call in calls:
        _stage_ok(sink, call, check)
        await ledger.record(commit_of(call, chain))
        chain = [*chain, call.key]
    manifest = await fresh(ledgers).manifest(rollout)
    receipt = build("RolloutReceipt", receipt_from_manifest(manifest).model_dump(mode="json"))
    snapshots = fresh(sources).fetch([record.staging_key for record in receipt.manifest])
    row = verify_and_linearize(receipt, snapshots)
    _check(row.token_ids == calls[-1].tokens, check, "the verified row's tokens differ from the staged ones")
    log_probs = [lp for call in calls for lp in call.record.generation_log_probs_delta]
    _check(row.logprobs == log_probs, check, "the verified row's log probs differ from the staged ones")
